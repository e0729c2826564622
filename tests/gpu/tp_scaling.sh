#!/usr/bin/env bash
# Tensor-parallel scaling on one host with 2, 4 or 8 GPUs (chapter 09; issue 13). Writes JSON
# under $OUT for figures/data/: greedy parity of the Qwen3-0.6B shape (16 heads, 8 KV heads:
# divisible by 8) in fp32 at every size against TP=1 with CUDA graphs on; NCCL all-reduce
# latency and bus bandwidth by message size for each size; decode-step times at batch 1 and 64
# and nano-vllm workload throughput of the Qwen3-8B and Qwen3-32B shapes (bf16, random
# weights) at every size where they fit.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/gpu/tp_scaling.sh
set -u
OUT=${OUT:-/tmp/nanovllm-tp}; mkdir -p "$OUT"
# NVLink multicast stays off (it is not available on every machine).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
gpus=$(nvidia-smi -L | wc -l)
sizes=1; for n in 2 4 8; do [ "$gpus" -ge "$n" ] && sizes="$sizes $n"; done
echo "GPUs: $gpus; sizes: $sizes"
TP="python3 -m nanovllm.benchmarks.tensor_parallel"
run() { local name=$1; shift; echo "== $name"; local t0=$SECONDS
  timeout 1800 "$@" >"$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"
  grep -v Warning "$OUT/$name.log" | tail -n 12; }
run parity_allreduce $TP --sections parity allreduce --sizes $sizes --out "$OUT/tp_scaling_parity.json"
run qwen3_8b $TP --sections decode --models qwen3-8b --sizes $sizes --out "$OUT/tp_scaling_8b.json"
run qwen3_32b $TP --sections decode --models qwen3-32b --sizes $sizes --out "$OUT/tp_scaling_32b.json"

#!/usr/bin/env bash
# One device session on a GPU machine whose image already has torch, triton, transformers,
# safetensors, xxhash and tqdm (the H200 image). Logs and JSON go to $OUT.
# Usage (repo root): OUT=/some/dir bash tests/gpu/h200_session.sh [part]
#   part 1: GPU tests, the CUDA-graph decode-step benchmark, a profile of decode steps
#   part 2: the end-to-end benchmark against transformers, then again without async scheduling
set -u
OUT=${OUT:-/tmp/nanovllm-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
stage() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 14 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
case "${1:-1}" in
1)
  stage gpu_tests 200 python3 -m pytest -m gpu tests -q -p no:cacheprovider
  stage decode_step 120 python3 -m nanovllm.bench --decode-step --out "$OUT/cuda_graphs_h200.json"
  stage profile 200 python3 -m nanovllm.profiling --out "$OUT/profile_h200.json" ;;
2)
  stage bench 330 python3 -m nanovllm.bench --model qwen3-0.6b --peer hf --peer-requests "${PEER_REQUESTS:-32}" --gpu-memory-utilization 0.5 --out "$OUT/bench_h200.json"
  stage bench_sync 150 python3 -m nanovllm.bench --model qwen3-0.6b --no-async-scheduling --gpu-memory-utilization 0.5 --out "$OUT/bench_h200_sync.json" ;;
esac

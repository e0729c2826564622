#!/usr/bin/env bash
# One device session on a GPU machine whose image already has torch, triton, transformers,
# safetensors, xxhash and tqdm (the H200 image): GPU tests, the CUDA-graph decode-step
# benchmark and the end-to-end benchmark against transformers. Logs and JSON go to $OUT.
# Usage (repo root): OUT=/some/dir bash tests/gpu/h200_session.sh
set -u
OUT=${OUT:-/tmp/nanovllm-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
stage() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 12 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
stage gpu_tests 160 python3 -m pytest -m gpu tests -q -p no:cacheprovider
stage decode_step 120 python3 -m nanovllm.bench --decode-step --out "$OUT/cuda_graphs_h200.json"
stage bench 280 python3 -m nanovllm.bench --model qwen3-0.6b --peer hf --peer-requests "${PEER_REQUESTS:-32}" --gpu-memory-utilization 0.5 --out "$OUT/bench_h200.json"

#!/usr/bin/env bash
# Chapter 16's H200 records (issue 34): the MoE tests on the GPU first (kernel vs reference in
# bf16 on the Qwen3-30B-A3B layer shape, greedy parity with transformers through the kernel and
# CUDA graphs, no host sync in a launch), then nanovllm.benchmarks.moe: the layer at 1, 16, 64,
# 256 tokens per step (fused kernel, per-expert loop, torch grouped_mm), the nano-vllm workload
# on the Qwen3-30B-A3B shape (dummy bf16 weights, ~61 GB) with its MoE bandwidth bound, and on
# the small MoE shape with transformers on its first 8 requests (the record is written before
# the peer starts: a peer cut off by the time limit loses none of ours). At most 6 minutes.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/gpu/moe_h200.sh
set -u
OUT=${OUT:-/tmp/nanovllm-moe}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
MOE="python3 -m nanovllm.benchmarks.moe"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"
  grep -v Warning "$OUT/$name.log" | tail -n 8; }
run moe_tests 80 python3 -m pytest -q -p no:cacheprovider tests/test_moe_gpu.py \
  tests/kernels/test_fused_moe.py
run moe_layer 40 $MOE layer --model qwen3-30b-a3b --tokens 1 16 64 256 --out "$OUT/moe_layer_h200.json"
run moe_30b 160 $MOE workload --model qwen3-30b-a3b --out "$OUT/moe_workload_30b_a3b_h200.json"
run moe_small 80 $MOE workload --model qwen3-moe-small --peer hf --peer-requests 8 \
  --out "$OUT/moe_workload_small_h200.json"
ls -l "$OUT"

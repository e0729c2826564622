#!/usr/bin/env bash
# Cache-aware routing vs round-robin on one H200 (chapter 17, issue 35): two replicas of the
# Qwen3-0.6B shape (random weights, bf16) in one process at gpu_memory_utilization 0.45 each,
# the multi-tenant shared-prefix workload at full length (16 tenants x 8 requests, 2,048-token
# system prompts, Poisson arrivals at 32 requests/s). Two runs: the replicas' whole KV caches
# (no eviction: round-robin pays each prefix once per replica), and caches cut to 1,536 blocks
# (24,576 tokens: less than the 16 prefixes, so round-robin also evicts them). Writes
# $OUT/routing_h200.json and $OUT/routing_h200_small_cache.json for figures/data/. About 3 min.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/gpu/deploy_h200.sh
set -u
OUT=${OUT:-/tmp/nanovllm-deploy}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
BENCH="python3 -m nanovllm.benchmarks.routing --model qwen3-0.6b --replicas 2 --tenants 16
       --per-tenant 8 --length-scale 1 --rate 32 --gpu-memory-utilization 0.45"
run() { local name=$1; shift; echo "== $name"; local t0=$SECONDS
  timeout 600 "$@" >"$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"
  grep -v Warning "$OUT/$name.log" | tail -n 6; }
run routing_h200 $BENCH --out "$OUT/routing_h200.json"
run routing_h200_small_cache $BENCH --num-kv-blocks 1536 --out "$OUT/routing_h200_small_cache.json"

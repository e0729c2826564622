#!/usr/bin/env bash
# One device session on a GPU machine whose image already has torch, triton, transformers,
# safetensors, xxhash and tqdm (the H200 image). Logs and JSON go to $OUT.
# Usage (repo root): OUT=/some/dir bash tests/gpu/h200_session.sh [stage ...]
# Stages (default: all, in this order):
#   gpu_tests    pytest -m gpu tests
#   decode_step  decode-step benchmark: eager vs CUDA graphs, fused kernels on and off
#   profile      decode steps under torch.profiler, async scheduling off and on
#   bench        the nano-vllm workload, then transformers on the first 32 requests
#   bench_sync   the same workload without async scheduling
#   tuning       the workload once per knob setting (nanovllm.benchmarks.tuning)
#   chapters     chapters 05, 07 and 11 executed live (nbval-lax); needs the notebook wheels in
#                .whl (fetch them with /work/shared/gpu/fetch-wheels.sh .whl and carry .whl)
#   executed     the CHAPTERS notebooks executed and saved to $OUT (*.gpu.ipynb), to compare
#                their printed results with the CPU run; needs .whl like `chapters`
#   book_gpu     every chapter (or CHAPTERS) under nbval-lax, each executed once: the
#                nbval_record plugin saves $OUT/NN_name.gpu.ipynb (timed cells) and
#                NN_name.nbval.json; needs .whl (notebooks) and .webwhl (chapter 10) carried, or
#                installed by an earlier call of this stage into /tmp/site and /tmp/web
#   isolation    the fault-isolation, async-engine, async-scheduling and prefix-caching tests
#                on the GPU (bf16, Triton kernels, CUDA graphs, async scheduling on)
#   quant        chapter 08, three stages in a row (each may also run alone):
#     quant_tests  the GPU-marked quantization tests (int8 GEMM, fp8 KV kernels, engine)
#     quant_bench  nanovllm.benchmarks.quantization -> quant_h200.json (sized for < 8 min: weight bytes, KV blocks,
#                  decode steps, layer GEMMs, tok/s of bf16/int8/fp8/fp8+fp8 KV on the
#                  Qwen3-0.6B and Qwen3-8B shapes); QUANT_BENCH_ARGS adds options (--quick)
#     quant_eval   nanovllm.benchmarks.quant_eval on SmolLM2, bf16 -> quant_eval_h200.json (needs the
#                  SmolLM2 weights, see below)
#   serve_load   `nanovllm serve` (Qwen3-0.6B shape, dummy weights) in its own process and the
#                load generator against it -> serve_h200.json; needs the web wheels in .webwhl
#                (pip download fastapi uvicorn prometheus-client pyyaml httpx openai for cp312; chapter 10 needs openai)
#   serve_compare issue 31: nanovllm.benchmarks.serve_compare (offline LLM.generate, then the server
#                with the engine on a thread and in its own process; 4 client processes; rates
#                4/16/64/inf; 256 x 128->64 and 1024 x 128->128) -> serve_compare_h200.json (~8 min)
#   serve_profile issue 31: py-spy (in .webwhl) samples the API process (every thread) and the
#                engine core for 6 s at rate inf -> serve_profile_h200.json (tests/gpu/pyspy_summary.py)
#   quant_sweep  the int8 GEMM tile sweep: best tiles per layer shape printed in
#                quant_sweep.log, all timings in int8_sweep_h200.json (not part of `quant`)
#   troubleshooting  GPU memory for chapter 13: allocator counters, the KV budget, the largest
#                allocations of a memory snapshot, autograd on/off -> troubleshooting_h200.json
#   host_breakdown  chapter 07: the host time of one eager decode_attention call split into
#                validation, allocations, split choice, each Triton launch -> host_breakdown_h200.json
#   benchmarks_smoke  each GPU tool of nanovllm/benchmarks/ once, sized small (the two kernel
#                benchmarks, decode step, profile, throughput) -> $OUT/smoke/*.json, then the
#                run metadata each one recorded; benchmarks_smoke2: the same for tuning and
#                quantization (not part of the default stages)
#   long_context chapter 12: the Triton kernels with a sliding window against a float64
#                reference, window block freeing (tests/test_sliding_window*.py: native
#                Triton, async scheduling), and nanovllm.benchmarks.long_context over 15,360
#                tokens (1.9x SmolLM2's trained length; perplexity by position, fp32)
#                -> 12_long_context_h200.json (needs the SmolLM2 weights, see below)
#   tp_gpus      on 2 GPUs (nvidia-h200-x2): tp_teardown.py (two TP=2 engines one after the other:
#                start and shutdown seconds), then tests/test_tensor_parallel.py on NCCL, each
#                test in its own process (the SmolLM2 TP=3 test runs on the CPU and needs the
#                weights; without them it errors)
#   flash_attn   issue 17: attention_backend="flash_attn" (FlashAttention-4) tested against a
#                float32 reference and the Triton backend (tests/test_flash_attention_backend.py,
#                -s: prints the greedy agreement), then nanovllm.benchmarks.attention_backends
#                (prefill TFLOP/s, decode TB/s, end-to-end tok/s, Triton vs flash-attn)
#                -> attention_backends_h200.json; needs the flash-attn-4 wheels unpacked into
#                /root/site (/work/shared/gpu/fetch-big-wheels.sh .fa flash-attn, then unpack.sh)
#   budget       issue 17: nanovllm.benchmarks.time_budget on the Qwen3-0.6B and SmolLM2-135M
#                shapes (nano-vllm workload, 3 runs in one fresh process with an empty Triton
#                cache: first vs repeat; device time by kernel kind, GPU idle, ideal read
#                times) -> time_budget_{qwen3_0.6b,smollm2_135m}_h200.json, and SmolLM2's
#                decode steps under the profiler (host phases) -> profile_smollm2_h200.json
#   workloads    issue 17: the throughput benchmark's other workloads, each with TTFT/TPOT
#                percentiles (Qwen3-0.6B shape, dummy weights): long-prompts (16 x 8k-32k tokens),
#                shared-prefix (128 requests behind one 2k-token system prompt; prefix-cache hit
#                rate), arrivals (Poisson, 16 requests/s), and the nano-vllm workload with a
#                concurrency sweep (1, 8, 64) -> bench_h200_{long_prompts,shared_prefix,arrivals,
#                latency}.json (about 5 min); WORKLOADS_ARGS adds options (--attention-backend ...)
#   before_after issue 27: the nano-vllm workload with defaults (Qwen3-0.6B shape), alternating an
#                earlier tree and this one, each in a fresh process: before_1, after_1, before_2,
#                after_2 -> state_owner_{before,after}_N_h200.json. The earlier tree's package is
#                carried in .before/nanovllm (git archive REV nanovllm | tar -x -C .before)
# Real SmolLM2 weights: unpack them first (/work/shared/gpu/fetch-big-wheels.sh .smol weights)
# and keep their folder on PYTHONPATH; this script appends to PYTHONPATH, never replaces it.
set -u
OUT=${OUT:-/tmp/nanovllm-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
run() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 14 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
BENCH="python3 -m nanovllm.benchmarks.throughput --model qwen3-0.6b --gpu-memory-utilization 0.5"
stages=${*:-gpu_tests decode_step profile bench bench_sync}
stages=${stages//quant /quant_tests quant_bench quant_eval }  # `quant`: its three parts
[[ $stages == *quant ]] && stages="${stages%quant}quant_tests quant_bench quant_eval"
notebook_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site; }
web_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/web .webwhl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/web; }
# The run metadata (nanovllm/benchmarks/metadata.py) each JSON in folder $1 recorded.
smoke_headers() { python3 -c 'import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    print(f.split("/")[-1], {k: r.get(k) for k in ("device", "date", "command", "torch", "triton",
                                                   "transformers", "git_commit")})' "$1"/*.json; }
# Executes a notebook in chapters/ (as nbval does) and saves it with its outputs.
EXECUTE='import sys, nbformat, nbclient
nb = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": "chapters"}}).execute()
nbformat.write(nb, sys.argv[2])'

for stage in $stages; do
  case $stage in
    gpu_tests) run gpu_tests 200 python3 -m pytest -m gpu tests -q -p no:cacheprovider ;;
    decode_step) run decode_step 120 python3 -m nanovllm.benchmarks.decode_step --out "$OUT/cuda_graphs_h200.json" ;;
    profile) run profile 120 python3 -m nanovllm.benchmarks.profiling --out "$OUT/profile_h200.json" ;;
    bench) run bench 300 $BENCH --peer hf --peer-requests "${PEER_REQUESTS:-32}" --out "$OUT/bench_h200.json" ;;
    bench_sync) run bench_sync 120 $BENCH --no-async-scheduling --out "$OUT/bench_h200_sync.json" ;;
    tuning) run tuning 500 python3 -m nanovllm.benchmarks.tuning --out "$OUT/tuning_h200.json" ;;
    quant_tests) run quant_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_quantization.py tests/kernels/test_int8_gemm.py tests/kernels/test_fp8_kv_kernels.py ;;
    quant_bench) run quant_bench 560 python3 -m nanovllm.benchmarks.quantization --out "$OUT/quant_h200.json" \
      ${QUANT_BENCH_ARGS:-} ;;
    quant_eval) run quant_eval 400 python3 -m nanovllm.benchmarks.quant_eval --device cuda --dtype bfloat16 \
      --json "$OUT/quant_eval_h200.json" ;;
    quant_sweep) run quant_sweep 500 python3 -m nanovllm.benchmarks.quantization --sweep-int8 \
      --out "$OUT/int8_sweep_h200.json" ;;
    serve_load)
      web_wheels
      python3 -m nanovllm.serve nanovllm/configs/qwen3-0.6b --port 8765 --log-level warning \
        --option load_format=dummy --option gpu_memory_utilization=0.5 >"$OUT/serve_server.log" 2>&1 &
      server=$!
      python3 -c 'import time, httpx
for _ in range(360):
    try:
        if httpx.get("http://127.0.0.1:8765/health").status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)'
      run serve_load 420 python3 -m nanovllm.benchmarks.serve --base-url http://127.0.0.1:8765 \
        --rates 4 16 64 inf --num-requests 256 --json "$OUT/serve_h200.json" --figure "$OUT/serve_h200.png"
      kill -TERM $server; wait $server; echo "   server exit $?"; tail -n 5 "$OUT/serve_server.log" ;;
    serve_compare)  # issue 31: offline vs the server, engine on a thread vs in its own process
      web_wheels
      run serve_compare 580 python3 -m nanovllm.benchmarks.serve_compare nanovllm/configs/qwen3-0.6b \
        --option load_format=dummy --option gpu_memory_utilization=0.45 --rates 4 16 64 inf \
        --num-requests 256 --input-len 128 --output-len 64 --large 1024 128 --clients 4 \
        --json "$OUT/serve_compare_h200.json" --figure "$OUT/serve_compare_h200.png" ;;
    serve_profile)  # issue 31: py-spy on the API process and the engine core at rate inf
      web_wheels
      python3 -m nanovllm.serve nanovllm/configs/qwen3-0.6b --port 8766 --log-level warning \
        --option load_format=dummy --option gpu_memory_utilization=0.45 --max-queue-depth 100000 \
        >"$OUT/serve_profile_server.log" 2>&1 &
      server=$!
      python3 -c 'import time, httpx
for _ in range(360):
    try:
        if httpx.get("http://127.0.0.1:8766/health").status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)'
      core=$(for c in $(cat /proc/$server/task/$server/children); do
        grep -qa spawn_main /proc/$c/cmdline && echo $c; done | head -n 1)  # (not the resource tracker)
      python3 -m nanovllm.benchmarks.serve --base-url http://127.0.0.1:8766 --rates inf \
        --num-requests 2048 --output-len 128 >"$OUT/serve_profile_load.log" 2>&1 &
      load=$!
      sleep 5
      /tmp/web/bin/py-spy record -p "$server" --duration 6 --rate 250 --format raw --threads \
        --nonblocking -o "$OUT/api_profile.txt" >"$OUT/pyspy_api.log" 2>&1 &
      /tmp/web/bin/py-spy record -p "$core" --duration 6 --rate 250 --format raw \
        --nonblocking -o "$OUT/core_profile.txt" >"$OUT/pyspy_core.log" 2>&1
      wait $load; tail -n 3 "$OUT/serve_profile_load.log"; tail -n 3 "$OUT"/pyspy_*.log
      kill -TERM $server; wait $server; echo "   server exit $?"
      python3 tests/gpu/pyspy_summary.py "$OUT/api_profile.txt" "$OUT/core_profile.txt" \
        >"$OUT/serve_profile_h200.json"; head -c 3000 "$OUT/serve_profile_h200.json" ;;
    isolation) run isolation 300 python3 -m pytest -q -p no:cacheprovider tests/test_isolation.py \
      tests/test_async_engine.py tests/test_async_scheduling.py tests/test_prefix_caching.py ;;
    executed)
      notebook_wheels
      for nb in ${CHAPTERS:-chapters/04_*.ipynb}; do
        name=$(basename "$nb" .ipynb)
        run "$name.executed" 300 env NANOVLLM_KEEP_FIGURES=1 python3 -c "$EXECUTE" "$nb" "$OUT/$name.gpu.ipynb"
      done ;;
    book_gpu)
      if [ -d .whl ]; then notebook_wheels; fi
      if [ -d .webwhl ]; then web_wheels; fi
      export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/web:$PWD/tests/gpu
      for nb in ${CHAPTERS:-chapters/[0-9][0-9]_*.ipynb}; do
        name=$(basename "$nb" .ipynb)
        run "$name" 400 env NANOVLLM_KEEP_FIGURES=1 PYTHONHASHSEED=0 NBVAL_RECORD_DIR="$OUT" \
          python3 -m pytest --nbval-lax "$nb" --nbval-current-env \
          --nbval-sanitize-with chapters/sanitize.cfg -p no:cacheprovider -q -p nbval_record
      done
      python3 tests/gpu/book_summary.py "$OUT" > "$OUT/book_gpu_h200.json" ;;
    chapters)
      notebook_wheels
      for nb in ${CHAPTERS:-chapters/05_*.ipynb chapters/07_*.ipynb chapters/11_*.ipynb}; do
        name=$(basename "$nb" .ipynb)
        run "$name" 160 env NANOVLLM_KEEP_FIGURES=1 python3 -m pytest --nbval-lax "$nb" \
          --nbval-current-env -p no:cacheprovider -q
      done ;;
    troubleshooting) run troubleshooting 300 python3 tests/gpu/troubleshooting_h200.py \
      --out "$OUT/troubleshooting_h200.json" ;;
    long_context)
      run window_kernels 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_window_kernels.py
      run window_freeing 300 python3 -m pytest -q -p no:cacheprovider tests/test_sliding_window.py \
        tests/test_sliding_window_engine.py
      run long_context 300 python3 -m nanovllm.benchmarks.long_context --device cuda --tokens 15360 \
        --out "$OUT/12_long_context_h200.json" ;;
    host_breakdown) run host_breakdown 120 python3 tests/gpu/host_breakdown.py \
      --out "$OUT/host_breakdown_h200.json" ;;
    tp_gpus)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      run tp_teardown 150 python3 tests/gpu/tp_teardown.py
      # Each test in its own process and time limit: an NCCL hang after a killed peer then
      # costs that test alone, not the rest of the file (2026-11-30 one hung the whole run).
      for id in $(python3 -m pytest -q --collect-only -p no:cacheprovider \
                    tests/test_tensor_parallel.py | grep '::'); do
        name=${id##*::}; run "tp_${name//[^A-Za-z0-9_]/_}" 120 python3 -m pytest -q \
          -p no:cacheprovider "$id"
      done ;;
    flash_attn)  # compiled kernels kept on disk: the benchmark reuses the tests' compilations
      export PYTHONPATH=$PYTHONPATH:/root/site:/root/site/nvidia_cutlass_dsl/dsl_packages \
        FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
      run flash_attn_tests 270 python3 -m pytest -q -s -p no:cacheprovider \
        tests/test_flash_attention_backend.py
      run flash_attn_bench 200 python3 -m nanovllm.benchmarks.attention_backends \
        --out "$OUT/attention_backends_h200.json" ;;
    budget)
      for m in qwen3-0.6b smollm2-135m; do
        TRITON_CACHE_DIR=$(mktemp -d) run "budget_$m" 240 python3 -m nanovllm.benchmarks.time_budget \
          --model "$m" --runs 3 ${BUDGET_ARGS:-} --out "$OUT/time_budget_${m//-/_}_h200.json"
      done
      run profile_smollm2 120 python3 -m nanovllm.benchmarks.profiling --model smollm2-135m \
        --out "$OUT/profile_smollm2_h200.json" ;;
    workloads)
      for w in long-prompts:150 shared-prefix:110 arrivals:110; do  # workload:time limit
        name=${w%:*}
        run "workload_$name" "${w#*:}" $BENCH --workload "$name" ${WORKLOADS_ARGS:-} \
          --out "$OUT/bench_h200_${name//-/_}.json"
      done
      run workload_latency 180 $BENCH --concurrency 1 8 64 ${WORKLOADS_ARGS:-} \
        --out "$OUT/bench_h200_latency.json" ;;
    benchmarks_smoke)  # about 5 min
      S="$OUT/smoke"; mkdir -p "$S"; M="python3 -m nanovllm.benchmarks"
      run smoke_decode_kernel 150 $M.decode_kernel --batches 1 64 --contexts 1024 \
        --block-sizes 16 --out "$S/decode_kernel.json"
      run smoke_prefill_kernel 150 $M.prefill_kernel --block-sizes 256 --out "$S/prefill_kernel.json"
      run smoke_decode_step 120 $M.decode_step --out "$S/decode_step.json"
      run smoke_profiling 120 $M.profiling --num-requests 32 --steps 2 --out "$S/profile.json"
      run smoke_throughput 150 $M.throughput --model qwen3-0.6b --num-requests 32 \
        --gpu-memory-utilization 0.5 --out "$S/throughput.json"
      smoke_headers "$S" ;;
    benchmarks_smoke2)  # about 6 min: the sweeps
      S="$OUT/smoke"; mkdir -p "$S"; M="python3 -m nanovllm.benchmarks"
      run smoke_tuning 330 $M.tuning --num-requests 16 --out "$S/tuning.json"
      run smoke_quantization 240 $M.quantization --quick --shapes qwen3-0.6b --variants bf16 int8 \
        --num-requests 16 --out "$S/quantization.json"
      smoke_headers "$S" ;;
    before_after)
      for i in 1 2; do
        (cd .before && run "before_$i" 240 python3 -m nanovllm.benchmarks.throughput \
          --out "$OUT/state_owner_before_${i}_h200.json")
        run "after_$i" 240 python3 -m nanovllm.benchmarks.throughput \
          --out "$OUT/state_owner_after_${i}_h200.json"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# One replica's capacity at chapter 17's SLO on the H200 (issue 43): `nanovllm serve` (Qwen3-0.6B
# shape, dummy weights, bf16; the engine core in its own process, as the server runs by default)
# and the load generator at request rates that bracket the SLO (TTFT p90 <= 200 ms, TPOT p90 <=
# 25 ms), with the requests of serve_h200.json (256 streamed completions, 128 -> 64 tokens).
# Writes $OUT/capacity_h200.json (the layout of serve_h200.json, which capacity.LatencyCurve
# reads) and the server's log. About 3 min.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/gpu/capacity_h200.sh
# Needs fastapi, starlette, uvicorn and pydantic where the image lacks them: wheels in .webwhl/
# (pip download --no-deps ... fastapi starlette uvicorn pydantic pydantic-core annotated-types
# typing-inspection opentelemetry-api importlib-metadata, for cp312).
set -u
OUT=${OUT:-/tmp/nanovllm-capacity}; mkdir -p "$OUT"
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/web .webwhl/*.whl
  export PYTHONPATH=/tmp/web${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PORT=8766
python3 -m nanovllm.serve nanovllm/configs/qwen3-0.6b --port $PORT --log-level warning \
  --option load_format=dummy --option gpu_memory_utilization=0.5 >"$OUT/capacity_server.log" 2>&1 &
server=$!
python3 - "$PORT" <<'PY'
import sys, time, httpx
for _ in range(480):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
# RATES: the finite rates (first run, 2026-12-06 on an H100: 16-64 req/s all met the SLO, so
# the default now starts there); then, apart and with its own limit, the all-at-once burst
# (that first run's burst of 256 streams did not finish in 5 minutes).
RATES=${RATES:-"64 96 128 160 192"}
timeout 300 python3 -m nanovllm.benchmarks.serve --base-url http://127.0.0.1:$PORT \
  --rates $RATES --num-requests 256 --input-len 128 --output-len 64 \
  --slo-ttft 0.2 --slo-tpot 0.025 --json "$OUT/capacity_h200.json" 2>&1 | tee "$OUT/capacity.log"
status=${PIPESTATUS[0]}
timeout 90 python3 -m nanovllm.benchmarks.serve --base-url http://127.0.0.1:$PORT \
  --rates inf --num-requests 256 --input-len 128 --output-len 64 \
  --slo-ttft 0.2 --slo-tpot 0.025 --json "$OUT/capacity_burst.json" 2>&1 | tee -a "$OUT/capacity.log"
echo "burst rc=${PIPESTATUS[0]}" | tee -a "$OUT/capacity.log"
curl -s -m 5 http://127.0.0.1:$PORT/health | tee -a "$OUT/capacity.log"; echo
kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
exit "$status"

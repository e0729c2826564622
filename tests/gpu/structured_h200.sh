#!/usr/bin/env bash
# Structured output on the H200 (chapter 15, issue 33), < 3 min. JSON to $OUT:
#   structured_check_h200.json  constrained + unconstrained requests on the Qwen3-0.6B shape
#                               (dummy weights, bf16, CUDA graphs, async scheduling): every
#                               constrained output parses/matches, neighbours keep their tokens
#   structured_h200.json        nanovllm.benchmarks.structured_output: mask fill (host) and
#                               apply (device, ours and xgrammar's kernel) per step vs batch size,
#                               and the nano-vllm workload's tok/s with 0, 8 and 64 constrained
# Usage (repo root): OUT=/some/dir bash tests/gpu/structured_h200.sh
# Needs, where the image lacks them (no network there), carried with the run:
#   .xgrwhl/   wheels of xgrammar 0.2.9 and apache-tvm-ffi (+ pydantic, pydantic-core,
#              annotated-types, typing-inspection, jsonschema and its deps if absent), fetched with
#              python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#                --platform any -d .xgrwhl xgrammar==0.2.9 apache-tvm-ffi
#   .tokenizer/ SmolLM2's tokenizer files (cp ~/.cache/nanovllm/SmolLM2-135M-Instruct/tokenizer*.json
#              .tokenizer/) unless $TOKENIZER_DIR or ~/.cache/nanovllm holds them
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
mkdir -p "$OUT"
PY=${PY:-python3}
if ! $PY -c "import xgrammar" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/xgr .xgrwhl/*.whl
  export PYTHONPATH=/tmp/xgr${PYTHONPATH:+:$PYTHONPATH}
fi
TOK=${TOKENIZER_DIR:-$HOME/.cache/nanovllm/SmolLM2-135M-Instruct}
[ -f "$TOK/tokenizer.json" ] || TOK=$PWD/.tokenizer
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TQDM_DISABLE=1 HF_HUB_OFFLINE=1
status=0
timeout 240 $PY tests/gpu/structured_check.py "$OUT/structured_check_h200.json" "$TOK" \
  2>&1 | tee "$OUT/structured_check.log" || status=1
timeout 600 $PY -m nanovllm.benchmarks.structured_output --tokenizer "$TOK" \
  --out "$OUT/structured_h200.json" > "$OUT/structured_bench.log" 2>&1 || status=1
tail -n 40 "$OUT/structured_bench.log"
exit $status

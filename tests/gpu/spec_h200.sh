#!/usr/bin/env bash
# Speculative decoding on the H200 (chapter 14; issue 32). Writes JSON under $OUT for
# figures/data/: speedup vs batch size (1, 4, 16, 64, 256) and vs k (1, 2, 4) for the n-gram,
# self-speculative (draft_layers, 7 of 28 layers) and draft-model (a 7-layer Qwen3) methods on
# the Qwen3-0.6B shape (random weights, bf16; with CUDA graphs, and two methods and the
# baseline eagerly too), SmolLM2's acceptance by position on real text when its converted
# weights are in ~/.cache/nanovllm; the CPU-independent tests of the rejection sampler and
# n-gram proposer; and greedy exactness in fp32 on the GPU: every method with CUDA graphs,
# eagerly and with async scheduling against plain eager decoding. Stages: unit exact bench
# (default: all). Expected runtime: under 7 minutes.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tests/gpu/spec_h200.sh [stage ...]
set -u
export OUT=${OUT:-/tmp/nanovllm-spec}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
run() { local name=$1; shift; echo "== $name"; local t0=$SECONDS
  timeout 600 "$@" >"$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"
  grep -v Warning "$OUT/$name.log" | tail -n 8; }
stages=${*:-unit exact bench}
want() { [[ " $stages " == *" $1 "* ]]; }
want unit && run unit python3 -m pytest -q tests/test_spec_decode_sampler.py -k "not per_position"
want exact && run exact python3 - <<'PY'
import json, os, random
from nanovllm import LLM, SamplingParams
from nanovllm.weights.smollm2 import cache_dir
path = cache_dir() / "SmolLM2-135M-Instruct"
if not (path / "model.safetensors").is_file():
    print("no SmolLM2 weights: skipped"); raise SystemExit(0)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 40, 64)]
prompts.append([rng.randrange(100, 40000) for _ in range(8)] * 4)  # repetitive: n-gram hits
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ref = [o.token_ids for o in LLM(str(path), dtype="float32", enforce_eager=True)
       .generate(prompts, params, use_tqdm=False)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
LAYERS = {"method": "draft_layers", "num_layers": 20, "num_speculative_tokens": 3}
SELF = {"model": str(path), "num_speculative_tokens": 3}  # the target as its own draft
cases = {"ngram eager": (NGRAM, {"enforce_eager": True}), "ngram graphs": (NGRAM, {}),
         "ngram graphs async": (NGRAM, {"async_scheduling": True}),
         "draft_layers eager": (LAYERS, {"enforce_eager": True}),
         "draft_layers graphs": (LAYERS, {}),
         "draft_layers graphs async": (LAYERS, {"async_scheduling": True}),
         "draft_model graphs": (SELF, {"gpu_memory_utilization": 0.4})}
result = {}
for name, (spec, options) in cases.items():
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **options)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    result[name] = {"equal": got == ref, "graphs": llm.engine.runner.graphs is not None,
                    "acceptance": llm.engine.speculator.stats.acceptance_rate}
    print(name, result[name], flush=True)
    llm.shutdown()
json.dump(result, open(os.path.join(os.environ["OUT"], "spec_exact_h200.json"), "w"), indent=2)
PY
want bench && run bench python3 -m nanovllm.benchmarks.spec_decode --model qwen3-0.6b --smollm2 \
  --out "$OUT/spec_decode_h200.json"
ls -l "$OUT"

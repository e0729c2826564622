"""Structured output on a GPU (chapter 15): the Qwen3-0.6B shape with dummy weights and
SmolLM2's tokenizer, float32 (DTYPE=bfloat16 for bf16), CUDA graphs and async scheduling on.
Constrained requests (JSON schemas, a regex, a choice; greedy and sampled hot, n = 2) share
batches with unconstrained ones: every constrained output must parse and match, and the
unconstrained ones must get the tokens they get alone. Writes a JSON summary to argv[1]; exits
non-zero on a failure.
Usage: [DTYPE=bfloat16] python tests/gpu/structured_check.py OUT.json TOKENIZER_DIR
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.benchmarks.structured_output import model_folder

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object",
         "properties": {"item": {"enum": ["tea", "coffee"]}, "hot": {"type": "boolean"},
                        "sizes": {"type": "array", "maxItems": 3,
                                  "items": {"type": "integer", "minimum": 1, "maximum": 9}}},
         "required": ["item", "hot"], "additionalProperties": False}
PHONE = r"\d{3}-\d{4}"


def valid(schema: dict, text: str) -> bool:
    try:
        import jsonschema
    except ImportError:  # the image may lack it: parse and check the keys at least
        value = json.loads(text)
        return isinstance(value, dict) and set(schema["required"]) <= set(value)
    jsonschema.validate(json.loads(text), schema)
    return True


def main(out: Path, tokenizer_dir: Path) -> int:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder("qwen3-0.6b", tokenizer_dir, Path(tmp))
        # float32 by default: in bf16 another batch composition rounds differently, and with random
        # weights near-tied greedy tokens flip (figures/data/structured_check_h100.json shows both)
        dtype = os.environ.get("DTYPE", "float32")
        llm = LLM(str(folder), load_format="dummy", max_model_len=512, dtype=dtype)
        plain_prompts = [[(7 * i + j) % 10000 for j in range(20 + 9 * i)] for i in range(6)]
        plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        alone = llm.generate(plain_prompts, plain, use_tqdm=False)
        constrained = []
        for schema in (PERSON, ORDER):
            for temp in (0.0, 1.5):
                so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
                constrained.append((schema, SamplingParams(
                    temperature=temp, n=2, seed=1, max_tokens=64, structured_outputs=so)))
        constrained.append(("regex", SamplingParams(
            temperature=1.0, seed=2, max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex=PHONE))))
        constrained.append(("choice", SamplingParams(
            temperature=0, max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))))
        prompts = [[1, 2, 3, 4, 5]] * len(constrained) + plain_prompts
        params = [p for _, p in constrained] + [plain] * len(plain_prompts)
        outs = llm.generate(prompts, params, use_tqdm=False)
        failures, samples = [], []
        for (kind, _), request in zip(constrained, outs):
            for sample in request.outputs:
                text = sample.text
                samples.append({"constraint": kind if isinstance(kind, str) else "json",
                                "text": text, "finish_reason": sample.finish_reason})
                if kind == "regex":
                    ok = re.fullmatch(PHONE, text) is not None
                elif kind == "choice":
                    ok = text in ("red", "green", "blue")
                else:
                    try:
                        ok = valid(kind, text)
                    except Exception:
                        ok = False
                if not ok or sample.finish_reason != "stop":
                    failures.append(f"{kind if isinstance(kind, str) else 'json'}: {text!r} "
                                    f"({sample.finish_reason})")
        for i, (mixed, a) in enumerate(zip(outs[len(constrained):], alone)):
            if mixed.outputs[0].token_ids != a.outputs[0].token_ids:
                failures.append(f"unconstrained request {i} changed beside constrained ones")
    result = {"check": "structured_output_gpu", "dtype": dtype, "samples": samples,
              "failures": failures,
              "async_scheduling": llm.config.async_scheduling,
              "seconds": time.perf_counter() - start}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))

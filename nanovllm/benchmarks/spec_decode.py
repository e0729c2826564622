"""Where speculative decoding pays (chapter 14): speedup over plain decoding vs batch size
and vs the number of proposals k, for the n-gram, self-speculative (draft_layers) and
draft-model methods; and, when SmolLM2's converted weights are present, its acceptance by
position on real text.

Random weights (``--model qwen3-0.6b``: the shipped config, ``load_format="dummy"``) decide
what is accepted: prompt lookup finds the repeats a random model's greedy output falls into,
while a random draft agrees with the random target almost never, so the model drafts' rows
show what their passes cost at acceptance ~0. Each run records its acceptance and steps, so
the chapter can price other acceptance rates; real text's rates come from SmolLM2. The
draft model is the target's config cut to ``--draft-layers`` layers (its own random
weights). Every method runs with CUDA graphs on a GPU (verify steps replay the decode graphs,
a row per token; draft passes their own); the baseline and two speculative rows also run
eagerly, to show what the graphs are worth.

    python -m nanovllm.benchmarks.spec_decode --out spec.json            # GPU: Qwen3-0.6B shape
    python -m nanovllm.benchmarks.spec_decode --tiny --batch-sizes 1 4 --ks 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.workload import resolve_model
from nanovllm.configs import SHIPPED, config_path
from nanovllm.weights.smollm2 import cache_dir

TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
              "vocab_size": 512, "max_position_embeddings": 2048}


def config_folder(base: str, prefix: str, **changes) -> str:
    """A new folder holding ``base``'s config.json with ``changes`` (random weights)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    config = json.loads((Path(base) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


def tiny_model() -> str:
    """A folder with the Qwen3-0.6B config shrunk to toy sizes (random weights): the CPU path."""
    return config_folder(str(config_path("qwen3-0.6b")), "nanovllm_spec_tiny_", **TINY_SIZES,
                         eos_token_id=0, bos_token_id=1)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(batch)]


def timed_generate(llm: LLM, batch: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Generate ``batch`` ``repeats`` times after a warm-up; the fastest run's numbers (greedy:
    every run makes the same tokens and proposals) and every run's seconds."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels compiled, graphs captured
    spec = llm.engine.speculator
    times = []
    for _ in range(repeats):
        before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else (0, 0)
        steps_before = llm.engine.stats.num_steps
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds, tokens = min(times), sum(len(o.token_ids) for o in outs)
    result = {"batch": len(batch), "seconds": seconds, "seconds_per_run": times,
              "output_tokens": tokens, "tokens_per_s": tokens / seconds,
              "steps": llm.engine.stats.num_steps - steps_before}
    if spec:
        drafted = spec.stats.num_draft_tokens - before[0]
        accepted = spec.stats.num_accepted_tokens - before[1]
        result |= {"draft_tokens": drafted, "accepted_tokens": accepted,
                   "acceptance": accepted / drafted if drafted else 0.0}
    return result


def sweep(path: str, load_format: str, args, engine_options: dict, vocab: int) -> list[dict]:
    """Every (method, k) and the baselines over every batch size: one engine each."""
    configs = [("none (CUDA graphs)", None, {}), ("none (eager)", None, {"enforce_eager": True})]
    if not torch.cuda.is_available():
        configs = configs[1:]  # (no graphs on a CPU)
    draft = config_folder(path, "nanovllm_spec_draft_", num_hidden_layers=args.draft_layers)
    methods = {
        "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_layers": lambda k: {"method": "draft_layers", "num_layers": args.draft_layers,
                                   "num_speculative_tokens": k},
        "draft_model": lambda k: {"model": draft, "num_speculative_tokens": k},
    }
    for k in args.ks:
        for name, spec in methods.items():
            configs.append((name, k, {"speculative_config": spec(k)}))
    if torch.cuda.is_available():  # what CUDA graphs are worth to verify steps
        k = args.ks[len(args.ks) // 2]
        for name in ("ngram", "draft_layers"):
            configs.append((f"{name} (eager)", k, {"speculative_config": methods[name](k),
                                                   "enforce_eager": True}))
    runs = []
    for method, k, options in configs:
        llm = LLM(path, load_format=load_format, **engine_options, **options)
        for batch in args.batch_sizes:
            work = prompts(batch, args.prompt_len, vocab)
            row = {"method": method, "k": k,
                   **timed_generate(llm, work, args.max_tokens, args.repeats)}
            print(json.dumps(row), flush=True)
            runs.append(row)
        llm.shutdown()
    return runs


def smollm2_acceptance(args) -> dict | None:
    """Acceptance by position on real text with SmolLM2, and each method's speedup over plain
    decoding of the same texts (the fastest of ``--repeats`` runs each; None without its
    weights)."""
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if not (folder / "model.safetensors").is_file():
        return None
    text = (Path(__file__).parents[1] / "data" / "alice_in_wonderland_ch1-2.txt").read_text()
    quoted = text[:1500]
    work = {"continue": [text[i : i + 600] for i in range(0, 600 * args.smol_prompts, 600)],
            "quote": [f"{quoted}\n\nCopy the first paragraph above exactly:\n"]}
    specs = [None] + [{"method": "draft_layers", "num_layers": n, "num_speculative_tokens": 3}
                      for n in args.smol_layers]
    specs.append({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain: dict[str, float] = {}
    results = []
    for spec in specs:
        llm = LLM(str(folder), speculative_config=spec)
        for name, texts in work.items():
            llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
            if spec is not None:
                llm.engine.speculator.stats.__init__(spec["num_speculative_tokens"])
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.generate(texts, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            row = {"method": "none", "workload": name, "seconds": min(times)}
            if spec is None:
                plain[name] = min(times)
            else:
                stats = llm.engine.speculator.stats
                row |= {**spec, "speedup": plain[name] / min(times),
                        "acceptance": stats.acceptance_rate,
                        "acceptance_by_position": stats.acceptance_by_position,
                        "mean_tokens_per_draft": stats.mean_tokens_per_draft}
            results.append(row)
            print(json.dumps(row), flush=True)
        llm.shutdown()
    return {"model": "SmolLM2-135M-Instruct", "runs": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="speculative decoding: speedup and acceptance")
    parser.add_argument("--model", default=None,
                        help=f"a model folder or a shipped config ({', '.join(SHIPPED)})")
    parser.add_argument("--tiny", action="store_true", help="a toy Qwen3 shape (CPU runs)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="layers of the self-speculative draft (default: a quarter)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the fastest counts")
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2's acceptance")
    parser.add_argument("--smol-layers", type=int, nargs="+", default=[10, 20, 26, 28])
    parser.add_argument("--smol-prompts", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        path, load_format = tiny_model(), "dummy"
    else:
        path, load_format = resolve_model(args.model or "qwen3-0.6b", device)
    config = json.loads((Path(path) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    args.draft_layers = args.draft_layers or max(1, layers // 4)
    max_len = args.prompt_len + args.max_tokens + max(args.ks) + 16
    # The same cache for every engine, room for the largest batch: a draft model's cache then
    # fits beside it (by default the target's takes the whole memory share).
    engine_options = {"max_num_seqs": max(args.batch_sizes), "max_model_len": max_len,
                      "num_kv_blocks": max(args.batch_sizes) * (-(-max_len // 16) + 1)}
    results = {**run_metadata("nanovllm.benchmarks.spec_decode", argv, device),
               "model": args.model or ("tiny" if args.tiny else "qwen3-0.6b"),
               "load_format": load_format, "num_layers": layers,
               "draft_layers": args.draft_layers, "prompt_len": args.prompt_len,
               "max_tokens": args.max_tokens, "repeats": args.repeats,
               "runs": sweep(path, load_format, args, engine_options, config["vocab_size"])}
    if args.smollm2:
        results["smollm2"] = smollm2_acceptance(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

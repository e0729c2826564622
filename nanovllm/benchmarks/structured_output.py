"""``python -m nanovllm.benchmarks.structured_output``: what constrained decoding costs
(chapter 15).

Two measurements, recorded as JSON:

- ``mask_cost``: per engine step, at each batch size B (every row constrained by the same JSON
  schema, the matchers at different points of a valid output), the host time to fill B packed
  masks (``masks.fill_bitmask``, xgrammar's matchers) and the time to copy them to the device
  and apply them to ``[B, V]`` logits (``masks.apply_token_bitmask``; on a GPU also xgrammar's
  own kernel, for comparison).
- ``overlap``: engine steps under async scheduling at each batch size, every request
  constrained (a JSON-like grammar that never completes) and then none: the host's matcher
  work per step (``fill_ms``: the masks; ``accept_ms``: advancing the matchers with the landed
  tokens; ``matcher_share``: their part of the constrained step), the forward pass they run
  under (``forward_ms``, host clock), and the two steps' wall times (``exposed_ms``: their
  difference). ``hideable_fraction``, forward over matcher time (capped at 1), is how much of
  the matcher work fits under the forward pass on a device that runs apart from the host.
  ``hidden_fraction`` is how much did not lengthen the step: on a GPU ``1 - exposed/matcher``
  (clamped to [0, 1]); on a CPU 0 by construction, since the "device" is the host's own
  thread and nothing overlaps (and a step difference there is noise next to the matcher time).
- ``throughput``: output tokens/s of a workload (``workload.py``'s ``nano-vllm`` on a GPU,
  ``cpu`` on a CPU) with no constrained request, then with ``k`` of them (a JSON schema that
  never has to end: an array of strings).

Dummy weights need a tokenizer for xgrammar: ``--tokenizer DIR`` (default SmolLM2's, in
``~/.cache/nanovllm``) is copied beside the model's config (``model_folder``); its vocabulary is
padded to the model's. On a CPU ``--quick`` sizes everything small (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import stopwatch, time_calls
from nanovllm.benchmarks.workload import free, make_workload, request_params, warm_up
from nanovllm.configs import config_path
from nanovllm.structured_output import masks
from nanovllm.structured_output.backend_xgrammar import GrammarBackend, GrammarState
from nanovllm.structured_output.masks import apply_token_bitmask, fill_bitmask
from nanovllm.tokenizer import load_tokenizer

# A realistic schema for the mask cost: nested objects, strings, numbers, an enum, an array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
}
EXAMPLE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
           "tags": ["math", "engines"], "address": {"city": "London", "zip": "W1"},
           "status": "active"}
# For throughput: a constraint that never has to end, so constrained requests run to their
# length like the others (and the token counts stay comparable).
ENDLESS = StructuredOutputsParams(json={"type": "array", "items": {"type": "string"}})


# For the overlap: a JSON-like list that never completes (EOS is never allowed), so every
# request stays constrained for as many steps as it is timed.
NEVER_ENDS = StructuredOutputsParams(grammar=(
    'root ::= "[" item ("," item)*\n'
    'item ::= "{\\"name\\": \\"" [a-zA-Z ]* "\\", \\"age\\": " [0-9]+ "}"'))


def default_tokenizer_dir() -> Path:
    return Path.home() / ".cache" / "nanovllm" / "SmolLM2-135M-Instruct"


def model_folder(config: str, tokenizer_dir: Path, dest: Path) -> Path:
    """A folder with shipped config ``config`` (dummy weights) and the tokenizer's files."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_path(config) / "config.json", dest / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def mask_cost(folder: Path, batch_sizes: list[int], device: str, reps: int) -> list[dict]:
    """Fill (host) and apply (device) times of one step's masks at each batch size."""
    config = json.loads((folder / "config.json").read_text())
    vocab = config["vocab_size"]
    tokenizer = load_tokenizer(str(folder))
    backend = GrammarBackend(tokenizer.hf, vocab, {tokenizer.eos_token_id})
    params = StructuredOutputsParams(json=SCHEMA)
    path = tokenizer.encode(json.dumps(EXAMPLE), add_special_tokens=False)
    rows = []
    for batch in batch_sizes:
        seqs = []
        for i in range(batch):  # matchers spread along a valid output
            state = backend.new_state(params)
            for token in path[: i % len(path)]:
                state.accept(token)
            seqs.append(SimpleNamespace(grammar=state))
        row = {"batch_size": batch, "vocab_size": vocab, **step_costs(seqs, vocab, device, reps)}
        rows.append(row)
    return rows


def step_costs(seqs: list, vocab: int, device: str, reps: int) -> dict:
    """Median ms to fill the masks of ``seqs`` on the host, and to copy and apply them to
    ``[len(seqs), vocab]`` logits on ``device`` (and with xgrammar's kernel on a GPU)."""
    logits = torch.randn(len(seqs), vocab, device=device)
    row_ids = torch.arange(len(seqs), device=device)
    fill = time_calls(lambda: fill_bitmask(seqs, vocab), reps)
    _, bitmask = fill_bitmask(seqs, vocab)
    gpu = device.startswith("cuda")

    def apply() -> None:
        mask = bitmask.pin_memory() if gpu else bitmask
        apply_token_bitmask(logits, mask.to(device, non_blocking=True), row_ids)

    costs = {"fill_ms": 1e3 * statistics.median(fill),
             "apply_ms": 1e3 * statistics.median(time_calls(apply, reps, device=device))}
    if gpu:
        import xgrammar as xgr

        on_device = bitmask.to(device)
        kernel = lambda: xgr.apply_token_bitmask_inplace(logits, on_device)  # noqa: E731
        costs["apply_xgrammar_kernel_ms"] = 1e3 * statistics.median(
            time_calls(kernel, reps, device=device))
    return costs


def overlap(folder: Path, batch_sizes: list[int], device: str, steps: int, warm: int = 3,
            options: dict | None = None) -> list[dict]:
    """Median per-step costs of ``steps`` decode steps (after ``warm``) at each batch size,
    constrained and not, under async scheduling (see the module docstring)."""
    llm = LLM(str(folder), load_format="dummy", device=device, async_scheduling=True,
              max_model_len=256, **(options or {}))
    try:
        return [overlap_row(llm.engine, batch, steps, warm) for batch in batch_sizes]
    finally:
        free(llm)


def overlap_row(engine, batch: int, steps: int, warm: int) -> dict:
    """One batch size's ``overlap`` record, on an engine with async scheduling."""
    plain = _timed_steps(engine, batch, None, steps, warm)
    held = _timed_steps(engine, batch, NEVER_ENDS, steps, warm)
    matcher_ms = held["fill_ms"] + held["accept_ms"]
    exposed = held["step_ms"] - plain["step_ms"]
    gpu = engine.runner.device.type == "cuda"
    return {
        "batch_size": batch, "step_ms_unconstrained": plain["step_ms"],
        "step_ms_constrained": held["step_ms"], "fill_ms": held["fill_ms"],
        "accept_ms": held["accept_ms"], "forward_ms": held["forward_ms"],
        "matcher_share": matcher_ms / held["step_ms"], "exposed_ms": exposed,
        "hideable_fraction": min(1.0, held["forward_ms"] / matcher_ms),
        "hidden_fraction": min(1.0, max(0.0, 1 - exposed / matcher_ms)) if gpu else 0.0,
    }


def _timed_steps(engine, batch: int, constraint: StructuredOutputsParams | None, steps: int,
                 warm: int) -> dict[str, float]:
    """``batch`` requests of 8 prompt tokens; per timed step (medians): the step's wall time,
    and the time inside the mask fill, the matchers' accept and the forward pass."""
    params = SamplingParams(max_tokens=warm + steps + 2, ignore_eos=True,
                            structured_outputs=constraint)
    ids = [engine.add_request(None, [1 + (i + j) % 500 for j in range(8)], params)
           for i in range(batch)]
    spent = {"fill": 0.0, "accept": 0.0, "forward": 0.0}
    targets = [(masks, "fill_bitmask", "fill"), (GrammarState, "accept", "accept"),
               (engine.runner, "_forward", "forward")]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, key in targets:
        setattr(obj, name, _clocked(getattr(obj, name), spent, key))
    try:
        for _ in range(warm):
            engine.step()
        per_step = {key: [] for key in ("step", *spent)}
        for _ in range(steps):
            before = dict(spent)
            start = time.perf_counter()
            engine.step()
            per_step["step"].append(time.perf_counter() - start)
            for key in spent:
                per_step[key].append(spent[key] - before[key])
    finally:
        for obj, name, original in originals:
            setattr(obj, name, original)
        engine.abort_request(ids)
    return {f"{key}_ms": 1e3 * statistics.median(v) for key, v in per_step.items()}


def _clocked(fn, spent: dict[str, float], key: str):
    """``fn``, adding its host time to ``spent[key]``."""
    def clocked(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return clocked


def throughput(folder: Path, workload: str, num_requests: int | None, max_tokens: int | None,
               constrained: list[int], device: str, options: dict, warm: bool = True
               ) -> list[dict]:
    """Output tokens/s of the workload with ``k`` constrained requests, for each ``k``
    (after ``workload.warm_up`` unless not ``warm``: the quick CPU test skips it)."""
    work = make_workload(workload, num_requests)
    if max_tokens is not None:
        work.output_lens = [min(n, max_tokens) for n in work.output_lens]
    llm = LLM(str(folder), load_format="dummy", device=device,
              max_model_len=max(work.max_model_len, 256), **options)
    if warm:
        warm_up(llm)
    results = []
    try:
        for k in constrained:
            params = request_params(work)
            for i in range(min(k, len(params))):  # spread over the workload
                j = i * len(params) // max(k, 1)
                params[j] = replace(params[j], structured_outputs=ENDLESS)
            llm.generate(work.prompts[:2], params[:2], use_tqdm=False)  # compile the constraint
            with stopwatch(device) as watch:
                outs = llm.generate(work.prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results.append({"constrained_requests": k, "requests": len(params),
                            "output_tokens": tokens, "seconds": watch.seconds,
                            "output_tok_s": tokens / watch.seconds})
    finally:
        free(llm)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default=None, help="a shipped config (dummy weights); "
                        "default qwen3-0.6b on a GPU, smollm2-135m on a CPU")
    parser.add_argument("--tokenizer", type=Path, default=default_tokenizer_dir())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--workload", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap each request's output length")
    parser.add_argument("--constrained", type=int, nargs="+", default=[0, 8, 64])
    parser.add_argument("--overlap-steps", type=int, default=None,
                        help="decode steps timed per batch size for the overlap")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU test)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-overlap", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    config = args.config or ("qwen3-0.6b" if gpu else "smollm2-135m")
    batch_sizes = args.batch_sizes or ([1, 8] if args.quick else [1, 8, 32, 128, 256])
    reps = args.reps or (3 if args.quick else 20)
    options = {} if gpu else {"num_kv_blocks": 64}
    if args.quick:
        args.num_requests, args.max_tokens = args.num_requests or 4, args.max_tokens or 6
        args.constrained = [0, 2]
    result = {"meta": run_metadata("nanovllm.benchmarks.structured_output", argv, args.device),
              "config": config, "tokenizer": str(args.tokenizer)}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(config, args.tokenizer, Path(tmp))
        result["mask_cost"] = mask_cost(folder, batch_sizes, args.device, reps)
        if not args.skip_overlap:
            result["overlap"] = overlap(folder, batch_sizes, args.device,
                                        args.overlap_steps or (2 if args.quick else 10),
                                        warm=1 if args.quick else 3,
                                        options={} if gpu else {"num_kv_blocks": 256})
        if not args.skip_throughput:
            workload = args.workload or ("nano-vllm" if gpu else "cpu")
            result["workload"] = workload
            result["throughput"] = throughput(folder, workload, args.num_requests,
                                              args.max_tokens, args.constrained, args.device,
                                              options, warm=not args.quick)
    result["seconds"] = time.perf_counter() - start
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()

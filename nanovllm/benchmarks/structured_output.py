"""``python -m nanovllm.benchmarks.structured_output``: what constrained decoding costs
(chapter 15).

Two measurements, recorded as JSON:

- ``mask_cost``: per engine step, at each batch size B (every row constrained by the same JSON
  schema, the matchers at different points of a valid output), the host time to fill B packed
  masks (``masks.fill_bitmask``, xgrammar's matchers) and the time to copy them to the device
  and apply them to ``[B, V]`` logits (``masks.apply_token_bitmask``; on a GPU also xgrammar's
  own kernel, for comparison).
- ``throughput``: output tokens/s of a workload (``workload.py``'s ``nano-vllm`` on a GPU,
  ``cpu`` on a CPU) with no constrained request, then with ``k`` of them (a JSON schema that
  never has to end: an array of strings). A step with a constrained request runs synchronously
  under async scheduling (``LLMEngine.step``), so this also measures what that costs.

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

from nanovllm import LLM, StructuredOutputsParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import stopwatch, time_calls
from nanovllm.benchmarks.workload import free, make_workload, request_params, warm_up
from nanovllm.configs import config_path
from nanovllm.structured_output.backend_xgrammar import GrammarBackend
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
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU test)")
    parser.add_argument("--skip-throughput", action="store_true")
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

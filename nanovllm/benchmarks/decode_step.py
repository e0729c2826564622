"""One engine decode step timed eager and with CUDA graphs, fused kernels on and off
(chapters 07 and 11).

    python -m nanovllm.benchmarks.decode_step --out cuda_graphs.json
    python -m nanovllm.benchmarks.throughput --decode-step --out cuda_graphs.json   # the same

A batch of sequences whose prompts are "already cached" (their KV slots hold random values)
takes one decode step at a time through ``ModelRunner.run``: prepare the inputs, run the
model, sample. That isolates what CUDA graphs and the fused kernels change per step.
It can also time an engine built elsewhere (``quantization.py`` passes quantized engines,
chapter 08).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import time_loop
from nanovllm.configs import config_path
from nanovllm.layers.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS

FILL_CHUNK = 1 << 26  # elements filled per randn draw in fill_random_ (128 MiB of fp16)


@torch.inference_mode()
def decode_step_benchmark(
    model: str | LLM,
    batches: list[int],
    context: int,
    iters: int = 30,
    modes: tuple[str, ...] = ("eager", "graphs"),
    unfused: bool = True,
    **engine_options,
) -> list[dict]:
    """Time one engine decode step (prepare + forward + sample) eager and with CUDA graphs,
    with the fused Triton kernels on and off.

    ``model``: a shipped config name (random weights; ``engine_options`` such as
    ``quantization`` or ``kv_cache_dtype`` go to ``LLM``), or an ``LLM`` already built, timed
    as it is (it needs ``max_num_seqs >= max(batches)`` and ``max_model_len > context``).
    One row per batch size with ``{mode}_ms`` for each of ``modes`` ("graphs" runs eager where
    the engine captured none, e.g. on CPU); ``unfused=True`` also times every mode with the
    fused kernels off (``{mode}_unfused_ms``; the engine stays unfused afterwards).
    """
    from nanovllm.engine.scheduler_output import SchedulerOutput
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.fused import set_fused_kernels

    llm = model if isinstance(model, LLM) else LLM(
        str(config_path(model)),
        load_format="dummy",
        max_num_seqs=max(batches),
        max_model_len=context + 64,
        **engine_options,
    )
    engine, runner = llm.engine, llm.engine.runner
    fill_random_(runner.kv_cache)  # time on real-looking data, not on whatever memory held
    rng = random.Random(0)
    rows = []
    for size in batches:
        batch = SchedulerOutput()
        for _ in range(size):
            seq = Sequence(
                [rng.randint(0, 10000) for _ in range(context)],
                SamplingParams(temperature=0, max_tokens=1),
            )
            assert engine.block_manager.allocate(seq, context)
            seq.num_computed_tokens = context - 1  # the prompt's KV is "already cached"
            batch.add(seq, 1)
        rows.append({"batch": size, "context": context, "batch_seqs": batch})
    # Fused kernels on (the engine's default), then off, with graphs recaptured without them.
    for fused in (True, False) if unfused else (True,):
        if not fused:
            set_fused_kernels(runner.model, False)
            if runner.graphs is not None:
                runner.capture_graphs()
        suffix = "" if fused else "_unfused"
        for row in rows:
            for mode in modes:
                graphs, runner.graphs = runner.graphs, runner.graphs if mode == "graphs" else None
                row[f"{mode}{suffix}_ms"] = _time_steps(runner, row["batch_seqs"], iters) * 1e3
                runner.graphs = graphs
    for row in rows:
        for seq in row.pop("batch_seqs").seqs:
            engine.block_manager.free(seq)
        if "eager_ms" in row and "graphs_ms" in row:
            row["speedup"] = row["eager_ms"] / row["graphs_ms"]
        if "graphs_unfused_ms" in row:
            row["fusion_speedup_graphs"] = row["graphs_unfused_ms"] / row["graphs_ms"]
        print(row, flush=True)
    return rows


def fill_random_(cache: torch.Tensor) -> None:
    """Fill ``cache`` with standard normal values in place, whatever its dtype.

    ``normal_`` has no kernel for float8 (an fp8 KV cache), so those caches are filled from
    fp16 draws, a chunk at a time: a full-size temporary would not fit beside a cache that
    takes most of the GPU."""
    if cache.dtype.itemsize > 1:
        cache.normal_()
        return
    flat = cache.view(-1)
    for start in range(0, flat.numel(), FILL_CHUNK):
        part = flat[start : start + FILL_CHUNK]
        part.copy_(torch.randn(part.numel(), dtype=torch.float16, device=cache.device))


def _time_steps(runner, batch, iters: int) -> float:
    """Seconds per ``runner.run(batch)``, after three untimed warm-up steps."""
    return time_loop(lambda: runner.run(batch), iters, warmup=3, device=runner.device)


def record(model: str, out: Path | None, meta: dict, **engine_options) -> list[dict]:
    """Batches 1, 64 and 256 at context 1024 (the chapters' table); written to ``out`` as JSON
    after ``meta`` (``run_metadata``) and ``engine_options`` (quantization, KV dtype)."""
    rows = decode_step_benchmark(model, [1, 64, 256], 1024, **engine_options)
    if out:
        out.write_text(json.dumps({**meta, **engine_options, "rows": rows}, indent=2))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a shipped config (random weights)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    meta = run_metadata("nanovllm.benchmarks.decode_step", argv)
    record(args.model, args.out, meta, quantization=args.quantization,
           kv_cache_dtype=args.kv_cache_dtype)


if __name__ == "__main__":
    main()

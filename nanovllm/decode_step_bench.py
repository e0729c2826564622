"""One engine decode step timed eager and with CUDA graphs, fused kernels on and off
(chapters 07 and 11; ``python -m nanovllm.bench --decode-step`` runs it).

A batch of sequences whose prompts are "already cached" (their KV slots hold random values)
takes one decode step at a time through ``ModelRunner.run``: prepare the inputs, run the
model, sample. That isolates what CUDA graphs and the fused kernels change per step.
"""

from __future__ import annotations

import random
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path


@torch.inference_mode()
def decode_step_benchmark(
    model: str, batches: list[int], context: int, iters: int = 30
) -> list[dict]:
    """Time one engine decode step (prepare + forward + sample) eager and with CUDA graphs,
    with the fused Triton kernels on and off."""
    from nanovllm.engine.scheduler import ScheduledBatch
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.fused import set_fused_kernels

    llm = LLM(
        str(config_path(model)),
        load_format="dummy",
        max_num_seqs=max(batches),
        max_model_len=context + 64,
    )
    engine, runner = llm.engine, llm.engine.runner
    runner.kv_cache.normal_()  # time on real-looking data, not on whatever memory held
    rng = random.Random(0)
    rows = []
    for size in batches:
        batch = ScheduledBatch()
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
    for fused in (True, False):
        if not fused:
            set_fused_kernels(runner.model, False)
            runner.capture_graphs()
        suffix = "" if fused else "_unfused"
        for row in rows:
            for mode in ("eager", "graphs"):
                graphs, runner.graphs = runner.graphs, runner.graphs if mode == "graphs" else None
                row[f"{mode}{suffix}_ms"] = _time_steps(runner, row["batch_seqs"], iters) * 1e3
                runner.graphs = graphs
    for row in rows:
        for seq in row.pop("batch_seqs").seqs:
            engine.block_manager.free(seq)
        row["speedup"] = row["eager_ms"] / row["graphs_ms"]
        row["fusion_speedup_graphs"] = row["graphs_unfused_ms"] / row["graphs_ms"]
        print(row, flush=True)
    return rows


def _time_steps(runner, batch, iters: int) -> float:
    """Seconds per ``runner.run(batch)``, after three untimed warm-up steps."""
    for _ in range(3):
        runner.run(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runner.run(batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters

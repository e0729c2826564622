"""GPU memory as the engine sees it, recorded for chapter 13 (troubleshooting).

Run on a CUDA machine from the repository root (stage ``troubleshooting`` of
``tests/gpu/h200_session.sh``)::

    python3 tests/gpu/troubleshooting_h200.py --out figures/data/troubleshooting_h200.json

It builds the engine on Qwen3-0.6B's shape with random weights, with the CUDA caching
allocator's history recorded, and writes: the allocator's counters after each stage (before,
engine built, after a batch of requests), how ``gpu_memory_utilization`` turned into the KV
budget (weights, warm-up activations, KV cache), the largest allocations of the memory
snapshot (``torch.cuda.memory._snapshot``) with the code that made them, the head of
``torch.cuda.memory_summary()``, and one forward pass of 4096 tokens with and without
``torch.inference_mode`` (peak memory, time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path
from nanovllm.context import attention_metadata
from nanovllm.engine.scheduler_output import SchedulerOutput

GiB = 2**30


def counters() -> dict[str, float]:
    s = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gib": s["allocated_bytes.all.current"] / GiB,
        "reserved_gib": s["reserved_bytes.all.current"] / GiB,
        "peak_allocated_gib": s["allocated_bytes.all.peak"] / GiB,
        "device_free_gib": free / GiB,
        "device_total_gib": total / GiB,
        "num_alloc_retries": s["num_alloc_retries"],
        "num_ooms": s["num_ooms"],
    }


def largest_allocations(snapshot: dict, k: int = 8) -> list[dict]:
    """The ``k`` largest live blocks of the snapshot, each with the innermost frame of the
    package that allocated it."""
    blocks = []
    for seg in snapshot["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames", [])
            ours = [f for f in frames if "nanovllm" in f["filename"]]
            where = ours[0] if ours else (frames[0] if frames else None)
            blocks.append({
                "bytes": block["size"],
                "where": f"{where['filename'].split('nanovllm/')[-1]}:{where['line']} "
                         f"{where['name']}" if where else "unknown",
            })
    return sorted(blocks, key=lambda b: -b["bytes"])[:k]


def forward_memory(llm: LLM, num_tokens: int, inference: bool) -> dict[str, float]:
    """One prefill forward of ``num_tokens`` tokens: extra peak memory and time."""
    engine = llm.engine
    seq = engine.make_sequence(list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=1))
    assert engine.block_manager.allocate(seq, num_tokens)
    step = engine.runner.prepare(SchedulerOutput([seq], [num_tokens]))
    model = engine.runner.model
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    context = torch.inference_mode() if inference else torch.enable_grad()
    with context, attention_metadata(step.meta):
        hidden = model(step.input_ids, step.positions)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / GiB,
        "held_after_gib": (torch.cuda.memory_allocated() - base) / GiB,  # graph kept alive
        "ms": seconds * 1e3,
        "requires_grad": hidden.requires_grad,
    }
    del hidden
    engine.block_manager.free(seq)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="figures/data/troubleshooting_h200.json")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()
    record = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python3 tests/gpu/troubleshooting_h200.py",
        "model": "qwen3-0.6b (random weights)",
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "stages": {"start": counters()},
    }
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    llm = LLM(config_path("qwen3-0.6b"), load_format="dummy",
              gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.engine.runner
    record["stages"]["engine_built"] = counters()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    record["budget"] = {
        "weights_gib": weights / GiB,
        "kv_cache_gib": runner.kv_cache.numel() * runner.kv_cache.element_size() / GiB,
        "num_kv_blocks": runner.num_kv_blocks,
        "block_size": llm.engine.config.block_size,
        "kv_bytes_per_block": runner.kv_bytes_per_block(),
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
    }
    snapshot = torch.cuda.memory._snapshot()
    record["largest_allocations"] = largest_allocations(snapshot)
    record["snapshot_segments"] = len(snapshot["segments"])
    torch.cuda.memory._record_memory_history(enabled=None)
    prompts = [[(7 * i + j) % 10000 for j in range(512)] for i in range(256)]
    llm.generate(prompts, SamplingParams(max_tokens=256, ignore_eos=True), use_tqdm=False)
    record["stages"]["after_256_requests"] = counters()
    record["memory_summary_head"] = torch.cuda.memory_summary(abbreviated=True).splitlines()[:30]
    record["autograd"] = {"num_tokens": 4096}
    for name, inference in (("inference_mode", True), ("grad_enabled", False)):
        try:  # (last: with autograd on, the cache writes may leave the engine unusable)
            record["autograd"][name] = forward_memory(llm, 4096, inference)
        except Exception as err:  # recorded, so the rest of the record survives
            record["autograd"][name] = {"error": f"{type(err).__name__}: {err}"}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("budget", "stages", "autograd")}, indent=1))


if __name__ == "__main__":
    main()

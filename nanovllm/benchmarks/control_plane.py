"""How long a tensor-parallel worker waits for its step: gloo against shared memory (chapter 09).

    python -m nanovllm.benchmarks.control_plane --iters 200 --out control_plane.json

Two processes on this host play rank 0 and one worker. Rank 0 sends ``StepPlan``s of
realistic sizes (decode at batch 1, 64 and 256 with a context of 1,024 tokens in blocks of
16, and a 16,384-token prefill) two ways: ``distributed.broadcast_object`` over a gloo group
(how every step travelled before ``shm_broadcast.py``, and still does to ranks on other
hosts) and the shared-memory ``MessageQueue`` the engine uses for its own workers. Each
message leaves when the worker is already waiting for it, as between two engine steps.

- **latency**: from rank 0 starting to send until the worker holds the unpickled plan
  (both processes read the same monotonic clock);
- **sender**: how long rank 0 spends in the call.

Medians and 90th percentiles in microseconds, into one JSON file with device, date and
command.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanovllm import distributed
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.tensor_parallel import spawn_ranks
from nanovllm.engine.executor import free_port
from nanovllm.engine.shm_broadcast import MessageQueue
from nanovllm.engine.step import PackedArrays, StepPlan

TRANSPORTS = ("gloo", "shm")


def _plan(num_tokens: int, num_seqs: int, width: int, max_seqlen_q: int) -> StepPlan:
    """A plan of these sizes, its fields filled with counting numbers (no placeholders)."""
    count = np.arange
    longs = PackedArrays.pack(
        np.int64, input_ids=count(num_tokens), positions=count(num_tokens),
        slot_mapping=count(num_tokens), sample_indices=count(num_seqs),
        patch_targets=count(0), patch_sources=count(0),
    )
    ints = PackedArrays.pack(np.int32, cu_seqlens_q=count(num_seqs + 1),
                             seq_lens_k=count(num_seqs),
                             block_tables=count(num_seqs * width).reshape(num_seqs, width))
    num_decodes = num_seqs if max_seqlen_q == 1 else 0
    return StepPlan(longs, ints, max_seqlen_q=max_seqlen_q, num_decodes=num_decodes)


def decode_plan(batch: int, context: int = 1024, block_size: int = 16) -> StepPlan:
    """The host arrays of a decode step: one token per sequence."""
    return _plan(batch, batch, -(-context // block_size), 1)


def prefill_plan(tokens: int = 16384, seqs: int = 16, block_size: int = 16) -> StepPlan:
    """The host arrays of a prompt step: ``seqs`` prompts of ``tokens / seqs`` tokens."""
    return _plan(tokens, seqs, -(-tokens // seqs // block_size), tokens // seqs)


def plans() -> dict[str, StepPlan]:
    return {**{f"decode, batch {b}": decode_plan(b) for b in (1, 64, 256)},
            "prefill, 16,384 tokens": prefill_plan()}


def _rank(rank: int, port: int, iters: int, results) -> None:
    torch.set_num_threads(1)
    store = distributed.open_store("127.0.0.1", port, rank, 2, 60)
    distributed.init_tensor_parallel(store, rank, 2, torch.device("cpu"))
    if rank == 0:
        queue = MessageQueue.create(num_readers=1)
        distributed.broadcast_object(queue.handle())
        queue.wait_until_attached()
    else:
        queue = MessageQueue.attach(distributed.broadcast_object(), reader=0)
    times: dict[str, list[float]] = {}
    for name, plan in plans().items():
        for transport in TRANSPORTS:
            marks = []
            for _ in range(iters):
                dist.barrier()
                if rank == 0:
                    time.sleep(1e-3)  # the worker is now waiting, as between two steps
                    start = time.monotonic()
                    if transport == "gloo":
                        distributed.broadcast_object(plan)
                    else:
                        queue.put(plan)
                    marks += [start, time.monotonic()]
                else:
                    got = distributed.broadcast_object() if transport == "gloo" else queue.get()
                    marks.append(time.monotonic())
                    assert got.num_tokens == plan.num_tokens
            times[f"{name}|{transport}"] = marks
    results.put((rank, times))
    dist.barrier()
    queue.close()
    distributed.destroy_tensor_parallel(together=True)


def _us(values: list[float], q: float) -> float:
    return float(np.quantile(values, q) * 1e6)


def measure(iters: int = 200) -> list[dict]:
    """One row per plan and transport: bytes, latency and sender time (µs, p50 and p90)."""
    marks = dict(spawn_ranks(_rank, 2, (free_port(), iters), results=2))
    skip = min(10, iters // 10)  # first messages: page faults, lazy set-up
    rows = []
    for name, plan in plans().items():
        for transport in TRANSPORTS:
            sent = np.array(marks[0][f"{name}|{transport}"]).reshape(-1, 2)[skip:]
            got = np.array(marks[1][f"{name}|{transport}"])[skip:]
            latency, sender = got - sent[:, 0], sent[:, 1] - sent[:, 0]
            rows.append({"plan": name, "transport": transport,
                         "bytes": len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)),
                         "latency_p50_us": _us(latency, 0.5), "latency_p90_us": _us(latency, 0.9),
                         "sender_p50_us": _us(sender, 0.5)})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'plan':24s} {'bytes':>9s}  {'transport':9s} {'latency p50':>11s} {'p90':>7s} "
          f"{'sender p50':>10s}  (us)")
    for r in rows:
        print(f"{r['plan']:24s} {r['bytes']:9,d}  {r['transport']:9s} {r['latency_p50_us']:11.0f} "
              f"{r['latency_p90_us']:7.0f} {r['sender_p50_us']:10.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = measure(args.iters)
    print_table(rows)
    if args.out:
        record = {**run_metadata("nanovllm.benchmarks.control_plane", argv, device_label=(
            f"CPU ({os.cpu_count()} cores, {platform.machine()})")), "rows": rows}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

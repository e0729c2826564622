"""Where the host time of one eager ``decode_attention`` call goes (chapter 07 §1.2; GPU only).

chapter 05's benchmark records ``host_us``, the CPU time of one eager call of
``nanovllm.kernels.decode_attention``. That call is more than Triton's launcher: it validates its
arguments, allocates the output (and, with split-KV, three partial buffers), chooses the number
of splits, launches the split kernel and, with more than one split, a second kernel that merges
the splits. This script times each piece on its own, on the benchmark's shape (Qwen3-0.6B's
attention, bf16, block size 16, context 1024), batch 1 and 64:

    python3 tests/gpu/host_breakdown.py --out host_breakdown_h200.json

``full``: the call as the engine makes it. ``validate``: the same call with an empty batch, which
runs every check and allocates the output, then returns. ``allocs``: the partial buffers'
``torch.empty`` calls. ``choose_splits``: the split choice. ``split_launch`` and
``merge_launch``: each Triton kernel launched directly with the arguments the call passed it
(captured once), so only Triton's launcher and the driver remain. Host microseconds per call,
median of 5 repeats of 200 calls each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from nanovllm.benchmarks import decode_kernel
from nanovllm.kernels import decode_attention as kernel_module
from nanovllm.kernels import split_kv
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.split_kv import choose_num_splits


def host_us(fn, calls: int = 200, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def breakdown(batch: int, ctx: int = 1024, block_size: int = 16) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, seq_lens, tables = decode_kernel.make_case(batch, ctx, block_size, gen)
    table, scale = tables[0], decode_kernel.HEAD_DIM**-0.5
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = choose_num_splits(batch, decode_kernel.NUM_KV_HEADS, table.shape[1] * block_size,
                               num_sms)
    row = {"batch": batch, "ctx": ctx, "block_size": block_size, "num_splits": splits}
    row["full"] = host_us(lambda: decode_attention(q, k_cache, v_cache, seq_lens, table, scale))
    row["one_split"] = host_us(
        lambda: decode_attention(q, k_cache, v_cache, seq_lens, table, scale, num_splits=1))
    empty = (q[:0], k_cache, v_cache, seq_lens[:0], table[:0], scale)
    row["validate"] = host_us(lambda: decode_attention(*empty))
    heads, d_pad = decode_kernel.NUM_HEADS, 128

    out = torch.empty((batch, heads, decode_kernel.HEAD_DIM), dtype=q.dtype, device="cuda")
    row["allocs"] = (host_us(lambda: split_kv.split_partials(out, splits, d_pad))
                     if splits > 1 else 0.0)
    row["choose_splits"] = host_us(
        lambda: choose_num_splits(batch, decode_kernel.NUM_KV_HEADS, table.shape[1] * block_size,
                                  split_kv.num_sms(q.device)))
    # Capture the launches of one call, then replay each through Triton's launcher alone.
    homes = {"_decode_split_kernel": kernel_module, "_combine_splits_kernel": split_kv}
    names = tuple(homes)
    originals = {n: getattr(homes[n], n) for n in names}
    recorders = {n: Recorder(k) for n, k in originals.items()}
    try:
        for n, rec in recorders.items():
            setattr(homes[n], n, rec)
        decode_attention(q, k_cache, v_cache, seq_lens, table, scale)
    finally:
        for n, k in originals.items():
            setattr(homes[n], n, k)
    for n, key in zip(names, ("split_launch", "merge_launch")):
        calls = recorders[n].calls
        if calls:
            grid, args, kwargs = calls[0]
            row[key] = host_us(lambda k=originals[n], g=grid, a=args, kw=kwargs: k[g](*a, **kw))
        else:
            row[key] = 0.0
    parts = ("validate", "allocs", "choose_splits", "split_launch", "merge_launch")
    row["rest"] = row["full"] - sum(row[p] for p in parts)  # Python glue between the pieces
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [breakdown(b) for b in args.batches]
    for r in rows:
        print(f"batch {r['batch']:3d} ({r['num_splits']} splits): full {r['full']:.1f} us = "
              + ", ".join(f"{p} {r[p]:.1f}" for p in
                          ("validate", "allocs", "choose_splits", "split_launch", "merge_launch",
                           "rest")) + f" | one split {r['one_split']:.1f}")
    record = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "command": "python3 tests/gpu/host_breakdown.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

"""The device's two roofs, measured once: the copy bandwidth and the bf16 matmul rate.

    python -m nanovllm.benchmarks.peaks --out figures/data/peaks_h200.json

Every bound in the book divides by one of these (chapters 02, 05, 08 and 11 read them through
``nanovllm.viz.records.headline``): bytes by the bandwidth of a large device-to-device copy
(bytes read + written), FLOPs by the rate of a large bf16 ``torch.matmul``. Both are the
fastest this device runs real kernels, not its datasheet figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import time_calls


def copy_bytes_per_s(nbytes: int, reps: int) -> float:
    """Median rate of ``dst.copy_(src)`` for ``nbytes`` of bf16, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = statistics.median(time_calls(lambda: dst.copy_(src), reps, 5, "cuda", events=True))
    return 2 * nbytes / seconds


def matmul_flops_per_s(n: int, reps: int) -> float:
    """Median rate of an ``n x n x n`` bf16 ``torch.matmul`` in FLOP/s (2 n^3 per call)."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seconds = statistics.median(time_calls(lambda: a @ b, reps, 5, "cuda", events=True))
    return 2 * n**3 / seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes copied per call")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 matmul")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: these are the GPU's roofs")
    record = {
        **run_metadata("nanovllm.benchmarks.peaks", argv),
        "copy_bytes": args.copy_bytes,
        "copy_bytes_per_s": copy_bytes_per_s(args.copy_bytes, args.reps),
        "matmul_size": args.matmul_size,
        "bf16_matmul_flops_per_s": matmul_flops_per_s(args.matmul_size, args.reps),
    }
    print(f"{record['device']}: copy {record['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{record['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()

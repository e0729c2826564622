"""The attention kernels' tiles and launch settings: fixed rules, measured (chapters 02, 05, 11).

No autotuning: each rule compiles one variant per head size, so nothing is compiled or timed
while serving, and the choice does not follow timing noise. Each rule was chosen by a sweep
on an H200, which its docstring cites with the numbers; a CPU (the Triton interpreter) gets
tiles that keep the tests' short sequences cheap yet still cut into several tiles.
"""

from __future__ import annotations

import torch

__all__ = ["decode_tiles", "prefill_tiles"]


def prefill_tiles(head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by a fixed rule; no autotuning.

    CPU (Triton interpreter): 32 x 32. The interpreter pays a fixed Python cost per
    program and per tile operation, almost independent of tile size, so larger tiles run
    faster (one small mixed batch: 16x16 1.04 s, 32x32 0.59 s, 64x64 0.29 s on 2 cores);
    32 still splits the tests' and chapters' short sequences into several query and key
    tiles, so the masked/unmasked split and the block lookups run as they do on a GPU.
    GPU, measured on an H200 (torch 2.11, triton 3.6) on the benchmark's prefill shape
    (144,831 tokens, bf16, no prefix; ``python -m nanovllm.benchmarks.prefill_kernel --sweep``):
    head_dim 128 (16/8 heads): 64 rows x 32 keys, 4 warps, 2 stages -> 234 TFLOP/s at
    block_size 256, 213 at 16 (128 x 64 with 8 warps: 172/160; torch's ``varlen_attn`` on
    contiguous K/V: 165). head_dim 64 (9/3 heads): 64 x 64 -> 227/199 (``varlen_attn``
    107). Small tiles keep the fp32 scores, the accumulator and the K/V pointers in
    registers; 8 warps or 128-row tiles were slower in every case measured. head_dim 256
    is untuned (``--shape H KV D`` retunes).
    """
    if device.type == "cpu":
        return 32, 32, 1, 1
    if head_dim <= 64:
        return 64, 64, 4, 2
    if head_dim <= 128:
        return 64, 32, 4, 2
    return 32, 32, 4, 2  # head_dim 256: halve the rows to hold the accumulator


def decode_tiles(head_dim: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages): fixed, no autotuning.

    A sweep of 27 tilings on an H200 (``tests/gpu/decode_launch_sweep.py``,
    ``figures/data/decode_launch_sweep_h200.json``) found 32/2/2 4-9% faster for head_dim 128
    at ctx 1024, but 24% slower at batch 64 and ctx 2048, and 14% slower over the whole
    benchmark (decode attention 4.36 s against 3.82 s): the rule stays."""
    if not on_gpu:
        return 32, 4, 1  # interpreter: small tiles keep tests of short sequences cheap
    return (64, 4, 2) if head_dim <= 128 else (32, 4, 2)

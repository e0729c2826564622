"""Split-KV (flash-decoding): how many chunks to cut each sequence's keys into, and the
kernel that merges the chunks' partial results (chapter 05 §6).

``decode_attention`` cuts each sequence's keys into ``num_splits`` chunks when few sequences
would leave SMs idle; each chunk's program writes its base-2 online-softmax state ``(m, l, acc)``
to fp32 buffers (``split_partials``), and ``combine_splits`` merges them with the log-sum-exp
rule. ``choose_num_splits`` decides from shapes alone, so a CUDA graph can capture the call.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

__all__ = ["choose_num_splits", "combine_splits", "num_sms", "split_partials"]

# num_splits=None (see choose_num_splits): split only when the batch gives fewer than
# FULL_PROGRAMS_PER_SM programs per SM; then aim for TARGET_PROGRAMS_PER_SM, never giving a split
# fewer than MIN_SPLIT_TOKENS keys, and never more than MAX_SPLITS splits. Tuned on an H200
# (132 SMs) with `python -m nanovllm.benchmarks.decode_kernel --sweep-splits`.
FULL_PROGRAMS_PER_SM = 2
TARGET_PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 32


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merge the split-KV partials of one (sequence, query head) into its output row.

    Handout (chapter 05 §6, assignment ``05.combine_splits``): this program is
    ``(b, h) = (tl.program_id(0), tl.program_id(1))`` of a ``[B, num_heads]`` grid. Split s of
    ``num_splits`` left, at index ``part = (b * num_heads + h) * num_splits + s``, its running
    max ``m_ptr[part]`` (base-2 scores, ``-inf`` for a split that saw no key), its running sum
    ``l_ptr[part]`` and its unnormalised output ``acc_ptr[part * D_PAD + d]`` for
    ``d < D_PAD``, all fp32. Store the merged row ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M)
    l_s`` with ``M = max_s m_s`` at ``out_ptr + b * stride_ob + h * stride_oh + d`` for
    ``d < HEAD_DIM``, cast to the output's dtype. A row whose splits all saw no key (a padded
    CUDA-graph row) must get zeros, not NaN. ``SPLITS_PAD`` is ``num_splits`` rounded up to a
    power of two. Hints: the chapter's "Assignments" section.
    """
    # >>> assignment 05.combine_splits (7 points)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    part = (b * num_heads + h) * num_splits + s

    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s_mask, other=0.0)  # noqa: E741
    acc = tl.load(acc_ptr + part[:, None] * D_PAD + d[None, :], mask=s_mask[:, None], other=0.0)

    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty (seq_len 0)
    w = tl.exp2(m - m_max)  # empty splits: 2^-inf = 0
    l_sum = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
    # <<< assignment 05.combine_splits


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, which ``choose_num_splits`` fills."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1  # interpreter: one "SM" per core keeps CPU grids small


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many chunks to cut each sequence's keys into (split-KV).

    The grid has ``batch * num_kv_heads * num_splits`` programs. If ``batch * num_kv_heads``
    already gives every SM ``FULL_PROGRAMS_PER_SM`` programs, splitting only adds partials to
    write and merge: 1. Otherwise aim for ``TARGET_PROGRAMS_PER_SM * num_sms`` programs, so every
    SM holds several and memory latency is hidden, but give no split fewer than
    ``MIN_SPLIT_TOKENS`` of the ``max_seq_len`` keys and make at most ``MAX_SPLITS``.
    On an H200 (132 SMs), 8 KV heads: batch >= 33 -> 1; batch 16 -> 5; batch 1 at 4096 keys -> 32.
    Shapes only, no device query: the call must be capturable in a CUDA graph (chapter 05 §6).
    """
    programs = batch * num_kv_heads
    if programs >= FULL_PROGRAMS_PER_SM * num_sms:
        return 1
    wanted = math.ceil(TARGET_PROGRAMS_PER_SM * num_sms / max(programs, 1))
    return max(1, min(wanted, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def split_partials(out: torch.Tensor, num_splits: int, d_pad: int) -> tuple:
    """Empty fp32 buffers ``(m, l, acc)`` for the partials of ``out``'s ``[B, num_heads]`` rows:
    ``[B, num_heads, num_splits]`` twice, then ``[B, num_heads, num_splits, d_pad]``."""
    batch, num_heads, _ = out.shape
    m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=out.device)
    acc = torch.empty((batch, num_heads, num_splits, d_pad), dtype=torch.float32,
                      device=out.device)
    return m, torch.empty_like(m), acc


def combine_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,  # noqa: E741
                   out: torch.Tensor) -> None:
    """Merge the partials (``split_partials``' buffers, filled) into ``out`` ``[B, num_heads,
    head_dim]``, in place: one program per (sequence, query head)."""
    batch, num_heads, num_splits, d_pad = acc.shape
    _combine_splits_kernel[(batch, num_heads)](
        m, l, acc, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2], D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )

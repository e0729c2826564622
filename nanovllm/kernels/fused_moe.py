"""The fused mixture-of-experts kernel, vLLM's design (chapter 16 §6).

A MoE layer with ``E`` experts is ``E`` small MLPs, each over the few tokens routed to it. Run
one at a time (``layers/fused_moe.py``'s reference) that is ``3E`` tiny GEMMs and launches per
layer. Here the whole layer is two launches of one grouped GEMM:

1. ``moe_align_block_size`` (``kernels/moe_align.py``) sorts the ``T * k`` token->expert
   assignments by expert and pads every expert's group to whole blocks of ``BLOCK_M`` rows, so
   each block belongs to one expert.
2. Gate/up: each program takes one block of assignments and one tile of ``BLOCK_N`` output
   columns, gathers its tokens' hidden rows, multiplies them by its expert's gate rows and up
   rows (two accumulators) and stores ``silu(gate) * up``: the activation is fused, so the
   ``[T*k, 2I]`` projection never reaches memory. Output row ``s`` is assignment ``s``.
3. Down: the same kernel over ``[T*k, I]`` and ``w2``, each row scaled by its router weight.
4. The ``k`` rows of each token are summed (in float32).

Blocks past the used length (the grid is sized for the worst case, so nothing is read back to
the host) return at once; rows holding the padding sentinel are masked. Every buffer's shape
depends on ``T``, ``k``, ``E`` and the block size only, so the layer runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable, interpreted_bf16, round_to
from nanovllm.kernels.moe_align import moe_align_block_size

__all__ = ["fused_moe", "pick_block_m"]

BLOCK_N, BLOCK_K = 64, 64


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_slots, n_out, k_dim, up_offset,
    stride_a, stride_we, stride_wn, stride_out,
    ROWS_PER_TOKEN: tl.constexpr,  # top_k when ``a`` has one row per token, 1 per assignment
    GATED: tl.constexpr,  # w rows n and up_offset + n are gate and up: store silu(g) * u
    SCALED: tl.constexpr,  # multiply each output row by its router weight
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,  # fp32 inputs: exact fp32 products; bf16 in the interpreter: upcast
    INTERPRETED_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last expert's group
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots  # the rest are padding
    rows = (slots // ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + ks < k_dim
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                           other=0.0)
            if F32_DOT:
                acc_up += tl.dot(a.to(tl.float32), w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(a, w_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:  # silu(g) = g / (1 + e^-g); very negative g gives -0, not NaN
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if SCALED:
        acc *= tl.load(scale_ptr + slots, mask=valid, other=0.0)[:, None]
    out = round_to(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16)
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, out, mask=valid[:, None] & col_ok[None, :])


def pick_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: about the assignments an expert gets (``T * k / E``), 16 to 64. Small
    batches spread over many experts would otherwise be mostly padding."""
    per_expert = num_slots / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _launch(a, w, out, scale, aligned, num_slots, n_out, k_dim, up_offset, rows_per_token,
            gated, scaled, block_m) -> None:
    sorted_ids, expert_ids, num_padded = aligned
    grid = (expert_ids.numel() * triton.cdiv(n_out, BLOCK_N),)
    _grouped_gemm_kernel[grid](
        a, w, out, scale, sorted_ids, expert_ids, num_padded,
        num_slots, n_out, k_dim, up_offset,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, GATED=gated, SCALED=scaled,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        F32_DOT=a.dtype == torch.float32 or interpreted_bf16(a),
        INTERPRETED_BF16=interpreted_bf16(out), num_warps=4, num_stages=3,
    )


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, block_m: int | None = None,
) -> torch.Tensor:
    """The MoE layer ``moe_reference`` computes, in two grouped-GEMM launches.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows, then up rows); ``w2`` ``[E, H, I]``;
    ``topk_weights`` ``[T, k]`` (float32); ``topk_ids`` ``[T, k]`` int64. All contiguous, on one
    device; returns ``[T, H]`` in ``x``'s dtype. ``block_m`` overrides ``pick_block_m``.
    """
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if w2.shape != (num_experts, hidden, inter) or w13.shape[2] != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"x {tuple(x.shape)}")
    check_launchable(x, _grouped_gemm_kernel)
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    block_m = block_m or pick_block_m(num_slots, num_experts)
    aligned = moe_align_block_size(topk_ids, num_experts, block_m)
    scale = topk_weights.contiguous().float()
    activated = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, activated, scale, aligned, num_slots, inter, hidden, inter, top_k,
            gated=True, scaled=False, block_m=block_m)
    down = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    _launch(activated, w2, down, scale, aligned, num_slots, hidden, inter, 0, 1,
            gated=False, scaled=True, block_m=block_m)
    return down.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)

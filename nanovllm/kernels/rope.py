"""Fused per-head RMSNorm + rotary embedding, in place on the QKV projection (a Triton kernel).

Chapter 11 counts the kernels this fusion saves (about twenty small PyTorch kernels become one
launch); chapter 01 teaches RoPE (``layers/rotary.py`` is the PyTorch path and owns the cos/sin
tables). On ``qkv [T, (H + 2 * Hkv) * d]`` program ``(t, j)`` takes ``BLOCK_H`` of token ``t``'s
query and key heads, as two ``[BLOCK_H, d/2]`` halves (NeoX layout: channel ``i`` pairs with
``i + d/2``); it normalises them (Qwen3's ``q_norm``/``k_norm``) and rotates them in fp32, and
writes them back where they were, rounded once. Value heads are not touched.
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable, interpreted_bf16, round_to

__all__ = ["qk_norm_rope_"]

# Elements of one half-head tile per program, at most: BLOCK_H * d/2 (the 0.6B model's 24
# query+key heads of 128 channels take two programs per token).
MAX_TILE = 1024


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])  # a slice of the step's metadata
def _qk_norm_rope_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    stride_t,
    stride_cos,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_ROPE_HEADS: tl.constexpr,  # query + key heads
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # t * row stride may pass 2**31
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, HALF_PAD)
    half = HEAD_DIM // 2
    c_mask = c < half
    mask = (h < NUM_ROPE_HEADS)[:, None] & c_mask[None, :]
    first = qkv_ptr + t * stride_t + h[:, None] * HEAD_DIM + c[None, :]  # channels [0, d/2)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)  # channels [d/2, d)

    if HAS_NORM:
        # RMSNorm over the head's d channels, both halves; query heads take q_weight.
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        is_q = (h < NUM_HEADS)[:, None]
        qw1 = tl.load(q_weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(q_weight_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(k_weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(k_weight_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        x1 = x1 * rstd[:, None] * tl.where(is_q, qw1, kw1)
        x2 = x2 * rstd[:, None] * tl.where(is_q, qw2, kw2)

    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + c, mask=c_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + c, mask=c_mask, other=0.0)[None, :]
    dtype = qkv_ptr.dtype.element_ty
    tl.store(first, round_to(x1 * cos - x2 * sin, dtype, INTERPRETED_BF16), mask=mask)
    tl.store(first + half, round_to(x2 * cos + x1 * sin, dtype, INTERPRETED_BF16), mask=mask)


def qk_norm_rope_(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor:
    """Rotate (and, given weights, first RMSNorm) the query and key heads of ``qkv``, in place.

    ``qkv``: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``, any row stride, contiguous
    rows. ``positions``: integer ``[T]``. ``cos``/``sin``: fp32 ``[max_position, head_dim / 2]``
    (``RotaryEmbedding``'s tables). ``q_weight``/``k_weight``: ``[head_dim]``, both or neither.
    Computes in fp32 and rounds once to ``qkv``'s dtype. Returns ``qkv``.
    """
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [T, width] with contiguous rows, got {tuple(qkv.shape)}")
    num_tokens, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"qkv width {width} is not (num_heads {num_heads} + 2 * num_kv_heads "
            f"{num_kv_heads}) * head_dim {head_dim} with an even head_dim"
        )
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [max_position, {head_dim // 2}]")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("cos and sin must share their strides, with contiguous rows")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q_weight and k_weight, or neither")
    has_norm = q_weight is not None
    if has_norm and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
        raise ValueError(f"q_weight and k_weight must be [{head_dim}]")
    check_launchable(qkv, _qk_norm_rope_kernel)
    if num_tokens == 0:
        return qkv

    rope_heads = num_heads + num_kv_heads
    half_pad = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(rope_heads), max(1, MAX_TILE // half_pad))
    _qk_norm_rope_kernel[(num_tokens, triton.cdiv(rope_heads, block_h))](
        qkv, positions, cos, sin,
        q_weight.contiguous() if has_norm else cos,  # unused without the norm
        k_weight.contiguous() if has_norm else cos,
        qkv.stride(0), cos.stride(0), eps,
        NUM_HEADS=num_heads, NUM_ROPE_HEADS=rope_heads, HEAD_DIM=head_dim, HALF_PAD=half_pad,
        BLOCK_H=block_h, HAS_NORM=has_norm, INTERPRETED_BF16=interpreted_bf16(qkv), num_warps=4,
    )
    return qkv

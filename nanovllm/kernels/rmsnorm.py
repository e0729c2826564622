"""Fused residual add + RMSNorm, as one Triton kernel (chapter 11 counts what it saves).

In PyTorch the add and the norm are nine small bf16 kernels, each reading and writing the whole
``[T, D]`` activation; in a small-batch decode step those launches are what the GPU waits for.
One program per token row writes ``s = x + residual`` back into ``residual`` and stores
``weight * (s * rsqrt(mean(s^2) + eps))``: the statistic in fp32, the normalised row rounded to
the activation dtype before the weight multiplies it and the product rounded again, exactly as
the PyTorch path (``layers/norm.py``, chapter 01) rounds. ``round_to`` (``kernels/__init__.py``)
also corrects the interpreter's bf16 rounding.
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable, interpreted_bf16, round_to

__all__ = ["rmsnorm"]


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    stride_x,
    stride_r,
    stride_y,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), dtype, INTERPRETED_BF16)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    s = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / dim + eps)  # padding lanes are 0: add nothing
    normed = round_to(s * rstd, dtype, INTERPRETED_BF16).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # A product of two 16-bit floats is exact in fp32, so this rounds once, as torch's mul does.
    y = round_to(w * normed, dtype, INTERPRETED_BF16)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm the rows of ``x`` ``[T, D]`` (any row stride, contiguous last dimension).

    Without ``residual`` returns ``y``. With ``residual`` (``[T, D]`` like ``x``, ``x``'s dtype)
    first forms ``s = x + residual`` (rounded to ``x``'s dtype), writes it into ``residual`` in
    place and normalises ``s``; returns ``(y, residual)``. ``y`` is a new contiguous tensor of
    ``x``'s dtype: ``weight * (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(dtype)``.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] with a contiguous last dimension, got {tuple(x.shape)}")
    num_rows, dim = x.shape
    if weight.shape != (dim,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be contiguous [{dim}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        if residual.stride(-1) != 1:
            raise ValueError("residual's last dimension must be contiguous")
    check_launchable(x, _rmsnorm_kernel)

    y = torch.empty((num_rows, dim), dtype=x.dtype, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(dim)
        _rmsnorm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, y,  # (x: unused, no residual)
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            INTERPRETED_BF16=interpreted_bf16(x),
            num_warps=min(max(block // 256, 1), 8),  # about 8 elements per thread
        )
    return y if residual is None else (y, residual)

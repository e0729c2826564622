"""Fused residual add + RMSNorm (a Triton kernel).

Every sub-layer of a decoder block starts the same way: add the sub-layer's output to the
residual stream, then RMSNorm the sum for the next sub-layer. In PyTorch that is nine small
kernels in bf16 (the add, two casts, square, mean, ``+ eps``, rsqrt, two multiplies), each
reading and writing the whole ``[T, D]`` activation. In a small-batch decode step those
launches, not the bytes, are what the GPU waits for; this kernel does the whole step in one.

One program handles one token row: it loads ``x`` (and ``residual``), writes the sum
``s = x + residual`` back into ``residual`` (the stream the next layer continues), and stores
``weight * (s * rsqrt(mean(s^2) + eps))``. The statistic is computed in fp32; the normalised row
is rounded to the activation dtype before the weight multiplies it, and the product is rounded
again, which is exactly how the PyTorch path (``nanovllm/layers/norm.py``) rounds.

Chapter 11 (``chapters/11_performance``) counts the kernels this fusion saves; chapter 01
teaches RMSNorm and the residual-carrying layer. ``RMSNorm`` (``nanovllm/layers/norm.py``) uses
the kernel once ``set_fused_kernels`` switches it on (``nanovllm/layers/fused.py``).

Runs on a GPU, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported). The arithmetic is fp32; results are rounded by ``round_to``
(``nanovllm/kernels/__init__.py``), which also corrects the interpreter's bf16 rounding.
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
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
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
            x,
            residual if residual is not None else x,  # unused without a residual
            weight,
            y,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            y.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            INTERPRETED_BF16=interpreted_bf16(x),
            num_warps=min(max(block // 256, 1), 8),  # about 8 elements per thread
        )
    return y if residual is None else (y, residual)

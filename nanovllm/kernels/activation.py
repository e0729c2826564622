"""SwiGLU's gate (chapter 01), ``silu(gate) * up``, as one Triton kernel (chapter 11).

It reads the packed ``[T, 2I]`` ``[gate | up]`` once and writes ``[T, I]``, where PyTorch needs
two kernels and a round trip of ``silu(gate)`` through memory. ``silu`` is computed in fp32 and
rounded to the activation dtype, and the product rounded again: the PyTorch path's rounding
(``layers/activation.py``).
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable, interpreted_bf16, round_to

__all__ = ["silu_mul"]

MAX_BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # t * row stride may pass 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + t * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + inter + cols, mask=mask, other=0.0)
    dtype = up.dtype
    # silu(g) = g * sigmoid(g) = g / (1 + e^-g); very negative g gives g / inf = -0, not NaN.
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED_BF16)
    # A product of two 16-bit floats is exact in fp32, so this rounds once, as torch's mul does.
    out = round_to(act.to(tl.float32) * up.to(tl.float32), dtype, INTERPRETED_BF16)
    tl.store(out_ptr + t * stride_out + cols, out, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` ``[T, 2I]`` (any row stride, contiguous
    rows); returns a new ``[T, I]`` tensor in ``gate_up``'s dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}"
        )
    check_launchable(gate_up, _silu_mul_kernel)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and inter:
        block = min(triton.next_power_of_2(inter), MAX_BLOCK)
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter,
            BLOCK=block, INTERPRETED_BF16=interpreted_bf16(gate_up), num_warps=4,
        )
    return out

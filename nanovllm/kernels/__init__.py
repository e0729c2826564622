"""Triton kernels of the engine.

Each module holds one kernel and its Python launcher; each module's docstring names the
chapter that teaches it. Importing a kernel module needs ``triton``; without it the import
raises ``ImportError`` and the engine falls back to its pure-PyTorch attention backend.
This file also holds the few helpers the fused kernels (chapter 11) share.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the backend dispatch catches this and keeps the torch path
    raise ImportError(
        "nanovllm.kernels needs the 'triton' package (pip install triton); without it, use "
        "attention_backend='torch'"
    ) from exc


def check_launchable(t: torch.Tensor, kernel: object) -> None:
    """Explain, instead of failing inside Triton, why the ``@triton.jit`` ``kernel`` cannot
    run on ``t``: CPU tensors need the interpreter, which is chosen when triton is imported."""
    if t.device.type != "cuda" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use the torch path (attention_backend='torch', fused "
            "kernels off)."
        )


def interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether stores of ``t``'s dtype need ``round_to``'s fix: bf16 under the interpreter."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``, to nearest even, as a GPU and torch round.

    The interpreter *truncates* fp32 to bf16, so there the bits are rounded by hand first
    (add half an ulp of bf16 plus the tie-to-even bit, clear the low 16 bits); what is left
    is exact in bf16 and the cast loses nothing.
    """
    if INTERPRETED_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


FP8_E4M3_MAX = 448.0


@triton.jit
def round_to_e4m3(x, INTERPRETED: tl.constexpr):
    """fp32 ``x`` (already clamped to +-448) as float8 e4m3fn, rounded to nearest even.

    Used by the fp8 KV cache (chapter 08). The interpreter's fp32 -> e4m3 cast is wrong when
    the rounding carries into the exponent (7.94 -> 4.0) and for subnormals, while it
    converts exactly representable values exactly. So there the value is rounded by hand
    first: normal values keep 3 mantissa bits (add half an ulp plus the tie-to-even bit,
    clear the low 20 bits); below 2**-6 the grid is 2**-9 and ``(x + C) - C`` with
    ``C = 1.5 * 2**14`` (whose fp32 ulp is 2**-9) rounds to it, on ``|x|`` so that a tiny
    negative value becomes -0.0, as torch's cast gives.
    """
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        magnitude = (tl.abs(x) + 24576.0) - 24576.0
        subnormal = tl.where(x < 0, -magnitude, magnitude)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)

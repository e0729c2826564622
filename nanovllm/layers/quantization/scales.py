"""Symmetric scales: the one idea every quantizer here shares (chapter 08 §2).

A row ``x`` is stored as ``q = round(x / s)`` in a narrow type with ``s = max|x| / qmax`` (no
zero point: 0.0 stays 0.0), one scale per row: per output channel for a weight ``[out, in]``
(it factors out of that feature's dot product) and per token for activations (fp8 W8A8).
int8 codes are -127..127 (-128 unused, keeping the range symmetric); fp8 e4m3
(``torch.float8_e4m3fn``) holds finite values up to 448 with 3 mantissa bits, so scaling only
has to keep a row's largest value below 448 and the small ones above the subnormals (2**-6).
"""

from __future__ import annotations

import torch

INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# Rows of zeros (padding tokens, pruned channels) would divide by 0; any positive scale
# gives them the code 0, so clamp the row maximum to this.
MIN_AMAX = 1e-12


def row_scales(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 scales, one per row of ``x`` (``[rows]``): ``max |x| / qmax``."""
    return x.float().abs().amax(dim=-1).clamp(min=MIN_AMAX) / qmax


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` -> (int8 codes ``[rows, cols]``, float32 scales ``[rows]``).

    Handout (chapter 08 §2, assignment ``08.channel_scales``): symmetric int8 quantization
    with one scale per row, which for a weight ``[out, in]`` is one scale per output channel.
    ``w`` is fp32, bf16 or fp16. Return ``(codes, scale)``: ``scale[r] = max_c |w[r, c]| /
    127`` in float32 (a row of zeros must not divide by zero: clamp its maximum to
    ``MIN_AMAX`` first), and ``codes[r, c] = w[r, c] / scale[r]`` rounded to the nearest
    integer, kept within -127..127, as ``torch.int8``. So each row's largest magnitude gets
    the code +-127, 0.0 stays exactly 0, and ``codes * scale[:, None]`` is within half a
    step (``scale / 2``) of ``w``. Hints: the chapter's "Assignments" section.
    """
    # >>> assignment 08.channel_scales (4 points)
    scale = row_scales(w, INT8_MAX)
    q = torch.round(w.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale
    # <<< assignment 08.channel_scales


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, cols]`` -> (e4m3 values ``[rows, cols]``, float32 scales ``[rows]``).

    Per output channel for a weight, per token for activations. The clamp is not redundant:
    rounding ``max|x| / s`` may land a hair above 448, and depending on the torch build an
    out-of-range cast saturates or gives NaN (e4m3fn has no infinity).

    Handout (chapter 08 §5.2, assignment ``08.token_scales``): the dynamic per-token scaling
    of fp8 W8A8. ``fp8_linear`` calls this at every step on the activations ``[tokens,
    hidden]``, one row per token, so that a token with huge values (an outlier) gets its own
    scale and leaves every other token's precision alone; the weights ``[out, in]`` go
    through it once at load time, one row per output channel. ``x`` is fp32, bf16 or fp16.
    Return ``(values, scale)``: ``scale[r] = max_c |x[r, c]| / 448`` in float32 (clamp the
    row maximum to ``MIN_AMAX`` first, for rows of zeros) and ``values = x / scale[:, None]``
    as ``FP8_DTYPE`` (e4m3), computed in float32 and clamped to +-``FP8_MAX`` before the
    cast. The cast itself rounds to the nearest e4m3 value: no ``torch.round`` here (e4m3 is
    a floating-point format, its steps are not integers).
    """
    # >>> assignment 08.token_scales (4 points)
    scale = row_scales(x, FP8_MAX)
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale
    # <<< assignment 08.token_scales


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per row: the inverse of the two functions above."""
    return q.float() * scale.float()[:, None]

"""Symmetric scales: the one idea every quantizer here shares (chapter 08, section 2).

A row ``x`` of real numbers is stored as ``q = round(x / s)`` in a narrow type and read back
as ``q * s``. *Symmetric* means no zero point: ``s = max|x| / qmax``, so the largest value of
the row lands on the largest code and 0.0 stays exactly 0.0. One scale per *row* is the
granularity used throughout: per output channel for a weight ``[out, in]`` (each row is one
output feature's dot product, so its scale factors out of the sum and is applied once to the
result) and per token for activations ``[tokens, hidden]`` (the fp8 W8A8 path).

- int8: codes -127..127 (-128 unused, which keeps the range symmetric), rounded to nearest;
- fp8 e4m3 (``torch.float8_e4m3fn``): finite values up to 448, 3 mantissa bits, so every
  value keeps ~2 significant digits wherever it sits in the range; scaling only has to keep
  the row's largest value below 448 (and the small ones above the subnormals, 2**-6).

Taught in ``chapters/08_quantization.py``.
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
    """``w`` ``[rows, cols]`` -> (int8 codes ``[rows, cols]``, float32 scales ``[rows]``)."""
    scale = row_scales(w, INT8_MAX)
    q = torch.round(w.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, cols]`` -> (e4m3 values ``[rows, cols]``, float32 scales ``[rows]``).

    Per output channel for a weight, per token for activations. The clamp is not redundant:
    rounding ``max|x| / s`` may land a hair above 448, and depending on the torch build an
    out-of-range cast saturates or gives NaN (e4m3fn has no infinity).
    """
    scale = row_scales(x, FP8_MAX)
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` with one scale per row: the inverse of the two functions above."""
    return q.float() * scale.float()[:, None]

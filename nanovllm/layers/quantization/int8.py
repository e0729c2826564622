"""int8 weight-only quantization, W8A16 (chapter 08 §3).

Each linear weight ``[out, in]`` becomes int8 codes plus one float32 scale per output channel
(``scales.quantize_int8``); activations stay in the model's dtype, and the codes are widened to
it right before the multiply. ``y = x @ (q * s).T`` runs, picked per call by device:

- CUDA with triton: our kernel ``nanovllm.kernels.int8_gemm`` (dequantizes in registers, so
  only int8 bytes cross the memory bus);
- CPU, up to ``INT8PACK_MAX_ROWS`` rows (decode): ``torch._weight_int8pack_mm`` where this
  torch has it (same contract: int8 weight ``[out, in]``, one scale per output row,
  activations fp32/bf16/fp16). Its time grows with every row (measured on a 2-core AVX-512
  EPYC, torch 2.13: on a 576 -> 3072 layer about as fast as fp32 ``F.linear`` at 1 row, 5x
  slower at 16), so larger batches take the reference below, whose one dequantization is
  shared by all rows. Only for ``in`` a multiple of 16: torch 2.13's CPU kernel crashes
  (segfault) on bf16 rows of other lengths. Its CUDA kernel, where one exists, computes
  one output per thread, far slower than ours, so it is not used there;
- otherwise the reference: dequantize to the activation dtype, then ``F.linear``.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization.base import LinearMethod, set_weight
from nanovllm.layers.quantization.scales import quantize_int8

INT8PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT8PACK_MAX_ROWS = 4  # beyond this, dequantize + F.linear is faster on CPU (see above)


@cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


class Int8LinearMethod(LinearMethod):
    """W8A16: int8 weight codes, per-output-channel scales, high-precision activations."""

    name = "int8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_int8(layer.weight.data)
        set_weight(layer, q, scale)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for int8 ``weight`` ``[out, in]``.

    ``x``: ``[..., in]`` in fp32/bf16/fp16; the result has ``x``'s dtype and leading shape.
    """
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and _has_triton():
        from nanovllm.kernels.int8_gemm import int8_gemm  # imports triton: only when used

        y = int8_gemm(rows, weight, scale, bias)
    elif _int8pack_fits(rows):
        y = torch._weight_int8pack_mm(rows.contiguous(), weight, scale.to(rows.dtype))
        y = y if bias is None else y + bias
    else:
        y = dequantize_linear(rows, weight, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _int8pack_fits(rows: torch.Tensor) -> bool:
    return (
        rows.device.type == "cpu"
        and hasattr(torch, "_weight_int8pack_mm")
        and rows.dtype in INT8PACK_DTYPES
        and 0 < rows.shape[0] <= INT8PACK_MAX_ROWS  # (an empty batch: the reference)
        and rows.shape[1] % 16 == 0  # see the module docstring
    )


def dequantize_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: widen the codes to ``x``'s dtype, apply the scales, multiply.

    The torch path of W8A16 (CPU, and the fallback). ``x`` is ``[rows, in]`` in fp32, bf16 or
    fp16; ``weight`` int8 codes ``[out, in]``; ``scale`` float32 ``[out]``, one per output
    channel; ``bias`` ``[out]`` in ``x``'s dtype, or None. Returns ``x @ (weight * scale[:,
    None]).T (+ bias)``, ``[rows, out]`` in ``x``'s dtype. The codes are scaled in float32 and
    the weight cast once: scaling them in bf16 would round every product to 8 bits for no
    reason, while widening is exact (|code| <= 127 fits every float type).
    """
    w = (weight.to(torch.float32) * scale.float()[:, None]).to(x.dtype)
    return F.linear(x, w, bias)

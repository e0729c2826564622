"""fp8 weights and activations, W8A8 (chapter 08 §5.2).

e4m3 weights with one float32 scale per output channel (quantized at load time) and e4m3
activations scaled dynamically per token (``max|row| / 448``), so an outlier token does not
flatten the others. Each scale is constant along the summed index, so one fp8 matmul with fp32
accumulation applies both to its result: ``y[t, o] = (sum_i xq[t, i] wq[o, i]) sx[t] sw[o]``.
On CUDA of compute capability >= 8.9 (``EngineConfig`` refuses older GPUs) with bf16
activations and ``in``, ``out`` divisible by 16 that is ``torch._scaled_mm`` with row-wise
scales; everywhere else (CPU included) an emulation widens the fp8 values to fp32 (exact) for an
fp32 matmul: the rounding of the real path, not its speed.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.quantization.base import LinearMethod, set_weight
from nanovllm.layers.quantization.scales import FP8_DTYPE, quantize_fp8

MIN_FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


class Fp8LinearMethod(LinearMethod):
    """W8A8: e4m3 weights (per-output-channel scales), e4m3 activations (per-token scales)."""

    name = "fp8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_fp8(layer.weight.data)
        set_weight(layer, q, scale)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` with ``x`` quantized to e4m3 per token.

    ``weight``: e4m3 ``[out, in]``; ``scale``: float32 ``[out]``; ``x``: ``[..., in]``.
    The result has ``x``'s dtype and leading shape.
    """
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_fp8(rows)
    if _scaled_mm_fits(rows, weight):
        # weight.t(): [in, out] column-major, the layout _scaled_mm wants for mat2
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
                             bias=bias, out_dtype=rows.dtype)
    else:
        y = emulated_fp8_matmul(xq, x_scale, weight, scale).to(rows.dtype)
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _scaled_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return (
        rows.is_cuda
        and rows.dtype == torch.bfloat16  # row-wise scaling writes bf16 only
        and weight.dtype == FP8_DTYPE
        and in_features % 16 == 0
        and out_features % 16 == 0
        and rows.shape[0] > 0
    )


def emulated_fp8_matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """float32 ``(xq @ wq.T) * x_scale[:, None] * w_scale[None, :]`` from fp8 operands."""
    acc = xq.to(torch.float32) @ wq.to(torch.float32).t()
    return acc * x_scale[:, None] * w_scale[None, :]


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` runs the fp8 path for real (CPU runs the emulation instead)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY

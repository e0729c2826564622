"""What a quantization method does to a linear layer (chapter 08), in vLLM's terms.

A ``LinearMethod`` owns two moments of a layer's life: ``process_weights_after_loading(layer)``,
once every checkpoint shard is in (the packed ``qkv_proj`` and ``gate_up_proj`` are filled by
three and two shards: quantizing earlier would scale a partly empty matrix), replaces
``layer.weight`` by its quantized form plus ``layer.weight_scale``; ``apply(layer, x, bias)``
is the matmul on that form, which ``LinearBase`` calls when its ``quant_method`` is set.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearMethod:
    """Base class of the quantized matmuls (``int8.py``, ``fp8.py``)."""

    name = "none"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError


def set_weight(layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Swap ``layer.weight`` for quantized codes and add their per-row ``weight_scale``.

    Parameters (not buffers), as vLLM does, so ``named_parameters`` still lists every byte of
    the model and weight-memory sums stay honest. The high-precision tensor is dropped here:
    its memory is free once the loader's references are gone.
    """
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)

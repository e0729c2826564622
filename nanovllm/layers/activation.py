"""SwiGLU's gate (chapter 01): ``silu(gate) * up`` on a packed ``[gate | up]`` tensor.

Switched on by ``set_fused_kernels`` (``fused.py``), one fused Triton kernel does it
(chapter 11, ``nanovllm/kernels/activation.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused_kernel: Callable | None = None  # set by layers/fused.py: set_fused_kernels

    @staticmethod
    def load_fused_kernel() -> Callable:
        from nanovllm.kernels.activation import silu_mul  # needs triton: imported when on

        return silu_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_kernel is not None:
            rows = gate_up.reshape(-1, gate_up.shape[-1])
            return self.fused_kernel(rows).view(*gate_up.shape[:-1], -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

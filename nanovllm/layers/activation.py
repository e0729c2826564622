"""SwiGLU's gate (chapter 01): ``silu(gate) * up`` on a packed ``[gate | up]`` tensor.

With ``use_triton`` set, one fused Triton kernel does it (chapter 11,
``nanovllm/kernels/activation.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False  # nanovllm.layers.fused.set_fused_kernels switches it

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from nanovllm.kernels.activation import silu_mul  # needs triton: only when on

            return silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*gate_up.shape[:-1], -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

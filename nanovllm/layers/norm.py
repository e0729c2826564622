"""RMSNorm (chapter 01): ``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32.

``forward(x, residual)`` also does the residual add that precedes every norm of a decoder
layer, so the add and the norm can run as one fused Triton kernel (chapter 11,
``nanovllm/kernels/rmsnorm.py``) once ``set_fused_kernels`` (``fused.py``) switches it on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused_kernel: Callable | None = None  # set by layers/fused.py: set_fused_kernels

    @staticmethod
    def load_fused_kernel() -> Callable:
        from nanovllm.kernels.rmsnorm import rmsnorm  # needs triton: imported when switched on

        return rmsnorm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``."""
        if self.fused_kernel is not None:
            rows = x.reshape(-1, x.shape[-1])
            if residual is None:
                return self.fused_kernel(rows, self.weight, self.eps).view(x.shape)
            # the kernel writes x + residual into residual, in place
            y, _ = self.fused_kernel(rows, self.weight, self.eps, residual.view(rows.shape))
            return y.view(x.shape), residual
        if residual is None:
            return self._normalise(x)
        summed = x + residual  # the residual stream after this sub-layer
        return self._normalise(summed), summed

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

        Handout (chapter 01 §1.2, assignment ``01.rmsnorm``): ``x`` is ``[..., dim]`` (tokens,
        or tokens x heads for Qwen3's per-head q/k norms) in the activation dtype (fp32, fp16
        or bf16); ``self.weight`` is ``[dim]`` and ``self.eps`` a float. Return a tensor of
        ``x``'s shape and dtype: each row divided by its root mean square (``eps`` added to
        the mean of squares, under the root), times ``weight`` channel by channel.
        Hint: normalise in fp32 whatever the activation dtype (bf16 cannot hold the mean of
        squares precisely), cast the normalised rows back to ``x.dtype``, then multiply by
        the weight; ``torch.rsqrt`` is one op. Rounding in this order matches
        ``transformers`` bit for bit, which the model tests check (to 1e-4) in fp32.
        """
        # >>> assignment 01.rmsnorm (5 points)
        # Normalise in fp32 whatever the activation dtype: bf16 cannot hold the mean of
        # squares precisely, and this matches transformers' rounding bit for bit.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
        # <<< assignment 01.rmsnorm

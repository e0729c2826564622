"""Switch a model's fused Triton kernels on or off (chapter 11).

RMSNorm (with its residual add), SiluAndMul and the attention block's q/k norm + RoPE each have
a PyTorch path and a fused Triton one (``nanovllm/kernels``). Such a module is ``Fusable``:
``load_fused_kernel()`` imports its kernel (so triton loads only when a kernel is switched on),
and ``fused_kernel`` holds that function while it is on, ``None`` otherwise. ``forward`` picks
its path by that one attribute and imports nothing. The PyTorch path is the default and the
reference; the model runner switches the kernels on with a backend whose
``uses_fused_kernels`` is set (``attention_backends.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class Fusable(Protocol):
    """A module with a PyTorch path and a fused kernel it can switch to."""

    fused_kernel: Callable[..., Any] | None  # written by set_fused_kernels only

    @staticmethod
    def load_fused_kernel() -> Callable[..., Any]:
        """Import and return the fused kernel (needs triton)."""
        ...


def set_fused_kernels(model: nn.Module, enabled: bool) -> None:
    """Switch every ``Fusable`` submodule of ``model`` (itself included) to its fused kernel
    (``enabled``) or back to the PyTorch path. Captured CUDA graphs keep the old path until
    recaptured (``ModelRunner.capture_graphs``)."""
    for module in model.modules():
        if isinstance(module, Fusable):
            module.fused_kernel = module.load_fused_kernel() if enabled else None

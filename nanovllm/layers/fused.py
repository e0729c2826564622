"""Switch a model's fused Triton kernels on or off (chapter 11).

RMSNorm (with its residual add), SiluAndMul and the attention layer's q/k norm + RoPE each have
a PyTorch path and a fused Triton one (``nanovllm/kernels``), picked by a ``use_triton`` flag
on the module. The PyTorch path is the default and the reference.
"""

from __future__ import annotations

from torch import nn


def set_fused_kernels(model: nn.Module, enabled: bool) -> None:
    """Set ``use_triton`` on every submodule of ``model`` that has the flag."""
    for module in model.modules():
        if hasattr(module, "use_triton"):
            module.use_triton = enabled

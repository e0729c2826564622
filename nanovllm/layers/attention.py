"""The attention layer (chapters 02, 04 and 05): paged attention through a backend.

The layer stores the step's new keys and values into the paged cache, then attends over each
sequence's cache, both through its backend (``attention_backends.py``), which it takes when it
is built: the model runner builds the model inside ``building_with(backend)``; a model built
anywhere else gets the torch reference. ``sliding_window`` (Mistral, chapter 12) passes
``window=`` to ``attend``: each query then sees only its last ``window`` keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from nanovllm.context import get_attention_metadata
from nanovllm.layers import torch_attention
from nanovllm.layers.attention_backends import AttentionBackend, TorchBackend

# The backend that attention layers built now take (None: the torch reference).
_backend_for_new_layers: ContextVar[AttentionBackend | None] = ContextVar(
    "backend_for_new_layers", default=None)


@contextmanager
def building_with(backend: AttentionBackend) -> Iterator[None]:
    """Every ``Attention`` built inside this block uses ``backend``."""
    token = _backend_for_new_layers.set(backend)
    try:
        yield
    finally:
        _backend_for_new_layers.reset(token)


class Attention(nn.Module):
    """Paged attention for one layer; the model runner binds its cache tensors."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend = _backend_for_new_layers.get() or TorchBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        window = self.sliding_window
        if meta is None:  # no engine around (e.g. a chapter calling the model directly)
            if window is not None:
                return torch_attention.windowed_attention(q, k, v, self.scale, window)
            return torch_attention.causal_attention(q, k, v, self.scale)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, window)

"""Rotary position embedding, RoPE (chapter 01; long-context scaling in chapter 11).

Each pair of channels (i, i + d/2) of a query or key is rotated by the angle
``position * theta**(-2i/d)``; a dot product of rotated vectors then depends only on the
distance between positions. cos/sin are tabulated once for every position.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency rescaling: slow long wavelengths, keep short ones."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, scaled)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, d] and k [T, Hkv, d] by their tokens' positions [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (i, i + d/2) of every head of ``x`` by its position's angle.

    Handout (chapter 01 §1.3, assignment ``01.rope``): ``x`` is ``[T, H, d]`` (queries or
    keys, any float dtype); ``cos`` and ``sin`` are ``[T, 1, d/2]`` fp32, already looked up
    at each token's position (they broadcast over the heads). Return a new ``[T, H, d]``
    tensor in ``x``'s dtype: with ``x1 = x[..., :d/2]`` and ``x2 = x[..., d/2:]`` (the
    "NeoX" half split that Llama and Qwen3 use, not interleaved pairs), the first half
    becomes ``x1 cos - x2 sin`` and the second ``x2 cos + x1 sin``.
    Hint: cast ``cos``/``sin`` to ``x.dtype`` first (as ``transformers`` does); ``chunk``
    and ``torch.cat`` do the split and the join.
    """
    # >>> assignment 01.rope (6 points)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    # <<< assignment 01.rope

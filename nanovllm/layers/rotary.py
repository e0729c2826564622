"""Rotary position embedding, RoPE (chapter 01; long-context scaling in chapters 11 and 12).

Each pair of channels (i, i + d/2) of a query or key is rotated by the angle
``position * theta**(-2i/d)``; a dot product of rotated vectors then depends only on the
distance between positions. cos/sin are tabulated once for every position.

Long-context scaling (``rope_scaling`` / ``rope_parameters``, read by ``model_config.py``)
changes the frequencies as ``transformers``' ``ROPE_INIT_FUNCTIONS`` do (chapter 12 §2 builds
``linear``, ``llama3``, ``dynamic`` and ``yarn``), with one difference: a paged KV cache holds
keys rotated once, so ``dynamic`` uses the frequencies of the *maximum* length for every
sequence, as vLLM does (chapter 12 §3). YaRN's attention factor is folded into the tables, so
the Triton RoPE kernel (``kernels/rope.py``), which reads them, applies it too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCALING_TYPES = ("linear", "llama3", "dynamic", "yarn")


def scaling_type(scaling: dict | None) -> str:
    """``"default"`` or one of ``SCALING_TYPES``, spelled as transformers 5 (``rope_type``) or
    4 (``type``) spell it."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


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


def _default(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _dynamic_ntk(head_dim: int, theta: float, scaling: dict, seq_len: int) -> torch.Tensor:
    """NTK-aware scaling for sequences of ``seq_len`` tokens: raise the base so the slowest
    pair's wavelength grows with the length while the fastest barely moves."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    seq_len = max(seq_len, old_len)  # within the trained length: the plain frequencies
    base = theta * (factor * seq_len / old_len - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _default(head_dim, base)


def _yarn_correction_dim(rotations: float, head_dim: int, theta: float, old_len: int) -> float:
    """The (fractional) pair index that turns ``rotations`` times over ``old_len`` positions."""
    return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts": pairs that turn more than ``beta_fast`` times within the trained
    length keep their frequency, pairs that turn fewer than ``beta_slow`` times are divided by
    ``factor``, and a linear ramp over the pair index blends the two in between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(fast, head_dim, theta, old_len)
    high = _yarn_correction_dim(slow, head_dim, theta, old_len)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = _default(head_dim, theta)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict | None, max_position: int | None = None
) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies, after the config's scaling if any.

    ``max_position`` matters only for ``dynamic``: the sequence length whose frequencies to
    use (the engine passes its table length; by default the trained length times ``factor``).
    """
    kind = scaling_type(scaling)
    if kind == "default":
        return _default(head_dim, theta)
    if kind == "llama3":
        return _llama3_scaled(_default(head_dim, theta), scaling)
    if kind == "linear":
        return _default(head_dim, theta) / scaling["factor"]
    if kind == "dynamic":
        trained = scaling["original_max_position_embeddings"]
        length = max_position or int(trained * scaling["factor"])
        return _dynamic_ntk(head_dim, theta, scaling, length)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, "
                     f"{', '.join(SCALING_TYPES)}")


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN's factor on cos/sin (so on every attention logit, squared); 1 for other types.

    ``attention_factor`` if the config gives it, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are given (DeepSeek's spelling), else
    ``mscale(factor) = 0.1 ln(factor) + 1``: longer contexts spread attention thinner, and a
    slightly larger logit scale sharpens it back (the YaRN paper's fit).
    """
    if scaling_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, max_position)
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        gain = rope_attention_factor(scaling)  # YaRN's: folded into the tables (see above)
        self.register_buffer("cos", angles.cos() * gain, persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", angles.sin() * gain, persistent=False)

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

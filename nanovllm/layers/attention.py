"""The attention layer and its backends (chapters 02, 04 and 05).

The layer stores the step's new keys and values into the paged cache, then attends over
everything cached for each sequence. Which code does that is the *backend*:

- ``torch``: the PyTorch reference (``torch_attention.py``), any device;
- ``triton``: our Triton kernels (``nanovllm/kernels``), CUDA (or CPU under the interpreter);
- ``flash_attn``: the flash-attn package, when it is installed.

``attention_backend="auto"`` takes the fastest one available on the device.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
from torch import nn

from nanovllm.context import get_attention_metadata
from nanovllm.layers import torch_attention


def _triton_backend() -> SimpleNamespace:
    from nanovllm.kernels.decode_attention import decode_attention
    from nanovllm.kernels.prefill_attention import prefill_attention
    from nanovllm.kernels.store_kv import store_kv

    def attend(q, k_cache, v_cache, meta, scale):
        # Decodes (packed first, one token each) take the decode kernel, the rest the
        # prefill kernel, whose query offsets are shifted past the decodes.
        nd, tables, lens = meta.num_decodes, meta.block_tables, meta.seq_lens_k
        if nd == len(meta.seq_lens_k_host):
            return decode_attention(q, k_cache, v_cache, lens, tables, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, lens[:nd], tables[:nd], scale)
        cu_q = meta.cu_seqlens_q[nd:] - nd
        prefill_attention(
            q[nd:],
            k_cache,
            v_cache,
            cu_q,
            lens[nd:],
            tables[nd:],
            scale,
            meta.max_seqlen_q,
            out=out[nd:],
        )
        return out

    return SimpleNamespace(name="triton", store_kv=store_kv, attend=attend)


def _torch_backend() -> SimpleNamespace:
    return SimpleNamespace(
        name="torch", store_kv=torch_attention.store_kv, attend=torch_attention.paged_attention
    )


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend "auto" stands for on a device type: Triton on CUDA where it is installed."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" and importlib.util.find_spec("triton") else "torch"


def select_backend(name: str, device: torch.device) -> SimpleNamespace:
    """Resolve a backend name ("auto" included) to its functions, or explain why not."""
    name = resolve_backend_name(name, device.type)
    if name == "torch":
        return _torch_backend()
    if name == "triton":
        try:
            return _triton_backend()
        except ImportError as err:
            raise ValueError(f"attention_backend='triton' is unavailable: {err}") from err
    if name == "flash_attn":
        raise ValueError("attention_backend='flash_attn' needs the flash-attn package")
    raise ValueError(f"unknown attention backend {name!r}")


class Attention(nn.Module):
    """Paged attention for one layer; the model runner binds its cache tensors."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend = _torch_backend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        if meta is None:  # no engine around (e.g. a chapter calling the model directly)
            return torch_attention.causal_attention(q, k, v, self.scale)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)

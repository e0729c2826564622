"""The attention layer and its backends (chapters 02, 04 and 05).

The layer stores the step's new keys and values into the paged cache, then attends over
everything cached for each sequence. Which code does that is the *backend*:

- ``torch``: the PyTorch reference (``torch_attention.py``), any device;
- ``triton``: our Triton kernels (``nanovllm/kernels``), CUDA (or CPU under the interpreter);
- ``flash_attn``: FlashAttention-4's CuTe-DSL kernels (optional package ``flash-attn-4``)
  on Hopper or newer GPUs, bf16/fp16, no fp8 cache (``flash_attention.py``).

``attention_backend="auto"`` takes Triton on CUDA and torch elsewhere: it does not pick
``flash_attn`` (chapter 11 compares the two on an H200). ``GPU_BACKENDS`` bring the fused
Triton kernels along and run decode steps in CUDA graphs (``model_runner.py``).

With ``kv_cache_dtype="fp8"`` (chapter 08) the cache holds e4m3 values, ``K / k_scale`` and
``V / v_scale``: the Triton kernels read it directly (``store_kv`` quantizes, decode and
prefill widen each tile on load and fold the scales into the softmax scale and the output);
the torch backend is wrapped by ``fp8_kv_backend`` (quantize on store, dequantize the blocks
a step uses).

A layer built with ``sliding_window`` (Mistral, chapter 12) passes ``window=`` to its
backend's ``attend``: every query then sees only its last ``window`` keys. Layers without one
call ``attend`` exactly as before.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
from torch import nn

from nanovllm.context import get_attention_metadata
from nanovllm.layers import torch_attention
from nanovllm.layers.quantization.kv_cache import DEFAULT_KV_SCALE, fp8_kv_backend

GPU_BACKENDS = ("triton", "flash_attn")


def _triton_backend(k_scale: float = 1.0, v_scale: float = 1.0) -> SimpleNamespace:
    """Our kernels; ``k_scale``/``v_scale``: an fp8 cache's per-layer scales (else unused)."""
    from nanovllm.kernels.decode_attention import decode_attention
    from nanovllm.kernels.prefill_attention import prefill_attention
    from nanovllm.kernels.store_kv import store_kv as store_kv_kernel

    scales = dict(k_scale=k_scale, v_scale=v_scale)

    def store_kv(key, value, k_cache, v_cache, slot_mapping):
        store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, **scales)

    def attend(q, k_cache, v_cache, meta, scale, window=None):
        scales_w = {**scales, "window": window} if window is not None else scales
        # Decodes (packed first, one token each) take the decode kernel, the rest the
        # prefill kernel, whose query offsets are shifted past the decodes.
        nd, tables, lens = meta.num_decodes, meta.block_tables, meta.seq_lens_k
        if nd == len(meta.seq_lens_k_host):
            return decode_attention(q, k_cache, v_cache, lens, tables, scale, **scales_w)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(
                q[:nd], k_cache, v_cache, lens[:nd], tables[:nd], scale, **scales_w
            )
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
            **scales_w,
        )
        return out

    return SimpleNamespace(name="triton", store_kv=store_kv, attend=attend, **scales)


def _torch_backend() -> SimpleNamespace:
    return SimpleNamespace(
        name="torch", store_kv=torch_attention.store_kv, attend=torch_attention.attend
    )


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend "auto" stands for on a device type: Triton on CUDA where it is installed."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" and importlib.util.find_spec("triton") else "torch"


def select_backend(
    name: str, device: torch.device, kv_cache_dtype: str = "auto"
) -> SimpleNamespace:
    """Resolve a backend name ("auto" included) to its functions, or explain why not.

    ``kv_cache_dtype="fp8"``: the backend reads and writes an e4m3 cache (chapter 08), with
    one static scale for K and one for V (``DEFAULT_KV_SCALE``; see ``kv_cache.py``).
    """
    name = resolve_backend_name(name, device.type)
    fp8 = kv_cache_dtype == "fp8"
    scale = DEFAULT_KV_SCALE
    if name == "torch":
        return fp8_kv_backend(_torch_backend(), scale, scale) if fp8 else _torch_backend()
    if name == "triton":
        try:
            backend = _triton_backend(scale, scale) if fp8 else _triton_backend()
        except ImportError as err:
            raise ValueError(f"attention_backend='triton' is unavailable: {err}") from err
        if fp8:  # the kernels read e4m3 themselves: no wrapper
            backend.kv_cache_dtype = "fp8"
        return backend
    if name == "flash_attn":
        from nanovllm.layers.flash_attention import flash_attention_backend

        if fp8:  # EngineConfig refuses this earlier (check_flash_attn); direct callers here
            raise ValueError(
                "attention_backend='flash_attn' does not read an fp8 KV cache; use "
                "attention_backend='triton' with kv_cache_dtype='fp8'"
            )
        return flash_attention_backend()
    raise ValueError(f"unknown attention backend {name!r}")


class Attention(nn.Module):
    """Paged attention for one layer; the model runner binds its cache tensors."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend = _torch_backend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        window = self.sliding_window
        if meta is None:  # no engine around (e.g. a chapter calling the model directly)
            if window is not None:
                return torch_attention.windowed_attention(q, k, v, self.scale, window)
            return torch_attention.causal_attention(q, k, v, self.scale)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if window is not None:
            return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale,
                                       window=window)
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)

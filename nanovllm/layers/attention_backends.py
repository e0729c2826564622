"""The attention backends, in one registry (chapters 02, 05, 08 and 11).

A backend stores a step's new keys and values into the paged cache and attends over each
sequence's cache: ``torch``, the PyTorch reference (any device); ``triton``, our kernels (CUDA,
or CPU under the interpreter); ``flash_attn``, FlashAttention-4 (``flash_attention.py``). Each
class's ``check(config, device)`` says why it cannot run a configuration before anything is
built (``EngineConfig`` calls it through ``resolve_backend``); its constructor imports what it
needs once, so ``store_kv`` and ``attend`` only compute. ``"auto"`` takes Triton on CUDA where
it is installed and torch elsewhere: never ``flash_attn`` (chapter 11 §4.5 says why), and never
the slow reference in place of the GPU kernels silently. An fp8 cache (chapter 08 §7): the
Triton kernels read e4m3 themselves; the torch backend quantizes on store and dequantizes the
blocks a step uses (``quantization/kv_cache.py``).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from nanovllm.context import AttentionMetadata
from nanovllm.layers import torch_attention
from nanovllm.layers.flash_attention import FlashAttnBackend, package_installed
from nanovllm.layers.quantization.fp8 import MIN_FP8_CAPABILITY, fp8_supported
from nanovllm.layers.quantization.kv_cache import (
    DEFAULT_KV_SCALE,
    dequantize_used_blocks,
    quantize_kv,
)

Tensor = torch.Tensor
# The Triton attention launchers (decode_attention, prefill_attention) refuse smaller blocks.
TRITON_MIN_BLOCK_SIZE = 16


class BackendSettings(Protocol):
    """What a backend's ``check`` reads: ``EngineConfig`` has these fields (chapter 00)."""

    attention_backend: str
    dtype: str
    block_size: int
    kv_cache_dtype: str


@runtime_checkable
class AttentionBackend(Protocol):
    """What an attention layer calls, and what the engine asks of a backend."""

    name: ClassVar[str]
    uses_fused_kernels: ClassVar[bool]  # the fused norm/RoPE/activation kernels run beside it
    cuda_graphs: ClassVar[bool]  # no host sync in a step: decode steps may be captured
    kv_cache_dtype: str  # "auto" (the model's dtype) or "fp8"

    @classmethod
    def check(cls, config: BackendSettings, device: torch.device) -> str | None:
        """Why this backend cannot run ``config`` on ``device``; ``None`` if it can."""
        ...

    def store_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        """Write each new token's key and value into its cache slot (slot -1: skip)."""
        ...

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> Tensor:
        """Each query row over its own sequence's cached keys (the last ``window`` only)."""
        ...


class TorchBackend:
    """The PyTorch reference over the paged cache (``torch_attention.py``), any device."""

    name = "torch"
    uses_fused_kernels = False
    cuda_graphs = False  # reads lengths on the host (``.tolist()``, ``int(...max())``)

    def __init__(self, kv_cache_dtype: str = "auto", k_scale: float = DEFAULT_KV_SCALE,
                 v_scale: float = DEFAULT_KV_SCALE) -> None:
        self.kv_cache_dtype, self.k_scale, self.v_scale = kv_cache_dtype, k_scale, v_scale

    @classmethod
    def check(cls, config: BackendSettings, device: torch.device) -> str | None:
        return None  # any device, dtype, block size and cache dtype

    def store_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        if self.kv_cache_dtype == "fp8":
            key, value = quantize_kv(key, self.k_scale), quantize_kv(value, self.v_scale)
        torch_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> Tensor:
        if self.kv_cache_dtype == "fp8":  # a compact, widened copy of the blocks in use
            k_cache, v_cache, meta = dequantize_used_blocks(
                k_cache, v_cache, meta, self.k_scale, self.v_scale, q.dtype
            )
        return torch_attention.attend(q, k_cache, v_cache, meta, scale, window)


class TritonBackend:
    """Our kernels (chapters 02 and 05); ``k_scale``/``v_scale``: an fp8 cache's scales."""

    name = "triton"
    uses_fused_kernels = True
    cuda_graphs = True

    def __init__(self, kv_cache_dtype: str = "auto", k_scale: float = DEFAULT_KV_SCALE,
                 v_scale: float = DEFAULT_KV_SCALE) -> None:
        # Imported here, once: triton must not load before TRITON_INTERPRET is set (CPU).
        from nanovllm.kernels.decode_attention import decode_attention
        from nanovllm.kernels.prefill_attention import prefill_attention
        from nanovllm.kernels.store_kv import store_kv

        self.decode_kernel, self.prefill_kernel, self.store_kernel = (
            decode_attention, prefill_attention, store_kv
        )
        self.kv_cache_dtype, self.k_scale, self.v_scale = kv_cache_dtype, k_scale, v_scale

    @classmethod
    def check(cls, config: BackendSettings, device: torch.device) -> str | None:
        if not package_installed("triton"):
            return "attention_backend='triton' needs the triton package: pip install triton"
        if config.block_size < TRITON_MIN_BLOCK_SIZE:
            return (
                f"block_size {config.block_size} is too small for the Triton attention kernels "
                f"(attention_backend={config.attention_backend!r} on {device}): use "
                f"block_size >= {TRITON_MIN_BLOCK_SIZE}, or attention_backend='torch'"
            )
        # Triton's e4m3 type (tl.float8e4nv) compiles only for compute capability >= 8.9;
        # under the interpreter (CPU) it always works.
        if config.kv_cache_dtype == "fp8" and not fp8_supported(device):
            major, minor = torch.cuda.get_device_capability(device)
            need = ".".join(map(str, MIN_FP8_CAPABILITY))
            return (
                f"kv_cache_dtype='fp8' with the Triton attention kernels needs a GPU of compute "
                f"capability >= {need} (Ada, Hopper or newer: Triton converts e4m3 only there); "
                f"{device} has {major}.{minor} (attention_backend="
                f"{config.attention_backend!r}). Use attention_backend='torch', or "
                "kv_cache_dtype='auto'"
            )
        return None

    def store_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        self.store_kernel(key, value, k_cache, v_cache, slot_mapping,
                          k_scale=self.k_scale, v_scale=self.v_scale)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> Tensor:
        extra = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if window is not None:
            extra["window"] = window
        # Decodes (packed first, one token each) take the decode kernel, the rest the
        # prefill kernel, whose query offsets are shifted past the decodes.
        nd, tables, lens = meta.num_decodes, meta.block_tables, meta.seq_lens_k
        if nd == len(meta.seq_lens_k_host):
            return self.decode_kernel(q, k_cache, v_cache, lens, tables, scale, **extra)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode_kernel(
                q[:nd], k_cache, v_cache, lens[:nd], tables[:nd], scale, **extra
            )
        cu_q = meta.cu_seqlens_q[nd:] - nd
        self.prefill_kernel(q[nd:], k_cache, v_cache, cu_q, lens[nd:], tables[nd:], scale,
                            meta.max_seqlen_q, out=out[nd:], **extra)
        return out


BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (TorchBackend, TritonBackend, FlashAttnBackend)
}


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend "auto" stands for on a device type: Triton on CUDA where it is installed."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" and package_installed("triton") else "torch"


def resolve_backend(config: BackendSettings, device: torch.device) -> type[AttentionBackend]:
    """The backend class ``config.attention_backend`` names ("auto" resolved) on ``device``.

    Raises ``ValueError`` when it cannot run there: its reason, then every backend's verdict,
    so the message names what would run instead.
    """
    device = torch.device(device)
    name = resolve_backend_name(config.attention_backend, device.type)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    reason = BACKENDS[name].check(config, device)
    if reason is None:
        return BACKENDS[name]
    verdicts = [f"{other}: {why or 'runs'}" for other, cls in BACKENDS.items() if other != name
                for why in [cls.check(config, device)]]
    raise ValueError(f"{reason}. Here the other backends say: " + "; ".join(verdicts))


def select_backend(config: BackendSettings, device: torch.device) -> AttentionBackend:
    """The backend the model runner gives every attention layer, built for the cache dtype."""
    return resolve_backend(config, device)(config.kv_cache_dtype)

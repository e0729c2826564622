"""The ``flash_attn`` attention backend: FlashAttention-4 over our paged KV cache (chapters 02,
05 and 11 measure it against our Triton kernels).

The package is ``flash-attn-4`` (pre-releases: ``pip install --pre flash-attn-4``), imported as
``flash_attn.cute`` only when the backend is built. What the backend relies on, read in the
source of 4.0.0b36 (``flash_attn/cute/interface.py``, ``paged_kv.py``, ``block_info.py``,
``mask.py``):

- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, max_seqlen_q=, seqused_k=, page_table=,
  softmax_scale=, causal=, window_size=(left, right), num_splits=)`` returns ``(out, lse)``,
  ``out`` ``[total_q, H, d]`` in q's dtype; q may be a strided view (16-byte aligned rows).
- Paged K/V ``[num_pages, page_size, Hkv, d]`` are our per-layer cache views, ``page_table``
  ``[B, max_pages]`` int32 our block tables (entries past ``ceil(seqused_k / page_size)``, our
  -1 padding, are never dereferenced), ``seqused_k`` our ``seq_lens_k``: nothing is copied.
- Causal masks align bottom-right (query i of Lq sees keys up to ``Lk - Lq + i``), so one call
  serves decodes, prompts and chunks after a cached prefix in any order. GQA: H a multiple of
  Hkv. ``window_size=(W - 1, 0)`` with ``causal=True`` keeps the last W keys, the query's own
  included (Mistral's and ``torch_attention``'s definition).
- fp16 and bf16 only (fp8 only on SM100 with q in fp8 too); head_dim 8..256, a multiple of 8.
  A page table is accepted on SM90 and SM100/SM110, refused on SM80 and SM120. Any page size;
  pages of one key tile (128 for d=128 on SM90) load by TMA, which reads whole pages, rows
  past ``seqused_k`` too (masked, but they must be finite: our cache starts zeroed and
  receives finite values only).
- No split-KV on SM90 (``num_splits=1``): a small decode batch leaves most SMs idle.
- Each variant compiles on first use (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps them
  on disk). No host sync and the current stream, so CUDA graphs capture it; rows with
  ``seqused_k = 0`` (graph padding) attend to nothing. The Python wrapper's host cost per call
  is hidden by graphs in decode steps, not in eager prefill and mixed steps (``host_us`` in
  ``nanovllm/benchmarks/attention_backends.py``). SM100 is untried here.

Our Triton ``store_kv`` stores new keys and values (flash-attn-4 has none), and the fused
Triton norm/RoPE/activation kernels stay on.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nanovllm.context import AttentionMetadata

Tensor = torch.Tensor

PIP_HINT = "pip install --pre flash-attn-4"
# Compute-capability majors whose flash-attn-4 kernels accept a page table (see above).
PAGED_MAJORS = (9, 10, 11)
# Page sizes checked on an H200 run 16..256; smaller pages are not known to work.
MIN_BLOCK_SIZE = 16
DTYPES = ("float16", "bfloat16")


def package_installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def varlen_kwargs(meta: AttentionMetadata, scale: float,
                  window: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``flash_attn_varlen_func`` for one packed step.

    Views of the step's metadata only (no copy, no host sync): the same tensors a captured
    CUDA graph refills before each replay. ``window``: a sliding window of ``window`` keys.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return {
        "cu_seqlens_q": meta.cu_seqlens_q,  # [B + 1] int32
        "max_seqlen_q": meta.max_seqlen_q,  # a host int: picks the kernel variant
        "seqused_k": meta.seq_lens_k,  # [B] int32: cached prefix + this step's tokens
        "page_table": meta.block_tables,  # [B, max_blocks] int32, -1 past the end
        "softmax_scale": scale,
        "causal": True,  # bottom-right aligned: decodes, prompts and chunks alike
        "window_size": (window - 1, 0) if window is not None else (None, None),
        "num_splits": 1,  # SM90 has no split-KV
    }


class FlashAttnBackend:
    """FlashAttention-4 over our paged cache: an ``AttentionBackend`` (attention_backends.py)."""

    name = "flash_attn"
    uses_fused_kernels = True
    cuda_graphs = True

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype != "auto":  # check() refuses this first; direct callers land here
            raise ValueError(
                "attention_backend='flash_attn' does not read an fp8 KV cache; use "
                "attention_backend='triton' with kv_cache_dtype='fp8'"
            )
        try:  # imported here, once: the package is optional
            from flash_attn.cute import flash_attn_varlen_func
        except ImportError as err:
            raise ValueError(
                f"attention_backend='flash_attn' needs the flash-attn-4 package ({PIP_HINT}): "
                f"{err}"
            ) from err
        from nanovllm.kernels.store_kv import store_kv

        self.varlen_func, self.store_kernel = flash_attn_varlen_func, store_kv
        self.kv_cache_dtype = kv_cache_dtype

    @classmethod
    def check(cls, config: Any, device: torch.device) -> str | None:
        """Why this backend cannot run ``config`` (an ``EngineConfig``) on ``device``; or None."""
        device = torch.device(device)
        name = "attention_backend='flash_attn' (FlashAttention-4, package flash-attn-4)"
        if device.type != "cuda":
            return (f"{name} runs on CUDA GPUs only; device is {str(device)!r}. Use "
                    "attention_backend='torch' or 'triton'")
        major, minor = torch.cuda.get_device_capability(device)
        if major not in PAGED_MAJORS:
            return (f"{name} needs a GPU whose flash-attn-4 kernels read a paged KV cache: "
                    f"compute capability 9.x (Hopper) or 10.x/11.x (Blackwell); {device} has "
                    f"{major}.{minor}. Use attention_backend='triton'")
        if not package_installed("flash_attn.cute"):
            return f"{name} needs the flash-attn-4 package: {PIP_HINT}"
        if not package_installed("triton"):
            return f"{name} stores keys and values with a Triton kernel: pip install triton"
        if config.dtype not in DTYPES:
            return (f"{name} computes in float16 or bfloat16 only; dtype is {config.dtype!r}. "
                    "Use dtype='bfloat16', or attention_backend='triton' for float32")
        if config.kv_cache_dtype != "auto":
            return (f"{name} does not read an fp8 KV cache here (flash-attn-4 wants q in fp8 "
                    f"too and runs fp8 on SM100 only); kv_cache_dtype is "
                    f"{config.kv_cache_dtype!r}. Use attention_backend='triton' with "
                    "kv_cache_dtype='fp8'")
        if config.block_size < MIN_BLOCK_SIZE:
            return (f"block_size {config.block_size} is below what {name} is known to run "
                    f"(pages of {MIN_BLOCK_SIZE}..256 tokens were checked): use block_size >= "
                    f"{MIN_BLOCK_SIZE}")
        return None

    def store_kv(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
        self.store_kernel(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None) -> Tensor:
        out, _ = self.varlen_func(q, k_cache, v_cache, **varlen_kwargs(meta, scale, window))
        return out

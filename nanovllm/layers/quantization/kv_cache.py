"""The fp8 KV cache (chapter 08 §7): keys and values stored as e4m3, one byte each.

One static scale per layer for K and one for V (``k_scale``, ``v_scale``, 1.0 as in vLLM without
calibrated scales; checkpoints' ``k_scale``/``v_scale`` are not read yet): e4m3 keeps its
relative precision from 2**-6 to 448 whatever the scale, and a per-layer scalar folds into the
softmax scale (K) and the output (V), so the kernels barely change. The ``triton`` backend's
kernels read and write e4m3 themselves; the ``torch`` backend quantizes on store
(``quantize_kv``: clamped, as an out-of-range cast may give NaN on some torch builds) and
widens the blocks a step uses to the query's dtype (``dequantize_used_blocks``) for the
ordinary reference, correct on any device but moving those blocks twice per step.
"""

from __future__ import annotations

import dataclasses

import torch

from nanovllm.context import AttentionMetadata
from nanovllm.layers.quantization.scales import FP8_DTYPE, FP8_MAX

DEFAULT_KV_SCALE = 1.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``EngineConfig.kv_cache_dtype`` ("auto": the model's)."""
    return FP8_DTYPE if name == "fp8" else model_dtype


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as e4m3, saturating at +-448 rather than overflowing."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def compact_blocks(
    block_tables: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block ids ``block_tables`` uses, the tables renumbered to index that list).

    Padding entries (-1) stay -1. With no block used at all, block 0 stands in, so the
    compact cache is never empty.
    """
    used = torch.unique(block_tables[block_tables >= 0]).long()
    if used.numel() == 0:
        used = torch.zeros(1, dtype=torch.long, device=block_tables.device)
    position = torch.full((num_blocks,), -1, dtype=block_tables.dtype, device=used.device)
    position[used] = torch.arange(len(used), dtype=block_tables.dtype, device=used.device)
    renumbered = torch.where(block_tables >= 0, position[block_tables.clamp(min=0).long()], -1)
    return used, renumbered.to(block_tables.dtype)


def dequantize_used_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float,
    v_scale: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The blocks ``meta``'s tables use, widened to ``dtype``, and the metadata renumbered to
    index them: an e4m3 cache as the ordinary torch backend reads one."""
    used, tables = compact_blocks(meta.block_tables, k_cache.shape[0])
    k = dequantize_kv(k_cache[used], k_scale, dtype)
    v = dequantize_kv(v_cache[used], v_scale, dtype)
    return k, v, dataclasses.replace(meta, block_tables=tables)

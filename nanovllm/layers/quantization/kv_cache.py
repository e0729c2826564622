"""The fp8 KV cache (chapter 08, section 7): keys and values stored as e4m3, one byte each.

``kv_cache_dtype="fp8"`` halves the bytes per cached token against bf16 (a quarter of fp32),
so the same memory holds twice the blocks: twice the tokens in flight, and half the bytes a
decode step reads from the cache.

Scale granularity: one scale per layer for K and one for V (``k_scale``, ``v_scale``), static,
1.0 by default, as in vLLM when the checkpoint brings no calibrated scales. Why that is
enough: e4m3 is a floating-point format, so a value keeps the same relative precision
(3 mantissa bits) anywhere between 2**-6 and 448, whatever the scale; a scale only has to keep
the largest keys below 448 and the bulk above 2**-6. Measured on SmolLM2-135M: the largest
|K| over all 30 layers is 18.6, the largest |V| 12.0, medians 0.88 and 0.40, and 1.2% (K) and
3.8% (V) of the values fall below 2**-6, where precision thins out (those matter least).
Finer scales (per token and head) would cost a scale tensor beside every block and a load
per tile in every attention kernel; a per-layer scalar folds into the softmax scale (K) and
the output (V), so the kernels barely change. A model whose keys exceed 448 would need a
calibrated scale (left for later: checkpoints' ``k_scale``/``v_scale`` are not read yet).

Two paths (the attention backends of ``nanovllm/layers/attention_backends.py``):

- ``triton``: the kernels read and write e4m3 themselves. ``store_kv`` divides by the scale,
  saturates and rounds; the paged decode and prefill kernels load one byte per element, widen
  each tile to the query's dtype in registers, fold ``k_scale`` into the softmax scale and
  multiply the output by ``v_scale``. Triton converts e4m3 on GPUs of compute capability
  >= 8.9 only (``EngineConfig`` refuses older ones), and under the interpreter on CPU.
- ``torch``: storing divides by the scale (``quantize_kv``), clamps to +-448 (an
  out-of-range cast may give NaN on some torch builds) and casts; attending gathers only the
  blocks the batch's block tables use, dequantizes them to the query's dtype
  (``dequantize_used_blocks``) and runs the ordinary reference on that compact cache with
  renumbered block tables. Correct on any device, but it moves the used blocks twice per step.
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
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float,
    v_scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The blocks ``meta``'s tables use, widened to ``dtype``, and the metadata renumbered to
    index them: an e4m3 cache as the ordinary torch backend reads one."""
    used, tables = compact_blocks(meta.block_tables, k_cache.shape[0])
    k = dequantize_kv(k_cache[used], k_scale, dtype)
    v = dequantize_kv(v_cache[used], v_scale, dtype)
    return k, v, dataclasses.replace(meta, block_tables=tables)

"""Write the new tokens' keys and values into the paged KV cache (a Triton kernel; chapter 05).

Token ``i`` goes to the flat slot ``slot_mapping[i] = block_id * block_size + row`` chosen by
the block manager, for all KV heads at once; slot ``-1`` (a CUDA-graph padding row) is skipped.
One program per token; any row stride, so a slice of a fused QKV projection needs no copy. An
fp8 cache (chapter 08) stores ``clamp(x / scale, -448, 448)`` rounded to e4m3, one scale each
for K and V per layer, bit for bit what the torch backend stores (``quantization/kv_cache.py``).
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import FP8_E4M3_MAX, check_launchable, round_to_e4m3

__all__ = ["store_kv"]

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a slice of the step's metadata
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,  # key: [N, H, D], last dim contiguous
    stride_vn,
    stride_vh,  # value: [N, H, D], last dim contiguous
    stride_cb,
    stride_ct,
    stride_ch,  # k_cache: [num_blocks, block_size, H, D]
    stride_db,
    stride_dt,
    stride_dh,  # v_cache: same shape, its own strides
    block_size,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8 e4m3: scale, saturate, round
    INTERPRETED: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # i * row stride may pass 2**31
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # The token's slot, read once per head row: a scalar bool in a mask trips the interpreter.
    slot = tl.load(slot_ptr + i + h * 0).to(tl.int64)[:, None]  # [H_PAD, 1]
    block = slot // block_size
    row = slot % block_size
    # slot -1 (padding) masks the whole tile: nothing is read or written for this token
    mask = (slot >= 0) & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + i * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + i * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + row * stride_ct + h[:, None] * stride_ch + d[None, :]
    v_dst = v_cache_ptr + block * stride_db + row * stride_dt + h[:, None] * stride_dh + d[None, :]
    if FP8:
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
        tl.store(k_dst, round_to_e4m3(k, INTERPRETED), mask=mask)
        tl.store(v_dst, round_to_e4m3(v, INTERPRETED), mask=mask)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Copy ``key``/``value`` ``[N, num_kv_heads, head_dim]`` into the paged caches, in place.

    ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    ``slot_mapping``: int32/int64 ``[N]``; token ``i`` goes to block ``slot // block_size``,
    row ``slot % block_size``; ``-1`` skips the token. Values are cast to the cache's dtype;
    into an e4m3 cache they are first divided by ``k_scale``/``v_scale`` and saturated at
    +-448 (the scales are ignored for other caches).
    """
    n, num_kv_heads, head_dim = key.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key has {num_kv_heads} heads x {head_dim}, cache has {cache_heads} x {cache_dim}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        raise ValueError(f"fp8 caches must be float8_e4m3fn, got {k_cache.dtype}")
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be [{n}], got {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    check_launchable(key, _store_kv_kernel)
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_size, float(k_scale), float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), FP8=k_cache.dtype == torch.float8_e4m3fn,
        INTERPRETED=key.device.type != "cuda",
    )

"""The reference attention backend: plain PyTorch over the paged KV cache.

Chapter 02 builds attention up to this; chapter 04 explains the paging. It runs on any
device and is the yardstick every faster kernel is tested against.

Cache layout, shared by all backends: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token t of a sequence lives in
block ``block_table[t // block_size]`` at row ``t % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.context import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's key and value into its slot; slot -1 means skip."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence, as ``[length, kv_heads, dim]``."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q [Lq, H, d] over k, v [Lk, Hkv, d], where the queries are the *last*
    Lq of the Lk positions: query i sees keys 0 .. Lk - Lq + i."""
    lq, lk = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    mask = None
    if 1 < lq < lk:  # a chunk after a cached prefix: the causal diagonal is offset
        rows = torch.arange(lk - lq, lk, device=q.device)[:, None]
        mask = torch.arange(lk, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=1 < lq == lk, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, all sequences at once: gather, pad, mask, attend."""
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)].long().clamp(min=0)
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, d]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    # Rows past a sequence's end hold whatever their block held before and are masked out.
    # That is safe because the cache starts zeroed and only ever receives finite keys and
    # values (a NaN there would survive the mask: 0 * NaN = NaN). Zeroing the padding here
    # instead would cost two more copies of the gathered cache: a third of CPU decode time.
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a packed batch: decodes batched together, then each prefill chunk."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode_attention(
            q[:nd], k_cache, v_cache, meta.seq_lens_k[:nd], meta.block_tables[:nd], scale
        )
    cu, lens = meta.cu_seqlens_q_host, meta.seq_lens_k_host
    for b in range(nd, len(lens)):
        k = gather_kv(k_cache, meta.block_tables[b], lens[b])
        v = gather_kv(v_cache, meta.block_tables[b], lens[b])
        out[cu[b] : cu[b + 1]] = causal_attention(q[cu[b] : cu[b + 1]], k, v, scale)
    return out

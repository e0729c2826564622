"""The reference attention backend: plain PyTorch over the paged KV cache.

Chapter 02 builds attention up to this; chapter 04 explains the paging. It runs on any
device and is the yardstick every faster kernel is tested against.

Cache layout, shared by all backends: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token t of a sequence lives in
block ``block_table[t // block_size]`` at row ``t % block_size``.

Sliding-window attention (Mistral; chapter 12): each query sees only its last ``window``
keys, itself included. ``windowed_attention`` and ``windowed_paged_attention`` are the
reference for that; the plain functions above them stay window-free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.context import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's key and value into its slot; slot -1 means skip.

    Handout (chapter 03 §1.3, assignment ``03.store_kv``): ``key`` and ``value`` are
    ``[T, num_kv_heads, head_dim]``, one row per new token of the step; ``slot_mapping`` is
    ``[T]`` (int): token i goes to row ``slot_mapping[i] % block_size`` of block
    ``slot_mapping[i] // block_size`` of ``k_cache`` / ``v_cache``
    (``[num_blocks, block_size, num_kv_heads, head_dim]``), in place. A slot of -1 is padding
    (a CUDA-graph row, chapter 07): write nothing for it. Return nothing.
    Hint: viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` the cache is indexed
    by the slot itself; drop the -1 rows first (index -1 would write the last row).
    """
    # >>> assignment 03.store_kv (4 points)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value
    # <<< assignment 03.store_kv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence, as ``[length, kv_heads, dim]``."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q [Lq, H, d] over k, v [Lk, Hkv, d], where the queries are the *last*
    Lq of the Lk positions: query i sees keys 0 .. Lk - Lq + i.

    Handout (chapter 02 §2.2–2.6 and §3, assignment ``02.causal_attention``): return
    ``[Lq, H, d]`` in ``q``'s dtype, ``softmax(scale * q k^T) v`` per head, where query head h
    reads KV head ``h // (H // Hkv)`` (grouped-query attention) and query i may see key j only
    if ``j <= Lk - Lq + i``. Three cases: a whole prompt (``Lq == Lk``, the usual causal
    triangle), one decode query (``Lq == 1``: it sees every key) and a chunk after a cached
    prefix (``1 < Lq < Lk``: the triangle shifted right by ``Lk - Lq``).
    Hint: ``F.scaled_dot_product_attention`` takes ``[heads, L, d]`` tensors, a boolean
    ``attn_mask`` (True = may attend), ``is_causal`` (the unshifted triangle only), ``scale``
    and ``enable_gqa=True``.
    """
    # >>> assignment 02.causal_attention (6 points)
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
    # <<< assignment 02.causal_attention


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once: gather, pad, mask, attend.

    Handout (chapter 03 §1.3, assignment ``03.decode_attention``): ``q`` is ``[B, H, d]``, the
    one new query of each of B sequences, whose key and value are already stored; sequence b
    has ``seq_lens[b]`` cached tokens, token t in block ``block_tables[b, t // block_size]``
    at row ``t % block_size`` (entries past its last block are -1). Return ``[B, H, d]``: each
    query attending over all of its own sequence's tokens (GQA as in ``causal_attention``).
    Hint: index the cache with the (clamped) block tables to gather ``[B, L, Hkv, d]`` for
    the longest length L, and mask the rows past each sequence's end with ``attn_mask``; the
    cache holds only finite numbers, so masked rows cannot poison the result.
    """
    # >>> assignment 03.decode_attention (6 points)
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
    # <<< assignment 03.decode_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a packed batch: decodes batched together, then each prefill chunk.

    Handout (chapter 02 §2.6, assignment ``02.paged_attention``): the step's tokens are
    packed along dim 0 of ``q`` (``[T, H, d]``): the ``meta.num_decodes`` decode sequences
    first (one query each), then each prefill chunk. Sequence b owns query rows
    ``meta.cu_seqlens_q_host[b] : meta.cu_seqlens_q_host[b + 1]`` and has
    ``meta.seq_lens_k_host[b]`` tokens in the cache (this step's included), reached through
    ``meta.block_tables[b]``. Return ``[T, H, d]``: every query row attended over its own
    sequence only. Hint: ``decode_attention`` takes all decode rows at once; for each prefill
    chunk, ``gather_kv`` its keys and values and call ``causal_attention``.
    """
    # >>> assignment 02.paged_attention (5 points)
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
    # <<< assignment 02.paged_attention


def sliding_window_mask(num_queries: int, num_keys: int, window: int,
                        device: torch.device | None = None) -> torch.Tensor:
    """Which keys each query may see under causal attention with a sliding window.

    Handout (chapter 12 §5, assignment ``12.sliding_window``): the ``num_queries`` queries are
    the *last* ones of the ``num_keys`` positions (as in ``causal_attention``), so query i sits
    at position ``p = num_keys - num_queries + i``. Return a boolean ``[num_queries,
    num_keys]`` tensor on ``device``, True where query i may attend to key j: ``j <= p``
    (causal) and ``p - j < window`` (the window holds ``window`` keys, the query's own
    included, as Mistral and transformers define it).
    Hint: two ``torch.arange`` broadcast against each other give every (i, j) pair.
    """
    # >>> assignment 12.sliding_window (4 points)
    rows = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return (cols <= rows) & (rows - cols < window)
    # <<< assignment 12.sliding_window


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor:
    """``causal_attention`` where each query sees only its last ``window`` keys."""
    mask = sliding_window_mask(q.shape[0], k.shape[0], window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def windowed_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor:
    """``paged_attention`` with a sliding window, one sequence at a time (decodes included).

    Only the keys some query of the step can see are gathered: the last
    ``window + queries - 1`` of each sequence, so the cost is bounded by the window.
    """
    out = torch.empty_like(q)
    cu, lens = meta.cu_seqlens_q_host, meta.seq_lens_k_host
    for b in range(len(lens)):
        start = max(0, lens[b] - (cu[b + 1] - cu[b]) - window + 1)
        k = gather_kv(k_cache, meta.block_tables[b], lens[b])[start:]
        v = gather_kv(v_cache, meta.block_tables[b], lens[b])[start:]
        out[cu[b] : cu[b + 1]] = windowed_attention(q[cu[b] : cu[b + 1]], k, v, scale, window)
    return out


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, window: int | None = None) -> torch.Tensor:
    """The torch backend's entry point: ``paged_attention``, windowed when ``window`` is set."""
    if window is None:
        return paged_attention(q, k_cache, v_cache, meta, scale)
    return windowed_paged_attention(q, k_cache, v_cache, meta, scale, window)

"""Causal prefill attention over the paged KV cache, as one Triton kernel (chapter 02 §5).

The prefill path of the ``triton`` attention backend. The batch packs the new tokens of B
sequences back to back (``cu_seqlens_q``), their keys and values already in the cache after
any cached prefix: query ``i`` of sequence ``b`` sits at position ``seq_lens_k[b] - q_len_b + i``.
One program takes BLOCK_M query rows of one (sequence, head) and walks the keys in tiles of
BLOCK_N with an online softmax in fp32 (base 2, log2(e) folded into the scale): the tiles every
row may see run unmasked, the few that cross the diagonal apply the causal mask, and tiles
above it are never visited. Key positions past a sequence's end are masked before their block
id is read, so the table's ``-1`` padding is never dereferenced. GQA: query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``. An fp8 cache (chapter 08) is widened to q's
dtype after loading (exact); ``k_scale`` joins the softmax scale, ``v_scale`` the output.

A sliding window (chapter 12) is a compile-time switch: the key loop then starts at the first
key the tile's first row may see and every tile applies both masks; a row that has seen no
visible key yet keeps its running max at a safe 0, so no ``-inf - (-inf)`` NaN appears.
"""

from __future__ import annotations

import math

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable
from nanovllm.kernels.launch_config import prefill_tiles

__all__ = ["prefill_attention"]


@triton.jit
def _attend_key_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_base,
    v_base,
    table_row,
    offs_d,
    n_start,
    n_end,
    kv_len,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    window,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WINDOW_MASK: tl.constexpr = False,
):
    """Fold the key tiles [n_start, n_end) into the running (acc, l, m) of one query tile."""
    for start_n in range(n_start, n_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        in_seq = k_pos < kv_len
        row = k_pos % BLOCK_SIZE
        if BLOCK_N <= BLOCK_SIZE:
            # Both powers of two: the tile lies inside one cache block, one id for all of
            # it. start_n < kv_len, so the id is a real block, never the -1 padding.
            block_id = tl.load(table_row + start_n // BLOCK_SIZE).to(tl.int64)
            k_ptrs = k_base + block_id * stride_kb + row[None, :] * stride_kt + offs_d[:, None]
            v_ptrs = v_base + block_id * stride_vb + row[:, None] * stride_vt + offs_d[None, :]
        else:
            # The tile spans several blocks: one id per key, padding keys masked off.
            block_id = tl.load(table_row + k_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
            k_ptrs = (
                k_base + block_id[None, :] * stride_kb + row[None, :] * stride_kt + offs_d[:, None]
            )
            v_ptrs = (
                v_base + block_id[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :]
            )
        k_t = tl.load(k_ptrs, mask=in_seq[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
        v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        if k_t.dtype != q.dtype:  # an fp8 cache: widen (exactly) to q's dtype
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)  # 16-bit inputs, fp32 accumulation (tensor cores)
        s = s * qk_scale  # log2 domain
        if CAUSAL_MASK:
            s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        if WINDOW_MASK:
            s = tl.where(k_pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW_MASK:  # a row may have seen no key yet: keep the max finite
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


# Triton compiles a variant per value class of integer arguments (1, multiple of 16, other)
# and per 16-byte alignment of pointers. Per-step values (tile counts, the block table's width
# ``stride_bt``, slices of the step's metadata) would otherwise trigger a fresh compile,
# seconds each, in the middle of serving.
@triton.jit(
    do_not_specialize=["num_m_tiles", "stride_bt"],
    do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seq_lens_k_ptr", "block_tables_ptr"],
)
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_k_ptr,
    block_tables_ptr,
    qk_scale,
    v_scale,
    num_m_tiles,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Heaviest query tiles (furthest down the diagonal) get the lowest program ids, so
    # they start first and the short ones fill in the tail.
    m_tile = num_m_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(seq_lens_k_ptr + seq)
    prefix_len = kv_len - q_len
    kv_head = head // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    # Rows past the chunk's end are clamped onto the last key: they stay finite, never stored.
    q_pos = tl.minimum(prefix_len + offs_m, kv_len - 1)

    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh

    # Keys [0, n_full) are visible to every row of this tile (the first row sits at
    # prefix_len + m_tile * BLOCK_M): no mask. Keys [n_full, n_end) cross the diagonal.
    first_pos = prefix_len + m_tile * BLOCK_M
    n_full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    n_end = prefix_len + tl.minimum((m_tile + 1) * BLOCK_M, q_len)
    if HAS_WINDOW:  # from the tile holding the first row's first visible key, all masked
        n_first = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row, offs_d, n_first, n_end,
            kv_len, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, window,
            BLOCK_N, BLOCK_SIZE, True, DOT_FP32, True,
        )
    else:
        # the keys every row sees (no mask), then those across the diagonal; window unused
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row, offs_d, 0, n_full,
            kv_len, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, 0,
            BLOCK_N, BLOCK_SIZE, False, DOT_FP32,
        )
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q, q_pos, k_base, v_base, table_row, offs_d, n_full, n_end,
            kv_len, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, 0,
            BLOCK_N, BLOCK_SIZE, True, DOT_FP32,
        )

    out = acc / l_i[:, None] * v_scale
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _is_interpreted() -> bool:
    """True when the kernel was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_prefill_attention_kernel).__name__ == "InterpretedFunction"


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seqlen_q: int, *,
    out: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V.

    q: [total_q, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (same dtype as q, new tokens already stored);
    cu_seqlens_q: int32 [B+1]; seq_lens_k: int32 [B] (prefix + new); block_tables:
    int32 [B, max_blocks], -1 past each sequence's blocks; scale: softmax scale;
    max_seqlen_q: the largest q_len in the batch. Returns [total_q, num_heads, head_dim]
    in q's dtype. ``out`` (optional) receives the result; ``tiles`` = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) overrides the rule of ``launch_config.prefill_tiles`` (for tests, the
    benchmark's sweep and chapter 02's experiments; tile sizes are powers of two >= 16).
    The caches may instead be float8 e4m3 (an fp8 KV cache, chapter 08), holding
    ``K / k_scale`` and ``V / v_scale``. ``window`` (optional, >= 1): each query sees only
    its last ``window`` keys, itself included (sliding-window attention, chapter 12).
    """
    total_q, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, head_dim_k = k_cache.shape
    batch = seq_lens_k.shape[0]
    if v_cache.shape != k_cache.shape or head_dim_k != head_dim:
        raise ValueError(
            f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}"
        )
    if not (k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)):
        raise ValueError(
            f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (_is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if not (_is_pow2(block_size) and block_size >= 16):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.dim() != 2 or len(block_tables) != batch:
        raise ValueError("want cu_seqlens_q [B+1], block_tables [B, blocks], B = len(seq_lens_k)")
    metadata = dict(cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, block_tables=block_tables)
    for name, t in metadata.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous in head_dim")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    check_launchable(q, _prefill_attention_kernel)

    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype and be contiguous in head_dim")
    if total_q == 0 or batch == 0 or max_seqlen_q <= 0:
        return out

    tile_m, tile_n, num_warps, num_stages = tiles or prefill_tiles(head_dim, q.device)
    if not (_is_pow2(tile_m) and _is_pow2(tile_n) and tile_m >= 16 and tile_n >= 16):
        raise ValueError(f"BLOCK_M/BLOCK_N must be powers of two >= 16, got {tile_m}/{tile_n}")
    block_tables = block_tables.contiguous()
    num_m_tiles = triton.cdiv(max_seqlen_q, tile_m)
    grid = (num_m_tiles, num_heads, batch)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens_k, block_tables,
        scale * k_scale * math.log2(math.e), float(v_scale), num_m_tiles, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=tile_m, BLOCK_N=tile_n,
        # fp32 keeps fp32 dots (IEEE, no TF32). The interpreter computes bf16 wrongly, so
        # there bf16 is upcast after loading; on a GPU bf16/fp16 go to the tensor cores.
        DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu"),
        HAS_WINDOW=window is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out

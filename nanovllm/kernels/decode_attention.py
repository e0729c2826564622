"""Paged decode attention in Triton: GQA-aware and split-KV (flash-decoding), chapter 05.

Each sequence brings one query token whose key and value ``store_kv`` already cached; the kernel
reads every cached KV byte once (memory bound). One program per ``(sequence, kv head, split)``
loads the ``group`` query heads of its KV head as one tile (padded to 16 rows, the smallest
``tl.dot``), walks its key range through the block table (``-1`` padding is never loaded) with
an online softmax in base 2, and with ``num_splits > 1`` writes fp32 partials that
``split_kv.py`` merges (chapter 05 §4-§6). ``num_splits=None`` decides from shapes only, so the
call can be captured in a CUDA graph.

Numerics: under the Triton interpreter (CPU) bf16 arithmetic is wrong, so bf16 tiles are upcast
to fp32 before ``tl.dot``; on a GPU fp16/bf16 tiles go to the tensor cores as they are (``q``
and the softmax weights rounded to the cache dtype, fp32 accumulation, as in flash-attention);
fp32 caches use exact fp32 dots. An fp8 cache (chapter 08) holds ``K / k_scale`` and
``V / v_scale``: each tile is widened to ``q``'s dtype after loading (exact), ``k_scale`` joins
the softmax scale and ``v_scale`` multiplies the output; Triton converts e4m3 only on compute
capability >= 8.9. A sliding window (chapter 12) is a compile-time switch that starts each key
range at ``seq_len - window``, so keys outside it are never read.
"""

from __future__ import annotations

import torch
import triton  # nanovllm/kernels/__init__.py explains a missing triton
import triton.language as tl

from nanovllm.kernels import check_launchable
from nanovllm.kernels.launch_config import decode_tiles
from nanovllm.kernels.split_kv import choose_num_splits, combine_splits, num_sms, split_partials

__all__ = ["decode_attention"]

LOG2E = 1.4426950408889634

# Per-step values (split counts, the block table's width, slices of the step's metadata) are
# not specialized on, so a new batch shape never triggers a compile mid-serving (see
# prefill_attention.py).
@triton.jit(
    do_not_specialize=["num_splits", "stride_bt"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "block_tables_ptr"],
)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    qk_scale,
    v_scale,
    num_splits,
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    FP8_KV: tl.constexpr,  # the cache is float8 e4m3: widen its tiles to q's dtype
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Paged decode attention of one (sequence, KV head, split): its queries over its keys.

    Handout (chapter 05 §4-§7, assignment ``05.decode_kernel``): the loop that walks this
    program's keys through the block table and folds them into an online softmax. The code
    before it is given and leaves ``q``, the ``[GROUP_PAD, D_PAD]`` tile of the ``GROUP`` query
    heads that share KV head ``kv_head`` (rows ``>= GROUP`` and columns ``>= HEAD_DIM`` are
    zero), already in the dtype the dots use, and the key range ``[start, end)`` of this split
    (empty when ``start >= end``; ``start`` is not always a multiple of ``BLOCK_N`` or
    ``PAGE``: a sliding window starts it at ``seq_len - window``). The code after it reads
    three fp32 tensors that you leave, over the keys ``t`` of the range, with base-2 scores
    ``s_t = (q . k_t) * qk_scale`` (``qk_scale`` holds the softmax scale times ``log2(e)``):

    - ``m_i`` ``[GROUP_PAD]``: ``max_t s_t``, or ``-inf`` for an empty range;
    - ``l_i`` ``[GROUP_PAD]``: ``sum_t 2^(s_t - m_i)``, 0 for an empty range;
    - ``acc`` ``[GROUP_PAD, D_PAD]``: ``sum_t 2^(s_t - m_i) v_t``, zeros for an empty range.

    Key ``t`` of sequence ``b`` lives in cache block ``blk = block_tables_ptr[b * stride_bt +
    t // PAGE]``, row ``t % PAGE``; for this KV head its element ``d`` (``d < HEAD_DIM``) is at
    ``k_cache_ptr + blk * stride_kb + row * stride_kt + kv_head * stride_kh + d`` (V: the same
    with the ``stride_v*``). Contract: read no block-table entry and no cache row outside
    ``[start, end)`` (table padding is ``-1``; other rows hold anything, NaN included); read
    each key's K and V once for the whole group, in tiles of ``BLOCK_N`` keys (``tl.dot`` on
    ``[GROUP_PAD, D_PAD] x [D_PAD, BLOCK_N]``); compute addresses in int64 (block id times
    stride overflows int32 on a large cache). Dtypes: the tiles load in the cache's dtype;
    with ``FP8_KV`` widen them to ``q_ptr``'s element type right after loading; with
    ``DOT_FP32`` cast them to fp32; every ``tl.dot`` takes ``input_precision=PRECISION``; the
    softmax weights go into the second dot in V's dtype (fp32 accumulation, as in
    flash-attention). Hints: the chapter's "Assignments" section.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    # This split's key range [start, end): a whole number of BLOCK_N tiles, cut per sequence.
    seq_len = tl.load(seq_lens_ptr + b)
    if HAS_WINDOW:  # only the last `window` keys: the range [seq_len - window, seq_len)
        first = tl.maximum(seq_len - window, 0)
        split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * split_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # The query heads of this KV head's group, as one [GROUP_PAD, D_PAD] tile.
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    elif not FP8_KV:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # >>> assignment 05.decode_kernel (12 points)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        t = tile_start + n
        t_mask = t < end
        # Gather: which block holds each token of the tile (padding entries are never read).
        block = tl.load(block_tables_ptr + b * stride_bt + t // PAGE, mask=t_mask, other=0)
        block = block.to(tl.int64)
        row = t % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block[:, None] * stride_kb
            + row[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + row[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if FP8_KV:  # one byte per element loaded; widened (exactly) in registers
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Online softmax in base 2 over this tile's [GROUP_PAD, BLOCK_N] scores.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # <<< assignment 05.decode_kernel

    # An fp8 cache's V holds V / v_scale. v_scale is one constant for every key, so it factors
    # out of sum_t p_t * v_t: one multiply per output element here instead of one per loaded V
    # element in the loop. Applied to the unnormalized acc, it also carries through the split
    # partials, since merging them is linear in acc. (k_scale is folded into qk_scale by the
    # launcher the same way: q . (k_scale * k) = k_scale * (q . k).)
    acc = acc * v_scale
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 (padding rows) gives zeros, not NaN
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials, fp32: m/l [B, H, num_splits], acc [B, H, num_splits, D_PAD], contiguous.
        part = (b * num_heads + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=g_mask)
        tl.store(l_ptr + part, l_i, mask=g_mask)
        tl.store(acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=out_mask)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, num_splits: int | None = None, *,
    k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to its whole paged KV history.

    ``q``: ``[B, num_heads, head_dim]``; ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``seq_lens``: int32 ``[B]``, keys per
    sequence including the new token; ``block_tables``: int32 ``[B, max_blocks]``, padded with
    ``-1``; ``scale``: softmax scale, usually ``head_dim ** -0.5``. ``num_splits``: chunks per
    sequence (split-KV); ``None`` chooses with :func:`choose_num_splits`.
    The caches may instead be float8 e4m3 (an fp8 KV cache, chapter 08) holding
    ``K / k_scale`` and ``V / v_scale``; the scales are per-layer scalars.
    ``window`` (optional, >= 1): attend to the last ``window`` keys only (sliding window).
    ``launch`` = (BLOCK_N, num_warps, num_stages) overrides the fixed rule of
    ``launch_config.decode_tiles`` (for the tile sweep, ``tests/gpu/decode_launch_sweep.py``).
    Returns ``[B, num_heads, head_dim]`` in ``q``'s dtype. Rows with ``seq_len == 0`` get zeros.
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    if k_cache.dtype.itemsize == 1 and not fp8_kv:
        raise ValueError(f"an 8-bit cache must be float8_e4m3fn (fp8 KV), got {k_cache.dtype}")
    if fp8_kv and q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be fp32, fp16 or bf16 over an fp8 cache, got {q.dtype}")
    if cache_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {cache_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page < 16 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {page}")
    if seq_lens.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("seq_lens must be [B] and block_tables [B, max_blocks]")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    check_launchable(q, _decode_split_kernel)

    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    on_gpu = q.device.type == "cuda"
    if num_splits is None:
        max_len = block_tables.shape[1] * page  # a bound known without a device sync
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    group = num_heads // num_kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    block_n, num_warps, num_stages = launch or decode_tiles(head_dim, on_gpu)
    if block_n < 16 or triton.next_power_of_2(block_n) != block_n:
        raise ValueError(f"BLOCK_N must be a power of two >= 16, got {block_n}")
    single = num_splits == 1
    # One split normalizes and writes the output itself: no partials (the kernel ignores them).
    m_part, l_part, acc_part = (out,) * 3 if single else split_partials(out, num_splits, d_pad)
    # fp32 caches need exact fp32 dots; the interpreter cannot multiply bf16 (see docstring).
    # An fp8 cache computes in q's dtype.
    dot_dtype = q.dtype if fp8_kv else k_cache.dtype
    dot_fp32 = dot_dtype == torch.float32 or (dot_dtype == torch.bfloat16 and not on_gpu)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, out, m_part, l_part, acc_part,
        scale * k_scale * LOG2E,  # k_scale folded in: see the kernel's last comment
        float(v_scale), num_splits, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, PAGE=page, BLOCK_N=block_n, SINGLE_SPLIT=single, FP8_KV=fp8_kv,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else "tf32",  # fp32: exact products; half inputs ignore it
        HAS_WINDOW=window is not None, num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        combine_splits(m_part, l_part, acc_part, out)
    return out

"""The PyTorch attention backend (nanovllm/layers/torch_attention.py, chapters 02 and 03)
against a float64 reference written independently: one query, one key at a time, with
explicit softmax sums, on fresh random inputs and caches whose blocks are shuffled.

Tolerance: fp32 inputs, 1e-5 absolute and relative (the reference is float64; these shapes
sum at most a few hundred products per score).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm.context import AttentionMetadata
from nanovllm.layers.torch_attention import (
    causal_attention,
    decode_attention,
    paged_attention,
    store_kv,
)

TOL = dict(atol=1e-5, rtol=1e-5)


def reference(q, k, v, scale, first_visible):
    """float64 attention of q [Lq, H, d] over k, v [Lk, Hkv, d]; query i sees keys
    0 .. first_visible + i (so first_visible = Lk - Lq for a causal chunk)."""
    lq, num_heads, dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(lq, num_heads, dim, dtype=torch.float64)
    for i in range(lq):
        for h in range(num_heads):
            keys = range(first_visible + i + 1)
            scores = [scale * float(q[i, h].double() @ k[j, h // group].double()) for j in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = math.fsum(weights)
            for j, w in zip(keys, weights):
                out[i, h] += (w / total) * v[j, h // group].double()
    return out


def paged_cache(lengths, block_size, num_kv_heads, dim, gen, spare=3):
    """Random caches and block tables scattering each sequence over shuffled blocks."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), tables


def contiguous(cache, table, length):
    """Sequence tokens 0..length-1 read slot by slot (not through gather_kv)."""
    block_size = cache.shape[1]
    return torch.stack([cache[table[t // block_size], t % block_size] for t in range(length)])


@pytest.mark.assignment("02.causal_attention")
@pytest.mark.parametrize(
    "lq, lk, heads, kv_heads",
    [(7, 7, 4, 2), (1, 9, 3, 3), (5, 12, 6, 2), (1, 1, 2, 1), (16, 16, 9, 3)],
    ids=["prompt-gqa", "decode", "chunk-after-prefix", "single-token", "smollm2-heads"],
)
def test_causal_attention_matches_float64(lq, lk, heads, kv_heads):
    gen = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(lq, heads, 16, generator=gen)
    k = torch.randn(lk, kv_heads, 16, generator=gen)
    v = torch.randn(lk, kv_heads, 16, generator=gen)
    out = causal_attention(q, k, v, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3, lk - lq), **TOL)


@pytest.mark.assignment("02.causal_attention")
def test_causal_attention_keeps_the_input_dtype():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, 4, 32, generator=gen).bfloat16() for _ in range(3))
    out = causal_attention(q, k[:, :2], v[:, :2], 32**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = reference(q, k[:, :2], v[:, :2], 32**-0.5, 0)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.assignment("03.store_kv")
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_each_slot_and_skips_padding(slot_dtype):
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)
    slots = torch.tensor([13, -1, 0, 7, -1, 19], dtype=slot_dtype)
    key, value = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    assert store_kv(key, value, k_cache, v_cache, slots) is None
    written = set()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        assert torch.equal(k_cache[slot // 4, slot % 4], key[i]), f"key of token {i}"
        assert torch.equal(v_cache[slot // 4, slot % 4], value[i]), f"value of token {i}"
    for slot in set(range(20)) - written:  # -1 must not write the last row (slot 19 is used)
        assert not k_cache[slot // 4, slot % 4].any() and not v_cache[slot // 4, slot % 4].any()


@pytest.mark.assignment("03.decode_attention")
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_matches_float64(block_size):
    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 23, 8, 40]
    k_cache, v_cache, tables = paged_cache(lengths, block_size, 2, 16, gen)
    q = torch.randn(len(lengths), 6, 16, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.25)
    assert out.shape == q.shape
    for b, n in enumerate(lengths):
        k, v = contiguous(k_cache, tables[b], n), contiguous(v_cache, tables[b], n)
        expected = reference(q[b : b + 1], k, v, 0.25, n - 1)[0]
        torch.testing.assert_close(out[b].double(), expected, **TOL, msg=f"sequence {b}")


@pytest.mark.parametrize(
    "num_decodes, new_tokens, lengths",
    [
        pytest.param(2, [1, 1, 6, 4], [12, 5, 6, 13], id="mixed", marks=pytest.mark.assignment(
            "02.paged_attention", "02.causal_attention", "03.decode_attention")),
        pytest.param(0, [3, 7, 2], [3, 7, 9], id="prefills-only", marks=pytest.mark.assignment(
            "02.paged_attention", "02.causal_attention")),
        pytest.param(3, [1, 1, 1], [4, 30, 9], id="decodes-only", marks=pytest.mark.assignment(
            "02.paged_attention", "03.decode_attention")),
    ],
)
def test_paged_attention_over_a_packed_batch(num_decodes, new_tokens, lengths):
    """Decodes first, then whole prompts and chunks after a cached prefix, packed."""
    gen = torch.Generator().manual_seed(sum(lengths))
    k_cache, v_cache, tables = paged_cache(lengths, 4, 3, 8, gen)
    cu = [0]
    for n in new_tokens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 9, 8, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens_k=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=max(new_tokens),
        max_seqlen_k=max(lengths),
        num_decodes=num_decodes,
        cu_seqlens_q_host=cu,
        seq_lens_k_host=lengths,
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.4)
    assert out.shape == q.shape
    for b, (n, length) in enumerate(zip(new_tokens, lengths)):
        k, v = contiguous(k_cache, tables[b], length), contiguous(v_cache, tables[b], length)
        expected = reference(q[cu[b] : cu[b + 1]], k, v, 0.4, length - n)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, **TOL,
                                   msg=f"sequence {b}")

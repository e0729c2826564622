"""The PyTorch attention backend (nanovllm/layers/torch_attention.py, chapters 02 and 03)
against a float64 reference written independently: one query, one key at a time, with
explicit softmax sums, on fresh random inputs and caches whose blocks are shuffled.

Each function is also tested alone for its own assignment: ``store_kv`` against caches
written slot by slot in the test, ``decode_attention`` with huge values past each sequence's
end, and ``paged_attention`` with stand-ins, written here, for the ``causal_attention`` and
``decode_attention`` it dispatches to (they hold assignments of their own).

Tolerance: fp32 inputs, 1e-5 absolute and relative (the reference is float64; these shapes
sum at most a few hundred products per score); bf16, 2e-2.
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
    q, k_cache, v_cache, meta = packed_batch(num_decodes, new_tokens, lengths, gen)
    tables, cu = meta.block_tables, meta.cu_seqlens_q_host
    out = paged_attention(q, k_cache, v_cache, meta, 0.4)
    assert out.shape == q.shape
    for b, (n, length) in enumerate(zip(new_tokens, lengths)):
        k, v = contiguous(k_cache, tables[b], length), contiguous(v_cache, tables[b], length)
        expected = reference(q[cu[b] : cu[b + 1]], k, v, 0.4, length - n)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, **TOL,
                                   msg=f"sequence {b}")


# -- store_kv alone (03.store_kv) ---------------------------------------------------------------
def expected_cache(cache, rows, slots):
    """``cache`` with row i of ``rows`` written at slot ``slots[i]`` (skipping -1), slot by slot."""
    out = cache.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            out[slot // cache.shape[1], slot % cache.shape[1]] = rows[i]
    return out


@pytest.mark.assignment("03.store_kv")
def test_store_kv_without_padding_writes_in_place_and_leaves_the_rest():
    """Every slot valid (no -1), block size 3, caches already full of other tokens: exactly
    the given slots change, keys into k_cache and values into v_cache, in the same tensors."""
    gen = torch.Generator().manual_seed(12)
    k_cache = torch.randn(4, 3, 2, 5, generator=gen)
    v_cache = torch.randn(4, 3, 2, 5, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k_ptr, v_ptr = k_cache.data_ptr(), v_cache.data_ptr()
    slots = [11, 3, 4, 0, 8]  # out of order, across blocks, the last row of the last block
    key, value = torch.randn(5, 2, 5, generator=gen), torch.randn(5, 2, 5, generator=gen)
    store_kv(key, value, k_cache, v_cache, torch.tensor(slots))
    assert k_cache.data_ptr() == k_ptr and v_cache.data_ptr() == v_ptr
    assert torch.equal(k_cache, expected_cache(k_before, key, slots))
    assert torch.equal(v_cache, expected_cache(v_before, value, slots))


@pytest.mark.assignment("03.store_kv")
def test_store_kv_of_padding_only_writes_nothing():
    gen = torch.Generator().manual_seed(13)
    k_cache = torch.randn(3, 4, 1, 4, generator=gen)
    v_cache = torch.randn(3, 4, 1, 4, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 1, 4, generator=gen), torch.randn(3, 1, 4, generator=gen)
    store_kv(key, value, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.assignment("03.store_kv")
def test_store_kv_step_after_step_in_bf16():
    """A prefill then two decode steps (a padded row in each, as a CUDA graph pads): the cache
    ends up holding every token where its slot says, in bf16, bit for bit."""
    gen = torch.Generator().manual_seed(14)
    k_cache = torch.zeros(6, 4, 3, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros(6, 4, 3, 8, dtype=torch.bfloat16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    steps = [[19, 20, 21, 22, 8, 9, 10], [11, 12, -1], [-1, 13, 0]]  # 23 stays unwritten
    for slots in steps:
        key = torch.randn(len(slots), 3, 8, generator=gen).bfloat16()
        value = torch.randn(len(slots), 3, 8, generator=gen).bfloat16()
        store_kv(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32))
        k_expected = expected_cache(k_expected, key, slots)
        v_expected = expected_cache(v_expected, value, slots)
    assert k_cache.dtype == torch.bfloat16
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert not k_cache[5, 3].any(), "slot -1 wrote the last row"


# -- decode_attention alone (03.decode_attention) ------------------------------------------------
def decode_reference(q, k_cache, v_cache, tables, lengths, scale):
    return torch.stack([
        reference(q[b : b + 1], contiguous(k_cache, tables[b], n),
                  contiguous(v_cache, tables[b], n), scale, n - 1)[0]
        for b, n in enumerate(lengths)
    ])


@pytest.mark.assignment("03.decode_attention")
def test_decode_attention_ignores_rows_past_each_end():
    """Rows after each sequence's last token (in its last block, and whole blocks past it)
    hold huge finite keys and values: attending to even one of them would swamp the result.
    Lengths at block boundaries (4, 8) and inside a block (1, 5, 11)."""
    gen = torch.Generator().manual_seed(21)
    lengths, block_size = [4, 1, 8, 5, 11], 4
    k_cache, v_cache, tables = paged_cache(lengths, block_size, 2, 8, gen)
    for b, n in enumerate(lengths):
        for t in range(n, (-(-n // block_size)) * block_size):
            k_cache[tables[b, t // block_size], t % block_size] = 50.0
            v_cache[tables[b, t // block_size], t % block_size] = 1e4
    used = {int(x) for x in tables.flatten() if x >= 0}
    for block in set(range(k_cache.shape[0])) - used:  # spare blocks (tables reach -1 there)
        k_cache[block], v_cache[block] = 50.0, 1e4
    q = torch.randn(len(lengths), 4, 8, generator=gen)
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                           tables, 0.35)
    expected = decode_reference(q, k_cache, v_cache, tables, lengths, 0.35)
    torch.testing.assert_close(out.double(), expected, **TOL)


@pytest.mark.assignment("03.decode_attention")
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 1)], ids=["mha", "mqa"])
def test_decode_attention_head_layouts(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lengths = [7, 3, 13]
    k_cache, v_cache, tables = paged_cache(lengths, 4, kv_heads, 16, gen)
    q = torch.randn(len(lengths), heads, 16, generator=gen)
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths), tables, 0.25)
    assert out.shape == (len(lengths), heads, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(),
                               decode_reference(q, k_cache, v_cache, tables, lengths, 0.25), **TOL)


@pytest.mark.assignment("03.decode_attention")
def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch():
    """A short sequence alone, and batched after a long one (more padding): the same output."""
    gen = torch.Generator().manual_seed(23)
    lengths = [37, 6]
    k_cache, v_cache, tables = paged_cache(lengths, 8, 2, 16, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    both = decode_attention(q, k_cache, v_cache, torch.tensor(lengths), tables, 0.25)
    alone = decode_attention(q[1:], k_cache, v_cache, torch.tensor(lengths[1:]),
                             tables[1:, :1], 0.25)  # its table cut to the one block it uses
    torch.testing.assert_close(both[1:], alone, atol=1e-6, rtol=1e-6)


@pytest.mark.assignment("03.decode_attention")
def test_decode_attention_keeps_bf16():
    gen = torch.Generator().manual_seed(24)
    lengths = [9, 2, 16]
    k_cache, v_cache, tables = paged_cache(lengths, 4, 2, 32, gen)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(3, 6, 32, generator=gen).bfloat16()
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32),
                           tables, 32**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = decode_reference(q, k_cache, v_cache, tables, lengths, 32**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# -- paged_attention alone (02.paged_attention) --------------------------------------------------
# paged_attention dispatches to causal_attention and decode_attention, which hold regions of
# their own (02.causal_attention, 03.decode_attention): its own tests replace both by stand-ins
# written here (float64 loops over each call's contract), which also record what they were
# given. Whether an implementation sends the decodes through decode_attention or through
# causal_attention one by one, each sequence's query rows must be attended exactly once, over
# its own keys, and land back at their rows of the packed output.
class StandIns:
    def __init__(self, q, k_cache, v_cache, tables, cu, lengths):
        self.q, self.k_cache, self.v_cache, self.tables = q, k_cache, v_cache, tables
        self.cu, self.lengths = cu, lengths
        self.attended: list[int] = []  # the sequence each call (or decode row) served

    def keys(self, b):
        n, table = self.lengths[b], self.tables[b]
        return contiguous(self.k_cache, table, n), contiguous(self.v_cache, table, n)

    def causal_attention(self, q, k, v, scale):
        assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape
        assert q.shape[0] <= k.shape[0] and q.shape[1] % k.shape[1] == 0
        [b] = [b for b in range(len(self.lengths))
               if torch.equal(q, self.q[self.cu[b] : self.cu[b + 1]])]
        own_k, own_v = self.keys(b)
        assert torch.equal(k, own_k) and torch.equal(v, own_v), f"sequence {b}'s keys"
        self.attended.append(b)
        return reference(q, k, v, scale, k.shape[0] - q.shape[0]).to(q.dtype)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, block_tables, scale):
        assert k_cache is self.k_cache and v_cache is self.v_cache
        assert q.dim() == 3 and q.shape[0] == seq_lens.shape[0] == block_tables.shape[0] > 0
        out = []
        for row, n in enumerate(seq_lens.tolist()):
            [b] = [b for b in range(len(self.lengths)) if self.cu[b + 1] - self.cu[b] == 1
                   and torch.equal(q[row], self.q[self.cu[b]])]
            assert n == self.lengths[b], f"sequence {b}'s length"
            assert torch.equal(block_tables[row, : -(-n // k_cache.shape[1])],
                               self.tables[b, : -(-n // k_cache.shape[1])])
            self.attended.append(b)
            k, v = self.keys(b)
            out.append(reference(q[row : row + 1], k, v, scale, n - 1)[0])
        return torch.stack(out).to(q.dtype)


def packed_batch(num_decodes, new_tokens, lengths, gen, dtype=torch.float32, heads=9, kv_heads=3):
    k_cache, v_cache, tables = paged_cache(lengths, 4, kv_heads, 8, gen)
    cu = [0]
    for n in new_tokens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, 8, generator=gen)
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
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


def patched(monkeypatch, q, k_cache, v_cache, meta):
    import nanovllm.layers.torch_attention as backend

    stand_ins = StandIns(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q_host,
                         meta.seq_lens_k_host)
    monkeypatch.setattr(backend, "causal_attention", stand_ins.causal_attention)
    monkeypatch.setattr(backend, "decode_attention", stand_ins.decode_attention)
    return stand_ins


@pytest.mark.assignment("02.paged_attention")
@pytest.mark.parametrize(
    "num_decodes, new_tokens, lengths",
    [(2, [1, 1, 6, 4], [12, 5, 6, 13]), (0, [3, 7, 2], [3, 7, 9]), (3, [1, 1, 1], [4, 30, 9]),
     (0, [5], [17]), (1, [1, 2], [1, 2])],
    ids=["mixed", "prefills-only", "decodes-only", "one-chunk-after-prefix", "tiny"],
)
def test_paged_attention_alone_attends_each_sequence_once(monkeypatch, num_decodes, new_tokens,
                                                          lengths):
    """Every sequence's rows, over its own cached keys, back at their packed rows."""
    gen = torch.Generator().manual_seed(sum(lengths) + num_decodes)
    q, k_cache, v_cache, meta = packed_batch(num_decodes, new_tokens, lengths, gen)
    stand_ins = patched(monkeypatch, q, k_cache, v_cache, meta)
    out = paged_attention(q, k_cache, v_cache, meta, 0.4)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert sorted(stand_ins.attended) == list(range(len(lengths))), stand_ins.attended
    cu = meta.cu_seqlens_q_host
    for b, (n, length) in enumerate(zip(new_tokens, lengths)):
        table = meta.block_tables[b]
        k, v = contiguous(k_cache, table, length), contiguous(v_cache, table, length)
        expected = reference(q[cu[b] : cu[b + 1]], k, v, 0.4, length - n)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, **TOL,
                                   msg=f"sequence {b}")


@pytest.mark.assignment("02.paged_attention")
def test_paged_attention_alone_keeps_bf16(monkeypatch):
    gen = torch.Generator().manual_seed(31)
    q, k_cache, v_cache, meta = packed_batch(2, [1, 1, 5, 3], [6, 9, 5, 11], gen,
                                             dtype=torch.bfloat16, heads=4, kv_heads=2)
    stand_ins = patched(monkeypatch, q, k_cache, v_cache, meta)
    out = paged_attention(q, k_cache, v_cache, meta, 0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert sorted(stand_ins.attended) == [0, 1, 2, 3]
    cu = meta.cu_seqlens_q_host
    for b, (n, length) in enumerate(zip([1, 1, 5, 3], [6, 9, 5, 11])):
        table = meta.block_tables[b]
        k, v = contiguous(k_cache, table, length), contiguous(v_cache, table, length)
        expected = reference(q[cu[b] : cu[b + 1]], k, v, 0.5, length - n)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.assignment("02.paged_attention")
def test_paged_attention_alone_reads_the_cache_through_the_block_tables(monkeypatch):
    """Two sequences of identical tokens but different blocks: changing one's blocks changes
    its own rows only (no sequence reads another's table)."""
    gen = torch.Generator().manual_seed(32)
    q, k_cache, v_cache, meta = packed_batch(1, [1, 4, 4], [7, 4, 9], gen, heads=2, kv_heads=2)
    patched(monkeypatch, q, k_cache, v_cache, meta)
    first = paged_attention(q, k_cache, v_cache, meta, 0.3)
    for block in meta.block_tables[2]:
        if block >= 0:  # rewrite sequence 2's blocks only
            k_cache[block].normal_(generator=gen)
            v_cache[block].normal_(generator=gen)
    second = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.equal(first[:5], second[:5])
    assert not torch.allclose(first[5:], second[5:])

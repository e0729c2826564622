"""Tests of the Triton decode path: ``store_kv`` and paged ``decode_attention`` (chapter 05).

Without CUDA the kernels run under the Triton interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``), so the CPU cases are kept small. The reference is float64 PyTorch:
gather each sequence's keys and values through its block table, softmax, weighted sum.
"""

import math

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _require_interpreter() -> None:
    """Without CUDA, Triton must have been imported with TRITON_INTERPRET=1 already set.

    Triton decides compile-or-interpret when a ``@triton.jit`` function is decorated, and its
    own library (``tl.cdiv``, ``tl.max``, ...) is decorated when ``triton`` is first imported.
    ``conftest.py`` beside this file sets the variable before this folder's modules import
    triton; if a test elsewhere imported triton earlier in the same run, no reload can repair
    it, so say so instead of failing with an obscure interpreter error.
    """
    import triton.language as tl

    if not CUDA and type(tl.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
            "on CPU. Set the variable in tests/conftest.py (before anything imports triton) or "
            "run tests/kernels in its own pytest process."
        )


_require_interpreter()
from nanovllm.kernels.decode_attention import decode_attention  # noqa: E402
from nanovllm.kernels.split_kv import choose_num_splits  # noqa: E402
from nanovllm.kernels.store_kv import store_kv  # noqa: E402

# ----------------------------------------------------------------------------- helpers


def make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3,
                  extra_columns=2, device=DEVICE):
    """Random caches plus block tables that scatter each sequence over shuffled block ids.

    The pool holds ``spare_blocks`` blocks nobody uses; every table row is padded with -1 up to
    the longest sequence's block count plus ``extra_columns``.
    """
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(need) + extra_columns), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), lens.to(device), tables.to(device)


def reference_decode(q, k_cache, v_cache, seq_lens, block_tables, scale):
    """float64 paged decode attention, one sequence at a time."""
    batch, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b].cpu().long()[t // block_size]
        k = k_cache.cpu()[blocks, t % block_size].double()  # [L, Hkv, D]
        v = v_cache.cpu()[blocks, t % block_size].double()
        k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


def rel_err(out, ref):
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def nan_poisoned_empty(monkeypatch):
    """Make every float ``torch.empty``/``empty_like`` come back full of NaN.

    The kernels' outputs and split partials start as ``torch.empty``; poisoned, any element a
    kernel forgets to write shows up as NaN in the result.
    """
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (num_heads, num_kv_heads, head_dim, block_size, seq_lens): GQA groups 1, 2, 3, 4, 8.
SHAPES = {
    "group3-smollm2": (9, 3, 64, 16, [1, 15, 16, 17, 100, 300]),
    "group1-mha": (4, 4, 32, 16, [1, 17, 64, 100]),
    "group4-block32": (8, 2, 64, 32, [33, 5, 96]),
    "group8": (8, 1, 32, 16, [300, 1, 47]),
    "group2-qwen3-block256": (16, 8, 128, 256, [1, 257, 100]),
    "group2-dim80": (4, 2, 80, 16, [40, 3]),  # head_dim not a power of two
}


# ----------------------------------------------------------------------------- decode


@pytest.mark.assignment("05.decode_kernel", "05.combine_splits")
@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_matches_reference_fp32_all_splits(name, nan_poisoned_empty):
    num_heads, num_kv_heads, head_dim, block_size, lens = SHAPES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    k_cache, v_cache, seq_lens, tables = make_paged_kv(
        lens, block_size, num_kv_heads, head_dim, torch.float32, gen
    )
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(DEVICE)
    scale = head_dim**-0.5
    ref = reference_decode(q, k_cache, v_cache, seq_lens, tables, scale)

    outs = {}
    for num_splits in (1, 2, 4, None):
        out = decode_attention(q, k_cache, v_cache, seq_lens, tables, scale, num_splits)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.isfinite(out).all(), f"unwritten (NaN) outputs with num_splits={num_splits}"
        assert rel_err(out, ref) < TOLERANCE[torch.float32], (num_splits, rel_err(out, ref))
        outs[num_splits] = out
    for num_splits, out in outs.items():  # splitting changes only the rounding
        torch.testing.assert_close(out, outs[1], rtol=1e-5, atol=1e-6, msg=str(num_splits))


@pytest.mark.assignment("05.decode_kernel", "05.combine_splits")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["group3-smollm2", "group2-qwen3-block256"])
def test_decode_half_precision(name, dtype, nan_poisoned_empty):
    num_heads, num_kv_heads, head_dim, block_size, lens = SHAPES[name]
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, seq_lens, tables = make_paged_kv(
        lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    ref = reference_decode(q, k_cache, v_cache, seq_lens, tables, scale)  # from the same bits
    for num_splits in (1, 3):
        out = decode_attention(q, k_cache, v_cache, seq_lens, tables, scale, num_splits)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out, ref) < TOLERANCE[dtype], (num_splits, rel_err(out, ref))


@pytest.mark.assignment("05.decode_kernel", "05.combine_splits")
def test_decode_zero_length_rows_give_zeros():
    """A CUDA-graph batch padded with seq_len 0 rows must not produce NaN."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, seq_lens, tables = make_paged_kv([20, 1], 16, 2, 32, torch.float32, gen)
    seq_lens[1] = 0
    tables[1] = -1
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    for num_splits in (1, 2):
        out = decode_attention(q, k_cache, v_cache, seq_lens, tables, 32**-0.5, num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = reference_decode(q[:1], k_cache, v_cache, seq_lens[:1], tables[:1], 32**-0.5)
        assert rel_err(out[:1], ref) < 1e-5


def test_decode_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, seq_lens, tables = make_paged_kv([5], 16, 3, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.randn(1, 4, 32).to(DEVICE), k_cache, v_cache, seq_lens, tables, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.randn(1, 3, 16).to(DEVICE), k_cache, v_cache, seq_lens, tables, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        small = k_cache[:, :8]
        decode_attention(torch.randn(1, 3, 32).to(DEVICE), small, small, seq_lens, tables, 1.0)


def test_decode_launch_override_changes_only_the_rounding():
    """``launch`` (the tile sweep's knob) changes tiles, not results; bad tiles are refused."""
    num_heads, num_kv_heads, head_dim, block_size, lens = SHAPES["group3-smollm2"]
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, seq_lens, tables = make_paged_kv(
        lens, block_size, num_kv_heads, head_dim, torch.float32, gen
    )
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(DEVICE)
    ref = reference_decode(q, k_cache, v_cache, seq_lens, tables, head_dim**-0.5)
    for launch in [(16, 4, 1), (64, 2, 1)]:
        out = decode_attention(q, k_cache, v_cache, seq_lens, tables, head_dim**-0.5, 2,
                               launch=launch)
        assert rel_err(out, ref) < TOLERANCE[torch.float32], launch
    with pytest.raises(ValueError, match="BLOCK_N"):
        decode_attention(q, k_cache, v_cache, seq_lens, tables, 1.0, launch=(48, 4, 1))


def test_choose_num_splits_rule():
    # Enough sequences x KV heads for 2 programs per SM: no split.
    assert choose_num_splits(batch=64, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1
    assert choose_num_splits(batch=33, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1
    # Fewer: aim for ~4 programs per SM (ceil(528 / 128) = 5).
    assert choose_num_splits(batch=16, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 5
    # One sequence: capped at MAX_SPLITS = 32, or at 64 keys per split for short ones.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 32
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 16
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_store_kv_writes_slots_and_skips_padding(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, num_kv_heads, head_dim, n = 6, 16, 3, 64, 10
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    # key/value as slices of one fused projection: rows are strided, not contiguous
    fused = torch.randn(n, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(n, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(
        n, num_kv_heads, head_dim
    )
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 5, 9]] = -1  # padding rows: skipped
    k_cache, v_cache, key, value = (t.to(DEVICE) for t in (k_cache, v_cache, key, value))
    slot_mapping = slots.to(slot_dtype).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    store_kv(key, value, k_cache, v_cache, slot_mapping)

    k_expect, v_expect = k_before.flatten(0, 1), v_before.flatten(0, 1)  # [slots, Hkv, D]
    keep = slots >= 0
    k_expect[slots[keep]] = key[keep.to(DEVICE)].cpu().to(k_expect.device)
    v_expect[slots[keep]] = value[keep.to(DEVICE)].cpu().to(v_expect.device)
    assert torch.equal(k_cache.flatten(0, 1), k_expect)  # written exactly, the rest untouched
    assert torch.equal(v_cache.flatten(0, 1), v_expect)


def test_store_kv_casts_to_cache_dtype():
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(4, 2, 32, generator=gen).to(DEVICE)
    value = torch.randn(4, 2, 32, generator=gen).to(DEVICE)
    k_cache = torch.zeros(2, 16, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    store_kv(key, value, k_cache, v_cache, torch.tensor([0, 17, 31, 3], device=DEVICE))
    rows = torch.tensor([0, 17, 31, 3])
    # A GPU rounds fp32 -> bf16 to nearest like torch; the interpreter truncates (one ulp off).
    ulp = 0.0 if CUDA else 2.0**-7
    for cache, src in ((k_cache, key), (v_cache, value)):
        torch.testing.assert_close(cache.flatten(0, 1)[rows].float().cpu(),
                                   src.bfloat16().float().cpu(), rtol=ulp, atol=0.0)


@pytest.mark.assignment("05.decode_kernel", "05.combine_splits")
def test_store_then_decode_end_to_end():
    """Prefill 37 tokens' K/V through store_kv into scattered blocks, then decode token 38."""
    gen = torch.Generator().manual_seed(21)
    block_size, num_kv_heads, num_heads, head_dim, length = 16, 2, 6, 32, 38
    table = torch.tensor([[4, 0, 2, -1]], dtype=torch.int32)
    t = torch.arange(length)
    slots = table[0, t // block_size].long() * block_size + t % block_size
    key = torch.randn(length, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(length, num_kv_heads, head_dim, generator=gen)
    k_cache = torch.full((5, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))  # never-written rows must not be read
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    q = torch.randn(1, num_heads, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, seq_lens, table.to(DEVICE), head_dim**-0.5, 2)

    group = num_heads // num_kv_heads
    scores = torch.einsum("hd,thd->ht", q[0].cpu().double(),
                          key.double().repeat_interleave(group, 1)) * head_dim**-0.5
    ref = torch.einsum("ht,thd->hd", scores.softmax(-1), value.double().repeat_interleave(group, 1))
    assert rel_err(out[0], ref) < 1e-5


# ----------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_bf16_gpu_qwen3_shape(block_size):
    gen = torch.Generator().manual_seed(block_size)
    lens = torch.randint(1, 1025, (64,), generator=gen)
    lens[0] = 1024
    k_cache, v_cache, seq_lens, tables = make_paged_kv(
        lens.tolist(), block_size, 8, 128, torch.bfloat16, gen, spare_blocks=40
    )
    q = torch.randn(64, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = reference_decode(q, k_cache, v_cache, seq_lens, tables, 128**-0.5)
    for num_splits in (None, 1, 8):
        out = decode_attention(q, k_cache, v_cache, seq_lens, tables, 128**-0.5, num_splits)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2, (num_splits, rel_err(out, ref))


@gpu
@needs_cuda
def test_store_kv_gpu_skips_padding():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(64, 256, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    key = torch.randn(300, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(300, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = torch.randperm(64 * 256, generator=gen)[:300]
    slots[::7] = -1
    k_before, v_before = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    keep = slots >= 0
    k_before[slots[keep].to(DEVICE)] = key[keep.to(DEVICE)]
    v_before[slots[keep].to(DEVICE)] = value[keep.to(DEVICE)]
    assert torch.equal(k_cache.flatten(0, 1), k_before)
    assert torch.equal(v_cache.flatten(0, 1), v_before)

"""The graded tests of ``05.decode_kernel``: the loop of ``_decode_split_kernel``
(nanovllm/kernels/decode_attention.py) that walks a sequence's block table, loads K/V tiles
through it and runs the online softmax (chapter 05 §4-§7).

Each test reaches that loop alone: with one split the kernel normalizes and writes the output
itself, and with several splits the merge kernel (``05.combine_splits``) is replaced here by a
PyTorch log-sum-exp merge of the partials ``(m, l, acc)`` the loop leaves. The reference is
written here in float32 PyTorch (gather each sequence's keys through its table, softmax,
weighted sum). Every cache row that no key of the tested range owns (past a sequence's end,
spare blocks, keys outside a sliding window) holds NaN, so a read outside the range shows up.

Tolerances: fp32 caches within ``rtol=1e-4, atol=1e-5`` elementwise (measured: 1.5e-6
absolute at most); fp16 q over fp16 or fp8 caches within 2e-3 relative (norm) of the float32
reference on the same bits (measured: 1.7e-4; the kernel rounds the softmax weights to fp16,
as flash-attention does). Without CUDA the kernel runs under the Triton interpreter
(``conftest.py``), so the cases stay small.
"""

import math

import pytest
import torch
from test_decode_kernels import DEVICE, _require_interpreter

_require_interpreter()
from nanovllm.kernels import decode_attention as decode_module  # noqa: E402

decode_attention = decode_module.decode_attention
FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def paged_case(gen, lens, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32,
               window=None):
    """(q, k_cache, v_cache, seq_lens, block_tables): random keys and values in the rows each
    sequence owns (within the window, if any), NaN everywhere else; shuffled block ids; table
    rows padded with -1, two columns more than the longest sequence needs. The caches are in
    ``dtype``; q too, except over an fp8 cache, where it is fp16."""
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    used = 0
    for b, n in enumerate(lens):
        tables[b, : need[b]] = order[used : used + need[b]].to(torch.int32)
        used += need[b]
        t = torch.arange(max(n - window, 0) if window else 0, n)
        blocks, rows = tables[b, t // block_size].long(), t % block_size
        k_cache[blocks, rows] = torch.randn(len(t), num_kv_heads, head_dim, generator=gen) * 2
        v_cache[blocks, rows] = torch.randn(len(t), num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    q = q.to(torch.float16 if dtype == torch.float8_e4m3fn else dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [x.to(DEVICE) for x in (q, k_cache.to(dtype), v_cache.to(dtype), seq_lens, tables)]


def reference(q, k_cache, v_cache, seq_lens, block_tables, scale, window=None):
    """float32 decode attention, one sequence at a time; an empty sequence gives zeros."""
    q, k_cache, v_cache = (x.cpu().float() for x in (q, k_cache, v_cache))
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape)
    for b, n in enumerate(seq_lens.tolist()):
        t = torch.arange(max(n - window, 0) if window else 0, n)
        if len(t) == 0:
            continue
        blocks, rows = block_tables[b].cpu().long()[t // block_size], t % block_size
        k = k_cache[blocks, rows].repeat_interleave(group, dim=1)  # [T, H, D]
        v = v_cache[blocks, rows].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b], k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


@pytest.fixture
def torch_merge(monkeypatch):
    """Replace the merge kernel by the log-sum-exp rule in PyTorch (base 2, as the partials)."""

    def merge(m, l, acc, out):  # noqa: E741 -- m, l [B, H, S]; acc [B, H, S, D_PAD]
        assert torch.isfinite(l).all() and torch.isfinite(acc).all(), "NaN in the partials"
        m_max = m.amax(dim=-1, keepdim=True)
        w = torch.exp2(m - torch.where(m_max == float("-inf"), 0.0, m_max))
        l_sum = (w * l).sum(dim=-1)[..., None]
        merged = (w[..., None] * acc).sum(dim=2) / torch.where(l_sum > 0, l_sum, 1.0)
        out.copy_(merged[..., : out.shape[-1]].to(out.dtype))

    monkeypatch.setattr(decode_module, "combine_splits", merge)


def lengths(gen, block_size):
    """One key, exactly one block, one block and a key, and several blocks ending partway."""
    several = int(torch.randint(2 * block_size + 1, 4 * block_size - 1, (1,), generator=gen))
    return [1, block_size, block_size + 1, several]


# (num_heads, num_kv_heads, head_dim, block_size): GQA groups 1, 3 and 8
SHAPES = {"mha": (2, 2, 32, 16), "group3": (6, 2, 64, 16), "group8-dim80": (8, 1, 80, 32)}


@pytest.mark.assignment("05.decode_kernel")
@pytest.mark.parametrize("name", list(SHAPES))
def test_one_split_matches_the_reference(name):
    num_heads, num_kv_heads, head_dim, block_size = SHAPES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    lens = lengths(gen, block_size)
    case = paged_case(gen, lens, block_size, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = decode_attention(*case, scale, num_splits=1)
    assert out.shape == case[0].shape and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "a key outside the sequence (a NaN row) was read"
    torch.testing.assert_close(out.cpu(), reference(*case, scale), **FP32_TOL)


@pytest.mark.assignment("05.decode_kernel")
def test_one_key_gives_its_value_and_no_key_gives_zeros():
    """seq_len 1: the softmax has one weight, 1, so each head's output is that key's value.
    seq_len 0 (a padded CUDA-graph row): no key at all, zeros, not NaN."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, seq_lens, tables = paged_case(gen, [1, 1, 1, 1], 16, 4, 2, 32)
    seq_lens[[1, 3]] = 0
    tables[[1, 3]] = -1
    out = decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.3, num_splits=1).cpu()
    for b in (0, 2):
        value = v_cache.cpu()[int(tables[b, 0]), 0].repeat_interleave(2, dim=0)  # [H, D]
        torch.testing.assert_close(out[b], value, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


@pytest.mark.assignment("05.decode_kernel")
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_partials_merge_to_the_reference(num_splits, torch_merge):
    """Several splits per sequence: each program leaves (m, l, acc) of its own key range, some
    of them empty (a short sequence cut into many splits), and their merge is the softmax."""
    gen = torch.Generator().manual_seed(100 + num_splits)
    lens = [1, 20] + torch.randint(70, 200, (2,), generator=gen).tolist()
    case = paged_case(gen, lens, 16, 6, 2, 32)
    out = decode_attention(*case, 32**-0.5, num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), reference(*case, 32**-0.5), **FP32_TOL)


@pytest.mark.assignment("05.decode_kernel")
@pytest.mark.parametrize("window", [1, 20, 45])
def test_sliding_window_reads_only_its_keys(window, torch_merge):
    """A window starts the key range at seq_len - window, mid-tile and mid-block; the keys
    before it are NaN here."""
    gen = torch.Generator().manual_seed(200 + window)
    lens = [1, 17] + torch.randint(50, 110, (2,), generator=gen).tolist()
    case = paged_case(gen, lens, 16, 4, 2, 32, window=window)
    ref = reference(*case, 32**-0.5, window=window)
    for num_splits in (1, 2):
        out = decode_attention(*case, 32**-0.5, num_splits=num_splits, window=window)
        assert torch.isfinite(out).all(), f"a key outside the window was read ({num_splits=})"
        torch.testing.assert_close(out.cpu(), ref, **FP32_TOL)


@pytest.mark.assignment("05.decode_kernel")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_half_and_fp8_caches(dtype):
    """fp16: tiles and q in fp16 into the dots, fp32 accumulation. fp8 e4m3 (chapter 08): the
    tiles are widened to q's dtype (fp16 here) after loading; the per-layer scales are the
    launcher's (k_scale folded into the softmax scale, v_scale applied after the loop). Both
    within 2e-3 relative of the float32 reference on the same bits."""
    gen = torch.Generator().manual_seed(17)
    lens = lengths(gen, 16)
    q, k_cache, v_cache, seq_lens, tables = paged_case(gen, lens, 16, 6, 2, 64, dtype)
    scale = 64**-0.5
    k_scale, v_scale = (0.5, 3.0) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    out = decode_attention(q, k_cache, v_cache, seq_lens, tables, scale, num_splits=1,
                           k_scale=k_scale, v_scale=v_scale)
    ref = reference(q, k_cache.float() * k_scale, v_cache.float() * v_scale, seq_lens, tables,
                    scale)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert ((out.cpu().float() - ref).norm() / ref.norm()).item() < 2e-3

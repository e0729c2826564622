"""Triton prefill attention over the paged KV cache vs a float64 torch reference.

Without CUDA the kernel runs under the Triton interpreter. Triton reads TRITON_INTERPRET
when it is imported (its own library functions are decorated then), so the variable must
be set before the first ``import triton`` of the process. ``tests/kernels/conftest.py``
and the top of this file set it; pytest imports them before this folder's modules. If
something imported triton earlier without it (a root conftest, a test module collected
before this folder), the in-process cases skip and ``test_cases_in_fresh_process`` runs
this file again in a subprocess with the variable set, so the cases always run.
"""

import os
import subprocess
import sys
from itertools import accumulate
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from nanovllm.kernels import prefill_attention as kernel_module  # noqa: E402

prefill_attention = kernel_module.prefill_attention
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _can_run_in_process() -> bool:
    if HAS_CUDA:
        return True
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    stdlib_compiled = any(isinstance(getattr(tl, name), JITFunction) for name in dir(tl))
    return kernel_module._is_interpreted() and not stdlib_compiled


IN_PROCESS = _can_run_in_process()
in_process = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported before TRITON_INTERPRET=1; see test_cases_in_fresh_process",
)
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (q_len, kv_len): no prefix, cached prefix + shorter chunk, decode rows (one at a block
# boundary), a chunk ending exactly on a block boundary, a short chunk after a long prefix.
MIXED_BATCH = [(37, 37), (23, 71), (1, 50), (1, 17), (64, 64), (5, 90), (40, 56)]


def make_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, seed=0):
    """Random packed queries and a paged cache holding each sequence's K/V.

    Blocks are handed out in shuffled order (non-contiguous), spare blocks and the unused
    rows of last blocks are filled with NaN, and table rows are padded with -1 (plus two
    all-padding columns), so reading anything the kernel must not read shows up as NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seqs)
    blocks_per_seq = [-(-kv_len // block_size) for _, kv_len in seqs]
    num_blocks = sum(blocks_per_seq) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((num_seqs, max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, (_, kv_len) in enumerate(seqs):
        ids = [order.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(kv_len)
        blocks, rows = block_tables[b, pos // block_size].long(), pos % block_size
        k_cache[blocks, rows] = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
        v_cache[blocks, rows] = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
    total_q = sum(q_len for q_len, _ in seqs)
    q = torch.randn(total_q, num_heads, head_dim, generator=gen)
    cu_seqlens_q = torch.tensor([0, *accumulate(q_len for q_len, _ in seqs)], dtype=torch.int32)
    seq_lens_k = torch.tensor([kv_len for _, kv_len in seqs], dtype=torch.int32)
    case = dict(
        q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype),
        cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, block_tables=block_tables,
        scale=head_dim**-0.5, max_seqlen_q=max(q_len for q_len, _ in seqs),
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _reference_prefill_attention(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, max_seqlen_q
):
    """float64 causal attention, gathering each sequence's K/V through its block table."""
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for b in range(seq_lens_k.numel()):
        start, end, kv_len = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens_k[b])
        pos = torch.arange(kv_len, device=q.device)
        blocks, rows = block_tables[b, pos // block_size].long(), pos % block_size
        k = k_cache[blocks, rows].double().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        v = v_cache[blocks, rows].double().repeat_interleave(group, dim=1)
        qb = q[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = kv_len - (end - start) + torch.arange(end - start, device=q.device)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs)


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(case, out):
    ref = _reference_prefill_attention(**case)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert torch.isfinite(out).all(), "non-finite output: a masked or padded slot leaked in"
    err = relative_error(out, ref)
    assert err < TOLERANCE[out.dtype], f"relative error {err:.2e}"
    return err


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size"),
    [(4, 4, 16), (6, 2, 32), (4, 1, 16)],
    ids=["mha-bs16", "gqa3-bs32", "gqa4-bs16"],
)
def test_mixed_batch_matches_reference(dtype, head_dim, num_heads, num_kv_heads, block_size):
    case = make_case(MIXED_BATCH, num_heads, num_kv_heads, head_dim, block_size, dtype)
    check(case, prefill_attention(**case))


@in_process
@pytest.mark.parametrize(
    ("block_m", "block_n", "block_size"),
    [(16, 16, 16), (16, 64, 16), (64, 16, 64), (32, 16, 64), (128, 64, 16)],
    ids=["16x16-bs16", "bn>bs", "bn<bs", "bm>bn", "gpu-tiles"],
)
def test_tile_shapes(block_m, block_n, block_size):
    case = make_case(MIXED_BATCH, 3, 1, 64, block_size, torch.float32, seed=1)
    check(case, prefill_attention(**case, tiles=(block_m, block_n, 4, 2)))


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_writes_every_row_of_a_poisoned_out(dtype):
    case = make_case([(30, 30), (1, 40), (12, 77)], 4, 2, 64, 16, dtype, seed=2)
    out = torch.full_like(case["q"], float("nan"))
    result = prefill_attention(**case, out=out)
    assert result.data_ptr() == out.data_ptr()
    check(case, out)


@in_process
def test_decode_only_batch():
    case = make_case([(1, 1), (1, 16), (1, 33), (1, 64)], 4, 1, 64, 16, torch.float32, seed=3)
    check(case, prefill_attention(**case))


@in_process
def test_max_seqlen_q_larger_than_needed():
    case = make_case([(20, 50), (9, 9)], 2, 1, 64, 16, torch.float32, seed=4)
    case["max_seqlen_q"] = 100  # extra query tiles exit at once
    check(case, prefill_attention(**case))


@in_process
def test_empty_batch():
    case = make_case([(3, 3)], 2, 2, 64, 16, torch.float32)
    case.update(
        q=case["q"][:0], cu_seqlens_q=case["cu_seqlens_q"][:1], seq_lens_k=case["seq_lens_k"][:0],
        block_tables=case["block_tables"][:0], max_seqlen_q=0,
    )
    assert prefill_attention(**case).shape == (0, 2, 64)


def test_rejects_bad_arguments():
    case = make_case([(4, 4)], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        prefill_attention(**{**case, "seq_lens_k": case["seq_lens_k"].long()})
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(**{**case, "q": torch.randn(4, 3, 64, device=DEVICE)})
    with pytest.raises(ValueError, match="dtypes"):
        prefill_attention(**{**case, "q": case["q"].half()})
    bad = make_case([(4, 4)], 2, 2, 48, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention(**bad)


@pytest.mark.skipif(IN_PROCESS, reason="the cases run in this process")
def test_cases_in_fresh_process():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _gpu_case(block_size, seed, dtype=torch.bfloat16):
    """8 sequences of 100..1024 keys; half of them with a cached prefix."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(100, 1025, (8,), generator=gen).tolist()
    seqs = [(kv if i % 2 == 0 else max(1, kv // (i + 1)), kv) for i, kv in enumerate(kv_lens)]
    return make_case(seqs, 16, 8, 128, block_size, dtype, device="cuda", seed=seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_large_batch(block_size, dtype):
    case = _gpu_case(block_size, seed=block_size, dtype=dtype)
    check(case, prefill_attention(**case))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_mixed_with_decode_rows(block_size):
    seqs = [(300, 1000), (1, 700), (1024, 1024), (1, 1), (129, 129), (64, 900)]
    case = make_case(seqs, 16, 8, 128, block_size, torch.bfloat16, device="cuda", seed=7)
    check(case, prefill_attention(**case))


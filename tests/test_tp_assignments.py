"""The graded tests of chapter 09's assignments (nanovllm/course): ``09.column_shard``
(``ColumnParallelLinear.weight_loader``), ``09.row_shard`` (``RowParallelLinear.weight_loader``)
and ``09.vocab_embed`` (``VocabParallelEmbedding.forward`` with several ranks).

Every rank is simulated in this one process: ``as_rank(r, n)`` sets the tensor-parallel
state (``nanovllm.distributed._state``) while a layer is built, loaded and run, and the
all-reduce is replaced by an identity that records its input, so each rank's partial result
can be summed here. The references are float64 matmuls and lookups of the full tensors; the
engine tests at TP=2 in tests/test_tensor_parallel.py grade the same code end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from nanovllm import distributed
from nanovllm.layers import embed_head, linear
from nanovllm.layers.embed_head import VocabParallelEmbedding
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``size`` (no process group: collectives must be patched)."""
    saved = dict(distributed._state)
    distributed._state.update(rank=rank, size=size)
    try:
        yield
    finally:
        distributed._state.update(saved)


@pytest.fixture
def reductions(monkeypatch) -> list[torch.Tensor]:
    """Replace the all-reduce the layers call by an identity; returns what it received."""
    seen: list[torch.Tensor] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return x

    monkeypatch.setattr(linear, "all_reduce", record)
    monkeypatch.setattr(embed_head, "all_reduce", record)
    return seen


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------- 09.column_shard


@pytest.mark.assignment("09.column_shard")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_column_shards_are_the_ranks_rows(n):
    out, k = 12, 5
    w, b = randn(out, k, seed=n), randn(out, seed=10 + n)
    rows = out // n
    for rank in range(n):
        with as_rank(rank, n):
            layer = ColumnParallelLinear(k, out, bias=True).double()
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (rows, k)
        assert torch.equal(layer.weight, w[rank * rows : (rank + 1) * rows]), f"rank {rank}"
        assert torch.equal(layer.bias, b[rank * rows : (rank + 1) * rows]), f"rank {rank}"


@pytest.mark.assignment("09.column_shard")
def test_column_parallel_outputs_concatenate_to_the_full_matmul(reductions):
    n, out, k = 4, 16, 24
    w, b, x = randn(out, k, seed=1), randn(out, seed=2), randn(3, 7, k, seed=3)
    parts = []
    for rank in range(n):
        with as_rank(rank, n):
            layer = ColumnParallelLinear(k, out, bias=True).double()
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
            parts.append(layer(x))
    assert not reductions, "a column-parallel layer needs no communication"
    torch.testing.assert_close(torch.cat(parts, dim=-1), x @ w.T + b, rtol=1e-12, atol=1e-12)


@pytest.mark.assignment("09.column_shard")
def test_one_rank_loads_the_whole_column_weight():
    w = randn(6, 4, seed=4)
    layer = ColumnParallelLinear(4, 6).double()
    layer.weight.weight_loader(layer.weight, w)
    assert torch.equal(layer.weight, w)


# ----------------------------------------------------------------------------- 09.row_shard


@pytest.mark.assignment("09.row_shard")
@pytest.mark.parametrize("n", [2, 4])
def test_row_shards_are_the_ranks_columns_and_the_bias_is_whole(n):
    out, k = 6, 16
    w, b = randn(out, k, seed=20 + n), randn(out, seed=30 + n)
    cols = k // n
    for rank in range(n):
        with as_rank(rank, n):
            layer = RowParallelLinear(k, out, bias=True).double()
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (out, cols)
        assert torch.equal(layer.weight, w[:, rank * cols : (rank + 1) * cols]), f"rank {rank}"
        assert torch.equal(layer.bias, b), f"rank {rank}: the bias is not split"


@pytest.mark.assignment("09.row_shard")
def test_row_parallel_partial_sums_add_up_to_the_full_matmul(reductions):
    """Each rank's matmul is a partial sum; the all-reduce adds them, then the bias once."""
    n, out, k = 3, 10, 18
    w, b, x = randn(out, k, seed=5), randn(out, seed=6), randn(4, k, seed=7)
    cols = k // n
    for rank in range(n):
        with as_rank(rank, n):
            layer = RowParallelLinear(k, out, bias=True).double()
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
            layer(x[:, rank * cols : (rank + 1) * cols])  # each rank sees its input slice
    assert len(reductions) == n
    torch.testing.assert_close(sum(reductions) + b, x @ w.T + b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- 09.vocab_embed


def embed_as_ranks(table: torch.Tensor, ids: torch.Tensor, n: int, reductions: list) -> list:
    """Each simulated rank's contribution to the all-reduce, for ``ids`` over ``n`` ranks."""
    vocab, hidden = table.shape
    start = len(reductions)
    for rank in range(n):
        with as_rank(rank, n):
            layer = VocabParallelEmbedding(vocab, hidden).double()
            layer.weight.weight_loader(layer.weight, table)
            out = layer(ids)
        assert out.shape == (*ids.shape, hidden) and out.dtype == torch.float64
    assert len(reductions) - start == n, "one all-reduce per rank and call"
    return reductions[start:]


@pytest.mark.assignment("09.vocab_embed")
@pytest.mark.parametrize("vocab, n", [(12, 2), (11, 3), (10, 4)])  # uneven: a short last shard
def test_vocab_parallel_partials_sum_to_the_full_lookup(vocab, n, reductions):
    table = randn(vocab, 5, seed=vocab)
    ids = torch.tensor([[0, vocab - 1, 3, 3], [vocab // 2, 1, vocab - 2, 0]])
    partials = embed_as_ranks(table, ids, n, reductions)
    torch.testing.assert_close(sum(partials), F.embedding(ids, table), rtol=0, atol=0)


@pytest.mark.assignment("09.vocab_embed")
def test_each_rank_zeroes_the_tokens_it_does_not_own(reductions):
    vocab, n = 10, 3  # shards of 4: ids 0-3, 4-7, 8-9 (+ two padding rows)
    table = randn(vocab, 3, seed=8) + 5.0  # no row is zero by chance
    ids = torch.arange(vocab)
    partials = embed_as_ranks(table, ids, n, reductions)
    for rank, partial in enumerate(partials):
        owned = (ids >= 4 * rank) & (ids < 4 * (rank + 1))
        assert torch.equal(partial[owned], table[ids[owned]]), f"rank {rank}: its own rows"
        assert (partial[~owned] == 0).all(), f"rank {rank}: zeros for the others' tokens"


@pytest.mark.assignment("09.vocab_embed")
def test_vocab_parallel_embedding_keeps_the_weight_dtype(reductions):
    table = randn(8, 4, seed=9).float()
    ids = torch.tensor([7, 0, 4])
    with as_rank(1, 2):
        layer = VocabParallelEmbedding(8, 4)
        layer.weight.weight_loader(layer.weight, table)
        out = layer(ids)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.stack([table[7], torch.zeros(4), table[4]]))

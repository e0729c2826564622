"""The MoE layer's pieces on CPU (chapter 16): routing, alignment, the per-expert reference.

``route`` against a float64 softmax/sort written out per token; ``moe_align_block_size``
exactly against a plain-Python grouping of the same assignments; ``moe_reference`` against a
dense float64 computation that runs every expert on every token and keeps the routed ones;
the stacked weights' loader against per-expert slices at one and two ranks.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.distributed import _state
from nanovllm.kernels.moe_align import aligned_capacity, moe_align_block_size
from nanovllm.layers.fused_moe import StackedExpertWeight, moe_reference
from nanovllm.layers.router import route

ROUTE = pytest.mark.assignment("16.route")
ALIGN = pytest.mark.assignment("16.align")


def expected_route(logits: torch.Tensor, k: int, renormalize: bool):
    weights, ids = [], []
    for row in logits.double():
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        order = sorted(range(len(row)), key=lambda e: -probs[e].item())[:k]
        w = probs[order]
        weights.append(w / w.sum() if renormalize else w)
        ids.append(order)
    return torch.stack(weights), torch.tensor(ids)


@ROUTE
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_picks_and_weighs_the_top_k(renormalize):
    gen = torch.Generator().manual_seed(0)
    for tokens, experts, k in [(1, 4, 1), (7, 8, 2), (13, 64, 8), (5, 6, 6)]:
        logits = 3 * torch.randn(tokens, experts, generator=gen)
        before = logits.clone()
        weights, ids = route(logits, k, renormalize)
        want_w, want_ids = expected_route(logits, k, renormalize)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert weights.shape == ids.shape == (tokens, k)
        assert ids.tolist() == want_ids.tolist()
        torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)
        assert torch.equal(logits, before)  # a pure function


@ROUTE
def test_route_sums_and_dtypes():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 16, generator=gen).to(torch.bfloat16)
    normed, ids = route(logits, 4, True)
    raw, raw_ids = route(logits, 4, False)
    assert normed.dtype == torch.float32 and torch.equal(ids, raw_ids)
    torch.testing.assert_close(normed.sum(-1), torch.ones(9))
    assert bool((raw.sum(-1) < 1).all()) and bool((raw[:, :-1] >= raw[:, 1:]).all())
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))
    full, _ = route(logits, 16, False)  # every expert: the whole softmax
    torch.testing.assert_close(full.sum(-1), torch.ones(9))


@ROUTE
def test_route_of_no_tokens():
    weights, ids = route(torch.zeros(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def expected_alignment(topk_ids: torch.Tensor, num_experts: int, block: int):
    flat = topk_ids.flatten().tolist()
    n = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        slots = [s for s in range(n) if flat[s] == e]
        if not slots:
            continue
        padded = slots + [n] * (-len(slots) % block)
        sorted_ids += padded
        expert_ids += [e] * (len(padded) // block)
    used = len(sorted_ids)
    capacity = aligned_capacity(n, num_experts, block)
    return (sorted_ids + [n] * (capacity - used), expert_ids + [-1] * (capacity // block -
                                                                       len(expert_ids)), used)


ALIGN_CASES = [(1, 1, 4, 16), (5, 2, 8, 4), (33, 3, 6, 16), (64, 8, 128, 16), (17, 2, 4, 1),
               (40, 4, 3, 64)]


@ALIGN
@pytest.mark.parametrize("tokens,k,experts,block", ALIGN_CASES)
def test_align_matches_a_python_grouping(tokens, k, experts, block):
    gen = torch.Generator().manual_seed(tokens * 7 + k)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, experts, block)
    want_sorted, want_experts, used = expected_alignment(topk_ids, experts, block)
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int64
    assert sorted_ids.tolist() == want_sorted
    assert expert_ids.tolist() == want_experts
    assert num_padded.tolist() == [used]


@ALIGN
def test_align_with_skewed_routing_and_empty_experts():
    topk_ids = torch.tensor([[3, 0], [3, 0], [3, 1], [3, 0], [3, 5]])  # expert 3 is hot
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, 6, 4)
    n = 10
    assert sorted_ids.tolist()[:20] == [1, 3, 7, n, 5, n, n, n, 0, 2, 4, 6, 8, n, n, n,
                                        9, n, n, n]
    assert expert_ids.tolist()[:6] == [0, 1, 3, 3, 5, -1] and num_padded.tolist() == [20]
    assert len(sorted_ids) == aligned_capacity(n, 6, 4) == 10 + 6 * 3


@ALIGN
def test_align_shapes_do_not_depend_on_the_routing():
    gen = torch.Generator().manual_seed(3)
    spread = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(12)])
    piled = torch.arange(4).repeat(12, 1)  # every token to the same four experts
    a, b = (moe_align_block_size(ids, 16, 8) for ids in (spread, piled))
    assert [t.shape for t in a] == [t.shape for t in b]
    assert b[2].tolist() == [4 * 16] and a[2].item() > b[2].item()
    empty = moe_align_block_size(torch.zeros(0, 2, dtype=torch.int64), 4, 16)
    assert [t.numel() for t in empty] == [0, 0, 1] and empty[2].tolist() == [0]


def dense_moe(x, w13, w2, weights, ids):
    """Every expert on every token (float64), the routed ones kept: no sorting at all."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    gate, up = torch.einsum("th,eih->tei", x, w13).chunk(2, dim=-1)
    y = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(gate) * up, w2)  # [T, E, H]
    picked = y.gather(1, ids[:, :, None].expand(-1, -1, y.shape[-1]))  # [T, k, H]
    return (picked * weights.double()[:, :, None]).sum(1)


@ROUTE
@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 2), (19, 8, 2), (30, 16, 4), (0, 4, 1)])
def test_reference_moe_matches_dense_computation(tokens, experts, k):
    gen = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 24, 20
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = 0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = 0.2 * torch.randn(experts, hidden, inter, generator=gen)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), k, True)
    out = moe_reference(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_moe(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_stacked_weights_take_each_ranks_slice(rank, size, monkeypatch):
    monkeypatch.setitem(_state, "rank", rank)
    monkeypatch.setitem(_state, "size", size)
    experts, hidden, inter = 3, 8, 6
    gen = torch.Generator().manual_seed(4)
    w13 = StackedExpertWeight(experts, ("gate", "up"), (inter, hidden), shard_dim=0)
    w2 = StackedExpertWeight(experts, ("down",), (hidden, inter), shard_dim=1)
    gate, up = (torch.randn(experts, inter, hidden, generator=gen) for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=gen)
    for e in range(experts):
        w13.weight_loader(w13.weight, gate[e], (e, "gate"))
        w13.weight_loader(w13.weight, up[e], (e, "up"))
        w2.weight_loader(w2.weight, down[e], (e, "down"))
    part = inter // size
    mine = slice(rank * part, (rank + 1) * part)
    assert torch.equal(w13.weight, torch.cat([gate[:, mine], up[:, mine]], dim=1))
    assert torch.equal(w2.weight, down[:, :, mine])
    whole = StackedExpertWeight(experts, ("gate", "up"), (inter, hidden), shard_dim=0)
    whole.weight_loader(whole.weight, torch.cat([gate, up], dim=1))  # all experts at once
    assert torch.equal(whole.weight, w13.weight)
    with pytest.raises(ValueError, match="expected shape"):
        w2.weight_loader(w2.weight, down[0].T, (0, "down"))

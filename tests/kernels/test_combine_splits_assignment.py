"""``05.combine_splits`` alone (chapter 05 §6): the split-KV merge kernel on hand-made partials,
against a float64 reference of the same formula, under the Triton interpreter on a CPU. No
decode kernel runs here, so these tests grade the merge whatever ``05.decode_kernel`` holds."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.split_kv import combine_splits, split_partials


def _partials(batch, heads, splits, head_dim, d_pad, empty=(), seed=0):
    """Random partials as the decode kernel leaves them: base-2 running max, positive sums,
    unnormalised outputs; the (b, h, s) in ``empty`` saw no key (m = -inf, l = 0, acc = 0)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, heads, head_dim)
    m, l, acc = split_partials(out, splits, d_pad)  # noqa: E741
    m.copy_(torch.randn(batch, heads, splits, generator=g) * 4)
    l.copy_(torch.rand(batch, heads, splits, generator=g) * 8 + 0.5)
    acc.copy_(torch.randn(batch, heads, splits, d_pad, generator=g) * 3)
    for b, h, s in empty:
        m[b, h, s], l[b, h, s], acc[b, h, s] = float("-inf"), 0.0, 0.0
    return m, l, acc, out


def _reference(m, l, acc, head_dim):  # noqa: E741
    m, l, acc = m.double(), l.double(), acc.double()  # noqa: E741
    top = m.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(m - top)
    total = (w * l).sum(-1, keepdim=True)
    merged = (w[..., None] * acc).sum(-2) / torch.where(total > 0, total, torch.ones_like(total))
    return merged[..., :head_dim]


@pytest.mark.assignment("05.combine_splits")
@pytest.mark.parametrize("splits", [1, 3, 4, 7])
def test_merge_matches_the_formula(splits):
    m, l, acc, out = _partials(2, 3, splits, head_dim=24, d_pad=32, seed=splits)  # noqa: E741
    combine_splits(m, l, acc, out)
    torch.testing.assert_close(out.double(), _reference(m, l, acc, 24), rtol=1e-5, atol=1e-5)


@pytest.mark.assignment("05.combine_splits")
def test_splits_that_saw_no_key_weigh_nothing_and_an_empty_row_is_zero():
    empty = [(0, 1, 0), (0, 1, 2), (1, 0, 0), (1, 0, 1), (1, 0, 2)]  # row (1, 0): all empty
    m, l, acc, out = _partials(2, 2, 3, head_dim=16, d_pad=16, empty=empty, seed=5)  # noqa: E741
    out.fill_(float("nan"))
    combine_splits(m, l, acc, out)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, 0], torch.zeros(16))
    torch.testing.assert_close(out.double(), _reference(m, l, acc, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.assignment("05.combine_splits")
def test_output_strides_and_dtype_are_respected():
    """``out`` may be a strided view (the engine's output rows); only its first ``HEAD_DIM``
    columns are written, in its dtype, and the padding columns of the partials are ignored."""
    m, l, acc, _ = _partials(3, 2, 2, head_dim=20, d_pad=32, seed=9)  # noqa: E741
    big = torch.full((3, 2, 40), -7.0, dtype=torch.float16)
    out = big[:, :, :20]
    combine_splits(m, l, acc, out)
    torch.testing.assert_close(out.double(), _reference(m, l, acc, 20), rtol=2e-3, atol=2e-3)
    assert (big[:, :, 20:] == -7.0).all()  # nothing written past HEAD_DIM

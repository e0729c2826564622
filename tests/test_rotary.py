"""Rotary embedding (nanovllm/layers/rotary.py, chapter 01) against a float64 reference
written differently: each channel pair (i, i + d/2) as one complex number, multiplied by
exp(i * position * inv_freq). Fresh random inputs; fp32 tolerance 1e-5."""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.rotary import RotaryEmbedding, rope_inverse_frequencies


def complex_reference(x, positions, inv_freq):
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    turn = torch.polar(torch.ones(1, dtype=torch.float64),
                       positions.double()[:, None] * inv_freq.double()[None, :])
    rotated = pairs * turn[:, None, :]
    return torch.cat([rotated.real, rotated.imag], dim=-1)


@pytest.mark.assignment("01.rope")
@pytest.mark.parametrize("head_dim, theta", [(64, 1e5), (128, 1e6), (16, 1e4)])
def test_rope_matches_complex_rotation(head_dim, theta):
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 2048, theta)
    positions = torch.randint(0, 2048, (11,), generator=gen)
    q = torch.randn(11, 6, head_dim, generator=gen)
    k = torch.randn(11, 2, head_dim, generator=gen)
    q_rot, k_rot = rope(positions, q, k)
    inv_freq = rope_inverse_frequencies(head_dim, theta, None)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q_rot.dtype == q.dtype
    # fp32 tables of angles up to 2048 rad: about 1e-4 of absolute error in cos/sin
    torch.testing.assert_close(q_rot.double(), complex_reference(q, positions, inv_freq),
                               atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(k_rot.double(), complex_reference(k, positions, inv_freq),
                               atol=5e-4, rtol=1e-4)


@pytest.mark.assignment("01.rope")
def test_rope_scores_depend_on_distance_only_and_keep_dtype():
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(32, 512, 1e4)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)
    scores = []
    for m in (5, 50, 400):
        q_rot, _ = rope(torch.tensor([m]), q, q)
        _, k_rot = rope(torch.tensor([m - 3]), k, k)
        scores.append(float((q_rot * k_rot).sum()))
    assert max(scores) - min(scores) < 1e-4, scores
    x = torch.randn(4, 3, 32, generator=gen).bfloat16()
    out, _ = rope(torch.arange(4), x, x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], x[0]), "position 0 is the identity rotation"

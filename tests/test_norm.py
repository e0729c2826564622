"""RMSNorm (nanovllm/layers/norm.py, chapter 01 §1.2; assignment ``01.rmsnorm``).

``RMSNorm.forward`` on CPU, against a float64 reference written in this file (each row divided
by ``sqrt(mean(x^2) + eps)``, times the weight) and against hand-computed rows: the eps under
the root, one norm per row of the last dimension (leading dimensions are tokens or heads),
the weight channel by channel, the residual add before the norm, the activation dtype kept,
and fp16 inputs whose squares overflow fp16 (so the mean of squares must be taken in fp32).

Tolerances: fp32 outputs 1e-5 absolute and relative against float64; bf16 / fp16 outputs one
unit in the last place of their format (rtol 2^-7 / 2^-10), plus a small absolute slack.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.norm import RMSNorm

ID = "01.rmsnorm"
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # the weight is a parameter: build no graph
        yield


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm over the last dimension, row by row (no rsqrt, no keepdim tricks)."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        rms = (sum(float(v) ** 2 for v in row) / len(row) + eps) ** 0.5
        out[i] = row / rms * weight.double()
    return out.reshape(x.shape)


def norm_with_weight(dim: int, eps: float, seed: int, dtype=torch.float32) -> RMSNorm:
    norm = RMSNorm(dim, eps=eps)
    # a weight far from ones, so a forgotten weight cannot hide
    norm.weight.copy_(0.5 + torch.rand(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


@pytest.mark.assignment(ID)
def test_hand_computed_rows():
    """[3, 4]: mean of squares 12.5; [1, -1, 1, -1] has rms 1, so it comes out as the weight."""
    norm = RMSNorm(2, eps=0.0)
    out = norm(torch.tensor([[3.0, 4.0], [-6.0, 8.0]]))
    expected = torch.tensor([[3.0, 4.0], [-6.0, 8.0]]) / torch.tensor([[12.5**0.5], [50**0.5]])
    torch.testing.assert_close(out, expected, **FP32_TOL)
    norm = RMSNorm(4, eps=0.0)
    norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # channel by channel
    out = norm(torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 3.0, -4.0], [1.0, 2.0, 3.0, 4.0]]),
                               **FP32_TOL)


@pytest.mark.assignment(ID)
def test_eps_is_added_to_the_mean_of_squares_under_the_root():
    """Rows so small that eps dominates: 1e-3 / sqrt(1e-6 + 1e-2), not 1e-3 / (1e-3 + 1e-2)
    nor 1e-3 / sqrt(1e-6); a zero row stays zero (no NaN)."""
    norm = RMSNorm(3, eps=1e-2)
    out = norm(torch.tensor([[1e-3, 1e-3, 1e-3], [0.0, 0.0, 0.0], [1e-3, -2e-3, 2e-3]]))
    first = 1e-3 / (1e-6 + 1e-2) ** 0.5
    assert abs(float(out[0, 0]) - first) < 1e-7, float(out[0, 0])
    assert torch.equal(out[1], torch.zeros(3))
    third = torch.tensor([1e-3, -2e-3, 2e-3]) / (3e-6 + 1e-2) ** 0.5
    torch.testing.assert_close(out[2], third, atol=1e-7, rtol=1e-5)


@pytest.mark.assignment(ID)
@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 32), (1, 16)], ids=["tokens", "heads", "one"])
def test_each_row_of_the_last_dimension_matches_float64(shape):
    """Random fp32 input and weight, leading dims of tokens or tokens x heads (Qwen3's q/k
    norms); rows of very different scales, so a norm over the whole tensor fails."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = torch.randn(*shape, generator=gen)
    x = x * torch.logspace(-2, 2, x.numel() // shape[-1]).reshape(*shape[:-1], 1)
    norm = norm_with_weight(shape[-1], eps=1e-6, seed=shape[-1])
    out = norm(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, norm.weight, 1e-6),
                               **FP32_TOL)


@pytest.mark.assignment(ID)
def test_residual_is_added_before_the_norm():
    """forward(x, residual) gives (norm(x + residual), x + residual)."""
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(6, 48, generator=gen), torch.randn(6, 48, generator=gen)
    norm = norm_with_weight(48, eps=1e-5, seed=4)
    out, summed = norm(x, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), reference(x + residual, norm.weight, 1e-5),
                               **FP32_TOL)


@pytest.mark.assignment(ID)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_keeps_its_dtype(dtype):
    gen = torch.Generator().manual_seed(5)
    norm = norm_with_weight(96, eps=1e-6, seed=6, dtype=dtype)
    x = (3 * torch.randn(9, 96, generator=gen)).to(dtype)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference(x, norm.weight, 1e-6)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=2 * ulp)


@pytest.mark.assignment(ID)
def test_fp16_squares_beyond_its_range_are_taken_in_fp32():
    """300^2 = 90000 overflows fp16 (max 65504): the mean of squares must be fp32."""
    norm = RMSNorm(4, eps=1e-6).half()
    x = torch.tensor([[300.0, -300.0, 600.0, 0.0], [1000.0, 1000.0, 1000.0, 1000.0]]).half()
    out = norm(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    expected = reference(x, torch.ones(4), 1e-6)  # rms of the first row: 300 * sqrt(1.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=2**-10)

"""The fused Triton kernels of chapter 11 against float64 PyTorch references.

``rmsnorm`` (with and without the residual add), ``qk_norm_rope_`` (Qwen3's per-head norms and
NeoX RoPE, in place on the packed QKV projection) and ``silu_mul``, in fp32, fp16 and bf16, on
random inputs of odd sizes, with strided rows. Without CUDA the kernels run under the Triton
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), so the shapes are small.

Tolerance (``torch.testing.assert_close``, ``rtol = atol``): 1e-5 in fp32 (the reduction order
differs from the reference's); two units in the last place at 1.0 for fp16 (2e-3) and bf16
(1.6e-2): the kernels round a result at most twice, each time by half an ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"), reason="no GPU and no interpreter"
)

from nanovllm.kernels.activation import silu_mul  # noqa: E402
from nanovllm.kernels.rmsnorm import rmsnorm  # noqa: E402
from nanovllm.kernels.rope import qk_norm_rope_  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def strided_rows(t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s values as the left columns of a wider random buffer: (the view, the buffer)."""
    buffer = torch.randn(t.shape[0], t.shape[1] + 40, generator=gen).to(t.dtype).to(t.device)
    buffer[:, : t.shape[1]] = t
    return buffer[:, : t.shape[1]], buffer


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- rmsnorm


def reference_rmsnorm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.cpu().double()
    return weight.cpu().double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_rows,dim", [(1, 1024), (7, 576), (33, 576)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add+norm"])
def test_rmsnorm(num_rows, dim, with_residual, dtype):
    gen = torch.Generator().manual_seed(num_rows * dim)
    x, _ = strided_rows(randn(num_rows, dim, gen=gen, dtype=dtype), gen)
    weight = (1 + 0.5 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE)
    if not with_residual:
        y = rmsnorm(x, weight, 1e-6)
        assert y.dtype == dtype and y.shape == x.shape
        assert_close(y, reference_rmsnorm(x, weight, 1e-6), dtype)
        return
    residual = randn(num_rows, dim, gen=gen, dtype=dtype)
    summed = x + residual  # what the kernel must leave in `residual`, rounded the same way
    y, new_residual = rmsnorm(x, weight, 1e-6, residual)
    assert new_residual is residual
    assert torch.equal(residual, summed)
    assert_close(y, reference_rmsnorm(summed, weight, 1e-6), dtype)


def test_rmsnorm_rejects_bad_arguments():
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        rmsnorm(x, torch.ones(64, device=DEVICE), 1e-6, torch.randn(64, 3, device=DEVICE).T)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.ones(64, device=DEVICE, dtype=torch.float16), 1e-6)


# ----------------------------------------------------------------------------- q/k norm + rope


def reference_qk_norm_rope(qkv, positions, rope, heads, kv_heads, head_dim, weights, eps):
    """float64: RMSNorm each query/key head (if weights), then NeoX-rotate it; v untouched."""
    x = qkv.cpu().double().view(qkv.shape[0], heads + 2 * kv_heads, head_dim).clone()
    q, k = x[:, :heads], x[:, heads : heads + kv_heads]
    if weights is not None:
        for part, w in ((q, weights[0]), (k, weights[1])):
            part *= torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps) * w.cpu().double()
    cos = rope.cos.cpu().double()[positions.cpu()][:, None]
    sin = rope.sin.cpu().double()[positions.cpu()][:, None]
    for part in (q, k):
        x1, x2 = part.chunk(2, dim=-1)
        part[:] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return x.flatten(1)


ROPE_CASES = {
    # name: (tokens, heads, kv heads, head dim); Qwen3-0.6B's 16 + 8 heads take two programs
    "T1-qwen3-0.6b": (1, 16, 8, 128),
    "T7-gqa3-d64": (7, 6, 2, 64),
    "T33-mha-d128": (33, 4, 4, 128),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(ROPE_CASES))
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_only"])
def test_qk_norm_rope(name, qk_norm, dtype):
    tokens, heads, kv_heads, head_dim = ROPE_CASES[name]
    gen = torch.Generator().manual_seed(tokens * head_dim)
    rope = RotaryEmbedding(head_dim, 512, 1e6).to(DEVICE)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    width = (heads + 2 * kv_heads) * head_dim
    qkv, buffer = strided_rows(randn(tokens, width, gen=gen, dtype=dtype), gen)
    before = buffer.clone()
    weights = None
    if qk_norm:
        weights = tuple(
            (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE) for _ in range(2)
        )
    expected = reference_qk_norm_rope(
        qkv, positions, rope, heads, kv_heads, head_dim, weights, 1e-6
    )

    out = qk_norm_rope_(
        qkv, positions, rope.cos, rope.sin, heads, kv_heads, head_dim, *(weights or ()), eps=1e-6
    )
    assert out is qkv
    assert_close(qkv, expected, dtype)
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(buffer[:, v_start:], before[:, v_start:])  # v heads and the padding


def test_qk_norm_rope_rejects_bad_arguments():
    rope = RotaryEmbedding(64, 16, 1e4)
    qkv, positions = torch.randn(2, 4 * 64, device=DEVICE), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="width"):
        qk_norm_rope_(qkv, positions, rope.cos, rope.sin, 3, 1, 64)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_(qkv, positions, rope.cos, rope.sin, 2, 1, 64, torch.ones(64))


# ----------------------------------------------------------------------------- silu * up


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (7, 300), (33, 576)])
def test_silu_mul(tokens, inter, dtype):
    gen = torch.Generator().manual_seed(tokens * inter)
    gate_up, _ = strided_rows(2 * randn(tokens, 2 * inter, gen=gen, dtype=dtype), gen)
    gate, up = gate_up.cpu().double().chunk(2, dim=-1)
    out = silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (tokens, inter)
    assert_close(out, gate * torch.sigmoid(gate) * up, dtype)

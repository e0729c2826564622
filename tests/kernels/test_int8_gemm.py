"""The W8A16 Triton GEMM (``nanovllm/kernels/int8_gemm.py``, chapter 08) against float64.

The reference multiplies the inputs as given (in their dtype, widened exactly to float64) by
the exactly dequantized weight ``codes * scale``; so what is measured is the kernel's own
error: fp32 accumulation in a different order, and the final rounding to the output dtype.
Without CUDA the kernel runs under the Triton interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), so shapes are small; the GPU cases (``@pytest.mark.gpu``) take real
layer shapes in bf16.

Error measure: ``max |y - ref| / max |ref|`` over the output. Tolerances: fp32 1e-5 (only
the summation order differs); fp16 2e-3 and bf16 1e-2, about two half-ulps of the output
type at the largest value (the result is rounded once; fp32 accumulation adds little).
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

from nanovllm.kernels.int8_gemm import Int8GemmConfig, int8_gemm, pick_config  # noqa: E402
from nanovllm.layers.quantization.scales import quantize_int8  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_case(m: int, k: int, n: int, dtype: torch.dtype, seed: int, bias: bool = True):
    """Random activations, a random weight quantized per channel, optional bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    # rows of different magnitudes, so the per-channel scales really differ
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    codes, scale = quantize_int8(w)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return [t.to(DEVICE) if t is not None else None for t in (x, codes, scale, b)]


def reference(x, codes, scale, bias):
    w = codes.cpu().double() * scale.cpu().double()[:, None]
    y = x.cpu().double() @ w.T
    return y if bias is None else y + bias.cpu().double()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.cpu().double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("m, k, n", [(1, 40, 24), (3, 200, 33), (40, 96, 50), (17, 130, 7)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_float64_reference(dtype, m, k, n, bias):
    x, codes, scale, b = make_case(m, k, n, dtype, seed=m * 1000 + k + n, bias=bias)
    y = int8_gemm(x, codes, scale, b)
    assert y.dtype == dtype and y.shape == (m, n)
    assert relative_error(y, reference(x, codes, scale, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "config",
    [
        Int8GemmConfig(16, 32, 32, split_k=2),
        Int8GemmConfig(16, 16, 16, split_k=4),  # K=72: the last slice is short
        Int8GemmConfig(16, 16, 16, split_k=16),  # more slices than K steps: fewer launched
        Int8GemmConfig(16, 32, 32, group_m=2),  # 5 row tiles in groups of 2 (last one short)
        Int8GemmConfig(32, 16, 64, group_m=1),
    ],
    ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}g{c.group_m}",
)
def test_every_tiling_gives_the_same_result(config):
    x, codes, scale, b = make_case(70, 72, 40, torch.float32, seed=7)
    y = int8_gemm(x, codes, scale, b, config=config)
    assert relative_error(y, reference(x, codes, scale, b)) < TOLERANCE[torch.float32]


def test_split_k_is_deterministic_and_rows_may_be_strided():
    x, codes, scale, b = make_case(3, 96, 24, torch.float16, seed=3)
    wide = torch.zeros(3, 130, dtype=x.dtype, device=x.device)
    wide[:, 5:101] = x
    config = Int8GemmConfig(16, 16, 32, split_k=3)
    first = int8_gemm(wide[:, 5:101], codes, scale, b, config=config)
    second = int8_gemm(wide[:, 5:101], codes, scale, b, config=config)
    assert torch.equal(first, second)  # a fixed-order sum, not atomics
    assert relative_error(first, reference(x, codes, scale, b)) < TOLERANCE[torch.float16]


def test_bf16_inputs_under_the_interpreter_or_gpu():
    x, codes, scale, b = make_case(5, 64, 48, torch.bfloat16, seed=11)
    y = int8_gemm(x, codes, scale, b)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, reference(x, codes, scale, b)) < TOLERANCE[torch.bfloat16]


def test_empty_batch():
    x, codes, scale, b = make_case(0, 32, 16, torch.float32, seed=0)
    assert int8_gemm(x, codes, scale, b).shape == (0, 16)


def test_pick_config_rule():
    # decode: narrow tiles, K split until about two programs per SM (at most 8 slices)
    small = pick_config(1, 1024, 1024, num_sms=132)
    assert (small.block_m, small.split_k) == (16, 8)
    assert pick_config(1, 151936, 1024, num_sms=132).split_k == 1  # plenty of N tiles
    assert pick_config(4, 1024, 128, num_sms=132).split_k == 1  # one K step: nothing to split
    assert pick_config(300, 1024, 1024, num_sms=132).block_m == 128  # prefill: big tiles
    assert pick_config(40, 1024, 1024, num_sms=132).block_m == 64


def test_rejects_bad_arguments():
    x, codes, scale, b = make_case(2, 32, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        int8_gemm(x.double(), codes, scale)
    with pytest.raises(ValueError, match="weight must be int8"):
        int8_gemm(x, codes.float(), scale)
    with pytest.raises(ValueError, match="weight must be int8"):
        int8_gemm(x, codes[:, :31], scale)
    with pytest.raises(ValueError, match="scale"):
        int8_gemm(x, codes, scale[:15])
    with pytest.raises(ValueError, match="contiguous"):
        int8_gemm(x.t().contiguous().t(), codes, scale)


# ----------------------------------------------------------------------------- GPU (bf16)

# Qwen3-0.6B's projections: qkv (1024 -> 4096), o (2048 -> 1024), gate_up (1024 -> 6144),
# down (3072 -> 1024); decode batches and a prefill.
GPU_SHAPES = [(k, n) for k, n in ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("k, n", GPU_SHAPES, ids=lambda v: str(v))
def test_gpu_bf16_layer_shapes(m, k, n):
    x, codes, scale, b = make_case(m, k, n, torch.bfloat16, seed=m + k + n)
    y = int8_gemm(x, codes, scale, b)
    assert relative_error(y, reference(x, codes, scale, b)) < TOLERANCE[torch.bfloat16]
    # and it agrees with bf16 F.linear on the dequantized weight, to bf16 rounding
    w = (codes.float() * scale[:, None]).to(torch.bfloat16)
    dense = torch.nn.functional.linear(x, w, b)
    assert relative_error(y, dense.double().cpu()) < 2 * TOLERANCE[torch.bfloat16]

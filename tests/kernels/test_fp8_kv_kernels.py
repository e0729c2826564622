"""The Triton fp8 KV-cache paths (chapter 08): ``store_kv`` into an e4m3 cache and
``prefill_attention`` reading it. (The paged decode kernel does not read fp8 yet.)

- ``store_kv`` must store bit for bit what the torch path stores
  (``nanovllm.layers.quantization.kv_cache.quantize_kv``: divide by the scale, saturate at
  +-448, round to nearest even), including ties, subnormals and saturation. Under the
  interpreter this checks ``round_to_e4m3``'s hand rounding (the interpreter's own cast is
  wrong for ~2% of values).
- ``prefill_attention`` over an e4m3 cache with scales must equal the same kernel over a
  cache holding the dequantized values (``codes * scale`` in q's dtype, exact): the scales
  are folded into the softmax scale and the output, so only rounding order differs.
  Tolerance: 1e-5 (fp32), 2e-3 (fp16), relative to the largest output.
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

from nanovllm.kernels.prefill_attention import prefill_attention  # noqa: E402
from nanovllm.kernels.store_kv import store_kv  # noqa: E402
from nanovllm.layers.quantization.kv_cache import quantize_kv  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.37, 3.0)])
def test_store_kv_fp8_is_bit_exact(dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(0)
    n, heads, dim, blocks, bs = 24, 3, 40, 8, 4
    # magnitudes from subnormal (1e-3) to saturating (1e3), plus exact ties of e4m3
    mags = torch.tensor([1e-3, 0.02, 1.0, 10.0, 300.0, 1e3])
    key = torch.randn(n, heads, dim, generator=gen) * mags[torch.arange(n) % 6][:, None, None]
    key[0, 0, :8] = torch.tensor([0.5625, 9.0, 0.01171875, 232.0, -0.5625, -9.0, 464.0, 0.0])
    key, value = key.to(dtype), (key.flip(0) * 0.5).to(dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:n]
    slots[5] = -1  # padding: nothing written
    k_cache = torch.zeros(blocks, bs, heads, dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    args = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    store_kv(*args, k_scale=k_scale, v_scale=v_scale)
    k_cache, v_cache = args[2].cpu(), args[3].cpu()
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    expected_k = quantize_kv(key[keep], k_scale).view(torch.uint8)
    assert torch.equal(flat_k[slots[keep]].view(torch.uint8), expected_k)
    assert torch.equal(flat_v[slots[keep]].view(torch.uint8),
                       quantize_kv(value[keep], v_scale).view(torch.uint8))
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    written[slots[keep]] = True
    assert (flat_k[~written].float() == 0).all()  # untouched, the padding row included


def test_store_kv_refuses_other_fp8_caches():
    key = torch.zeros(2, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.float8_e5m2, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        store_kv(key, key, cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)],
                         ids=["fp32", "fp16"])
def test_prefill_over_an_fp8_cache(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs, blocks = 4, 2, 32, 16, 10
    k_scale, v_scale = 0.25, 2.0
    # two sequences: 20 new tokens after a 13-token prefix; 30 new tokens, no prefix
    q_lens, kv_lens = [20, 30], [33, 30]
    tables = torch.tensor([[3, 7, 1], [9, 0, -1]], dtype=torch.int32)
    k_codes = quantize_kv(torch.randn(blocks, bs, kv_heads, dim, generator=gen) * 4, k_scale)
    v_codes = quantize_kv(torch.randn(blocks, bs, kv_heads, dim, generator=gen), v_scale)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    meta = [t.to(DEVICE) for t in (cu, lens, tables)]
    out = prefill_attention(q.to(DEVICE), k_codes.to(DEVICE), v_codes.to(DEVICE), *meta,
                            dim**-0.5, max(q_lens), k_scale=k_scale, v_scale=v_scale)
    k_values = (k_codes.float() * k_scale).to(dtype)  # exact: e4m3 x a power of two
    v_values = (v_codes.float() * v_scale).to(dtype)
    expected = prefill_attention(q.to(DEVICE), k_values.to(DEVICE), v_values.to(DEVICE), *meta,
                                 dim**-0.5, max(q_lens))
    err = (out.double() - expected.double()).abs().max() / expected.double().abs().max()
    assert err.item() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bf16_store_and_prefill_fp8():
    test_store_kv_fp8_is_bit_exact(torch.bfloat16, 0.37, 3.0)
    test_prefill_over_an_fp8_cache(torch.bfloat16, 1e-2)

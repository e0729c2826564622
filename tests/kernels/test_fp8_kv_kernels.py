"""The Triton fp8 KV-cache paths (chapter 08): ``store_kv`` into an e4m3 cache, and
``prefill_attention`` and the paged ``decode_attention`` reading it.

- ``store_kv`` must store bit for bit what the torch path stores
  (``nanovllm.layers.quantization.kv_cache.quantize_kv``: divide by the scale, saturate at
  +-448, round to nearest even), including ties, subnormals and saturation. Under the
  interpreter this checks ``round_to_e4m3``'s hand rounding (the interpreter's own cast is
  wrong for ~2% of values).
- ``prefill_attention`` over an e4m3 cache with scales must equal the same kernel over a
  cache holding the dequantized values (``codes * scale`` in q's dtype, exact): the scales
  are folded into the softmax scale and the output, so only rounding order differs.
  Tolerance: 1e-5 (fp32), 2e-3 (fp16), relative to the largest output.
- ``decode_attention`` over an e4m3 cache with scales (GQA, one split and several, so the
  split partials and their merge carry ``v_scale``) against float64 attention over the
  dequantized values ``codes * scale``: the kernel widens the codes exactly, so only the
  rounding of its own arithmetic remains. Tolerance as for 16-bit caches: 1e-5 (fp32 q),
  2e-3 (fp16 q), relative error of the whole output.
- the engine on the ``triton`` backend with ``kv_cache_dtype="fp8"`` (tiny random Llama,
  fp32, a cached prefix so a step mixes decode and prefill rows) against the ``torch``
  backend with the same fp8 cache: the same greedy tokens; the first layer's cache (whose
  keys and values do not depend on attention) bit for bit the same, the later layers' within
  one e4m3 step (their inputs differ by the backends' rounding).
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

from nanovllm.kernels.decode_attention import decode_attention  # noqa: E402
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


def reference_decode(q, k_values, v_values, seq_lens, block_tables, scale):
    """float64 paged decode attention over (dequantized) caches, one sequence at a time."""
    batch, num_heads, _ = q.shape
    block_size, num_kv_heads = k_values.shape[1], k_values.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b].long()[t // block_size]
        k = k_values[blocks, t % block_size].double().repeat_interleave(group, dim=1)
        v = v_values[blocks, t % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)],
                         ids=["fp32", "fp16"])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.25, 3.0)])
def test_decode_over_an_fp8_cache(dtype, tol, k_scale, v_scale):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, bs, blocks = 6, 2, 32, 16, 12  # GQA group 3
    lens = [1, 20, 77]  # one key; a partial second block; five blocks, the last partial
    tables = torch.tensor([[5, -1, -1, -1, -1, -1],
                           [11, 2, -1, -1, -1, -1],
                           [0, 9, 3, 7, 10, -1]], dtype=torch.int32)
    # keys up to ~+-20 (SmolLM2's largest is 18.6), values ~+-4: codes span e4m3's range
    k_codes = quantize_kv(torch.randn(blocks, bs, kv_heads, dim, generator=gen) * 5, k_scale)
    v_codes = quantize_kv(torch.randn(blocks, bs, kv_heads, dim, generator=gen), v_scale)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference_decode(q, k_codes.double() * k_scale, v_codes.double() * v_scale,
                                seq_lens, tables, dim**-0.5)
    args = [t.to(DEVICE) for t in (q, k_codes, v_codes, seq_lens, tables)]
    for num_splits in (1, 3):
        out = decode_attention(*args, dim**-0.5, num_splits, k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == dtype and torch.isfinite(out).all()
        err = ((out.cpu().double() - expected).norm() / expected.norm()).item()
        assert err < tol, (num_splits, err)


def test_decode_refuses_other_8bit_caches():
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.float8_e5m2, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        decode_attention(q, cache, cache, lens, table, 1.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-fp8kv")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_engine_triton_fp8_kv_matches_torch_fp8_kv(tiny_llama):
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.fused import set_fused_kernels

    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 19, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    tokens, caches = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama, attention_backend=backend, kv_cache_dtype="fp8", dtype="float32",
                  device=DEVICE, max_num_batched_tokens=48, num_kv_blocks=24,
                  enforce_eager=True)
        runner = llm.engine.runner
        assert runner.backend.name == backend and runner.kv_cache.dtype == FP8
        # On a GPU the triton backend also fuses norm and RoPE (chapter 11), whose fp32 results
        # differ from torch's in the last bits, and an e4m3 rounding boundary can amplify
        # that into a different byte: compare the caches' stores on the same keys.
        set_fused_kernels(runner.model, False)
        llm.generate([shared + [1]], greedy, use_tqdm=False)  # cache the shared prefix
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert llm.engine.block_manager.hit_tokens > 0  # a step mixed decodes and prefills
        caches[backend] = runner.kv_cache.cpu()
    assert tokens["triton"] == tokens["torch"]
    # [K/V, layer, ...]: layer 0's keys and values come straight from the embeddings
    first = caches["torch"][:, 0].view(torch.uint8)
    assert torch.equal(caches["triton"][:, 0].view(torch.uint8), first)
    torch.testing.assert_close(caches["triton"].float(), caches["torch"].float(),
                               rtol=0.13, atol=2**-9)  # at most one e4m3 step apart


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bf16_store_and_prefill_fp8():
    test_store_kv_fp8_is_bit_exact(torch.bfloat16, 0.37, 3.0)
    test_prefill_over_an_fp8_cache(torch.bfloat16, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.25, 3.0)])
def test_gpu_bf16_decode_fp8(k_scale, v_scale):
    test_decode_over_an_fp8_cache(torch.bfloat16, 1e-2, k_scale, v_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bf16_engine_fp8_kv_cuda_graphs(tiny_llama):
    """bf16 on the GPU, CUDA graphs on for Triton: the Triton backend over an fp8 cache and
    the torch backend over the same cache give logprobs-close greedy runs (vLLM's check:
    equal tokens up to the first divergence, where each run's token is in the other's top 5;
    bf16 rounding differs between the backends, so a near tie may flip)."""
    from nanovllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 40, 100, 17)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama, attention_backend=backend, kv_cache_dtype="fp8", dtype="bfloat16",
                  device="cuda", num_kv_blocks=256)
        runner = llm.engine.runner
        assert runner.kv_cache.dtype == FP8
        assert (runner.graphs is not None) == (backend == "triton")
        outputs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for ref, cand in zip(outputs["torch"], outputs["triton"]):
        for pos, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids)):
            if a != b:
                assert a in cand.logprobs[pos] and b in ref.logprobs[pos], (pos, a, b)
                break

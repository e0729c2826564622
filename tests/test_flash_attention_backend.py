"""The ``flash_attn`` backend (FlashAttention-4, ``nanovllm/layers/flash_attention.py``).

On any machine: the construction-time errors (CPU device, a GPU below Hopper, the package
missing, float32, fp8 KV, small blocks), the arguments it passes (views of the step's
metadata) and, through a stand-in ``flash_attn.cute`` written from flash-attn-4's documented
semantics, that those arguments describe the same attention as the torch reference.

On a Hopper-or-newer GPU with flash-attn-4 installed (``-m gpu``): the real kernels against a
float32 reference (bf16, GQA, the engine's block sizes, windows), inside a CUDA graph, without
host syncs, and an engine with random Qwen3-0.6B-shaped weights against the Triton backend.
"""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nanovllm.benchmarks.attention_backends import paged_case
from nanovllm.config import EngineConfig
from nanovllm.configs import config_path
from nanovllm.context import AttentionMetadata
from nanovllm.layers import flash_attention, torch_attention
from nanovllm.layers.attention_backends import resolve_backend_name
from nanovllm.layers.flash_attention import FlashAttnBackend, varlen_kwargs

QWEN3 = str(config_path("qwen3-0.6b"))


def settings(dtype="bfloat16", block_size=16, kv_cache_dtype="auto"):
    """What ``FlashAttnBackend.check`` reads of an ``EngineConfig``."""
    return types.SimpleNamespace(attention_backend="flash_attn", dtype=dtype,
                                 block_size=block_size, kv_cache_dtype=kv_cache_dtype)


def _gpu(monkeypatch, capability=(9, 0), installed=True):
    """Pretend to be a CUDA machine with ``capability`` and (not) the packages."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    real = flash_attention.importlib.util.find_spec
    monkeypatch.setattr(
        flash_attention.importlib.util, "find_spec",
        lambda name, *a: (object() if installed else None) if name == "flash_attn.cute"
        else real(name, *a),
    )


# -- construction-time errors (CPU) ---------------------------------------------------------

def test_cpu_device_is_refused():
    assert "CUDA GPUs only" in FlashAttnBackend.check(settings("float32"), torch.device("cpu"))
    with pytest.raises(ValueError, match="flash-attn"):  # as tests/test_validation.py expects
        EngineConfig(model=QWEN3, device="cpu", attention_backend="flash_attn")


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0)])
def test_gpus_without_paged_kernels_are_refused(monkeypatch, capability):
    _gpu(monkeypatch, capability)
    with pytest.raises(ValueError, match=rf"compute capability.*has {capability[0]}\."):
        EngineConfig(model=QWEN3, device="cuda", attention_backend="flash_attn")


def test_missing_package_names_the_install_command(monkeypatch):
    _gpu(monkeypatch, installed=False)
    with pytest.raises(ValueError, match=r"pip install --pre flash-attn-4"):
        EngineConfig(model=QWEN3, device="cuda", attention_backend="flash_attn")


def test_missing_parent_package_counts_as_missing(monkeypatch):
    def find_spec(name, *args):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(flash_attention.importlib.util, "find_spec", find_spec)
    assert not flash_attention.package_installed("flash_attn.cute")


def test_import_failure_at_build_time_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    with pytest.raises(ValueError, match="flash-attn-4"):
        FlashAttnBackend()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float32"}, "float16 or bfloat16 only"),
        ({"kv_cache_dtype": "fp8"}, "fp8 KV cache"),
        ({"block_size": 8}, "block_size 8"),
    ],
)
def test_unsupported_settings_are_refused(monkeypatch, kwargs, message):
    _gpu(monkeypatch)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=QWEN3, device="cuda", attention_backend="flash_attn", **kwargs)


def test_a_hopper_with_the_package_is_accepted_and_auto_stays_triton(monkeypatch):
    _gpu(monkeypatch)
    for block_size in (16, 128, 256):
        config = EngineConfig(
            model=QWEN3, device="cuda", attention_backend="flash_attn", block_size=block_size
        )
        assert (config.dtype, config.attention_backend) == ("bfloat16", "flash_attn")
    assert resolve_backend_name("auto", "cuda") == "triton"


def test_building_it_for_an_fp8_cache_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        FlashAttnBackend("fp8")


# -- the arguments, and what they mean (CPU) ------------------------------------------------

def test_arguments_are_views_of_the_step_metadata():
    gen = torch.Generator().manual_seed(0)
    _, _, _, (meta,) = paged_case([1, 1, 40], [9, 30, 70], 16, gen, device="cpu",
                                  dtype=torch.float32)
    kwargs = varlen_kwargs(meta, 0.1, window=None)
    assert kwargs["page_table"] is meta.block_tables and kwargs["seqused_k"] is meta.seq_lens_k
    assert kwargs["cu_seqlens_q"] is meta.cu_seqlens_q
    for name in ("page_table", "seqused_k", "cu_seqlens_q"):
        assert kwargs[name].dtype == torch.int32 and kwargs[name].stride(-1) == 1
    assert kwargs["page_table"].shape == (3, 5) and kwargs["max_seqlen_q"] == 40
    assert kwargs["causal"] and kwargs["num_splits"] == 1
    assert kwargs["window_size"] == (None, None)
    assert varlen_kwargs(meta, 0.1, window=7)["window_size"] == (6, 0)  # 7 keys, own included
    with pytest.raises(ValueError, match="window"):
        varlen_kwargs(meta, 0.1, window=0)


def fake_varlen_func(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table,
                     softmax_scale, causal, window_size, num_splits):
    """flash-attn-4's documented semantics, written plainly: paged K/V read through
    ``page_table`` for ``seqused_k`` tokens, causal aligned bottom-right, ``window_size =
    (left, right)`` keys around the diagonal; returns ``(out, lse)``. Keyword-only, with the
    real function's parameter names, so a misspelled argument fails here too."""
    assert causal and num_splits == 1 and window_size[1] in (0, None)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, n_k in enumerate(seqused_k.tolist()):
        pages = page_table[b, : -(-n_k // k.shape[1])].long()
        keys, values = k[pages].flatten(0, 1)[:n_k], v[pages].flatten(0, 1)[:n_k]
        rows = q[cu[b] : cu[b + 1]]
        assert len(rows) <= max_seqlen_q
        diag = torch.arange(n_k - len(rows), n_k)[:, None]  # bottom-right alignment
        cols = torch.arange(n_k)[None, :]
        mask = cols <= diag
        if window_size[0] is not None:
            mask &= cols >= diag - window_size[0]
        out[cu[b] : cu[b + 1]] = F.scaled_dot_product_attention(
            rows.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=softmax_scale, enable_gqa=True,
        ).transpose(0, 1)
    return out, None


@pytest.mark.parametrize("window", [None, 5, 40])
def test_the_arguments_describe_the_reference_attention(monkeypatch, window):
    """Decodes, a whole prompt and a chunk after a cached prefix (a prefix-cache hit), GQA."""
    cute = types.SimpleNamespace(flash_attn_varlen_func=fake_varlen_func)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    backend = FlashAttnBackend()
    assert backend.name == "flash_attn"
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, (meta,) = paged_case(
        [1, 1, 23, 9], [1, 37, 23, 50], 4, gen, shape=(6, 2, 8), dtype=torch.float32,
        device="cpu",
    )
    out = backend.attend(q, k_cache, v_cache, meta, 0.3, window=window)
    expected = torch_attention.attend(q, k_cache, v_cache, meta, 0.3, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# -- on a GPU: the real kernels and the engine ----------------------------------------------

def _flash_attn_runs() -> bool:
    if not torch.cuda.is_available():
        return False
    return FlashAttnBackend.check(settings(), torch.device("cuda")) is None


needs_flash_attn = pytest.mark.skipif(
    not _flash_attn_runs(), reason="needs flash-attn-4 on a Hopper or newer GPU"
)
# bf16 inputs, float32 reference on the same bf16 values: the kernel rounds P to bf16 before
# P V and its output to bf16 (2**-8 relative), so errors stay near 1e-2 for outputs of
# magnitude ~1 (q, k, v ~ N(0, 1)); a wrong mask or page is off by O(1).
MAX_ABS_ERR, MAX_REL_ERR = 2e-2, 1e-2
# a packed step: three decodes, a whole prompt, two chunks after cached prefixes
Q_LENS, K_LENS = [1, 1, 1, 200, 64, 130], [1, 300, 1000, 200, 700, 517]


def _reference(q, k_cache, v_cache, meta, scale, window=None):
    return torch_attention.attend(
        q.float(), k_cache.float(), v_cache.float(), meta, scale, window=window
    )


def _assert_close(out, ref, what=""):
    err = (out.float() - ref).abs().max().item()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < MAX_ABS_ERR and rel < MAX_REL_ERR, f"{what}: max abs {err:.3g}, rel {rel:.3g}"


def _decode_meta(lengths: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """Metadata of a decode-only step over existing block tables."""
    n, device = len(lengths), tables.device
    return AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens_k=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=tables, max_seqlen_q=1, max_seqlen_k=max(lengths), num_decodes=n,
        cu_seqlens_q_host=list(range(n + 1)), seq_lens_k_host=list(lengths),
    )


QWEN3_SHAPE, SMOLLM2_SHAPE = (16, 8, 128), (9, 3, 64)  # (heads, KV heads, head_dim)


# Each (head_dim, TMA page or not, window) compiles its own kernels (seconds each): the
# grid covers pages of 16/256 (cp.async) and 128 (TMA), with and without a window (Mistral:
# head_dim 128), and SmolLM2's 3-way GQA at head_dim 64 (query heads not a tile multiple).
@pytest.mark.parametrize(
    "shape, block_size, window",
    [(QWEN3_SHAPE, bs, None) for bs in (16, 128, 256)]
    + [(QWEN3_SHAPE, bs, 100) for bs in (16, 128)]
    + [(SMOLLM2_SHAPE, 16, None)],
)
@pytest.mark.gpu
@needs_flash_attn
def test_kernels_match_float32_reference(shape, block_size, window):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    q, k_cache, v_cache, (meta,) = paged_case(Q_LENS, K_LENS, block_size, gen, shape=shape)
    heads, kv_heads, head_dim = shape
    # q as the engine's fused path hands it over: a strided view of the packed q/k/v rows
    qkv = torch.cat([q.flatten(1), torch.zeros_like(q[:, : 2 * kv_heads].flatten(1))], 1)
    q = qkv[:, : heads * head_dim].view(q.shape)
    assert not q.is_contiguous()
    scale = head_dim**-0.5
    backend = FlashAttnBackend()
    out = backend.attend(q, k_cache, v_cache, meta, scale, window=window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    _assert_close(out, _reference(q, k_cache, v_cache, meta, scale, window), "mixed step")
    n = meta.num_decodes  # the decodes alone, as a graphed decode step runs them
    dmeta = _decode_meta(K_LENS[:n], meta.block_tables[:n])
    out = backend.attend(q[:n], k_cache, v_cache, dmeta, scale, window=window)
    _assert_close(out, _reference(q[:n], k_cache, v_cache, dmeta, scale, window), "decodes")


@pytest.mark.gpu
@needs_flash_attn
def test_decode_replays_in_a_cuda_graph_with_padding_rows():
    """As DecodeGraphs runs it: static buffers refilled between replays, rows past the
    batch of length 0 whose block tables are stale or -1."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    bucket, width = 8, 64
    q, k_cache, v_cache, (meta,) = paged_case([1] * bucket, [16 * width] * bucket, 16, gen)
    backend = FlashAttnBackend()
    backend.attend(q, k_cache, v_cache, meta, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, k_cache, v_cache, meta, 0.1)
    for step, lengths in enumerate([[40, 1000, 333], [17, 2, 900, 64, 511]]):
        n = len(lengths)
        meta.seq_lens_k[:n] = torch.tensor(lengths, dtype=torch.int32)
        meta.seq_lens_k[n:] = 0  # padding rows attend to nothing
        blocks = torch.randperm(k_cache.shape[0], generator=gen, device="cuda")
        meta.block_tables.copy_(blocks[: bucket * width].view(bucket, width))
        meta.block_tables[n:, step::2] = -1
        graph.replay()
        ref_meta = _decode_meta(lengths, meta.block_tables[:n].clone())
        _assert_close(out[:n], _reference(q[:n], k_cache, v_cache, ref_meta, 0.1), f"replay {step}")


@pytest.mark.gpu
@needs_flash_attn
def test_a_step_makes_no_host_sync():
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k_cache, v_cache, (meta,) = paged_case(Q_LENS, K_LENS, 16, gen)
    backend = FlashAttnBackend()
    backend.attend(q, k_cache, v_cache, meta, 0.1)  # compile first
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.attend(q, k_cache, v_cache, meta, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def qwen3_shaped(tmp_path_factory):
    """Qwen3-0.6B's shape with 4 of its 28 layers, random (dummy) bf16 weights."""
    config = json.loads((config_path("qwen3-0.6b") / "config.json").read_text())
    config["num_hidden_layers"] = 4
    folder = tmp_path_factory.mktemp("qwen3-shaped")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# The first token where two correct bf16 backends part must be a near-tie for the reference:
# its top-2 logprobs closer than this (their logits differ by ~1e-2 at most, see the kernels'
# tolerance, times the depth); a real bug shows up as a mismatch on a clear winner.
NEAR_TIE = 0.1
SAME_TOKEN_LOGPROB_TOL = 0.05


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.gpu
@needs_flash_attn
def test_engine_greedy_tokens_agree_with_triton(qwen3_shaped, block_size):
    from nanovllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(block_size)
    draw = lambda n: torch.randint(0, 10000, (n,), generator=gen).tolist()  # noqa: E731
    first = [draw(n) for n in (5, 150, 333, 600)]
    # round two extends round one's prompts (prefix-cache hits, then chunks after them)
    second = [first[1] + draw(40), first[2] + draw(1), first[3] + draw(300), draw(9)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    runs = {}
    for name in ("triton", "flash_attn"):
        llm = LLM(qwen3_shaped, load_format="dummy", attention_backend=name,
                  block_size=block_size, num_kv_blocks=8192 // block_size * 16,
                  max_num_seqs=16, max_num_batched_tokens=256)  # 256: chunked prefill
        runner = llm.engine.runner
        assert runner.backend.name == name and runner.graphs is not None
        outs = llm.generate(first, params, use_tqdm=False)
        outs += llm.generate(second, params, use_tqdm=False)
        assert all(o.metrics.num_cached_prompt_tokens > 0 for o in outs[len(first):-1])
        runs[name] = [o.outputs[0] for o in outs]
        llm.shutdown()
        del llm, runner
        torch.cuda.empty_cache()
    equal = total = 0
    for ref, got in zip(runs["triton"], runs["flash_attn"]):
        total += len(ref.token_ids)
        for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:
                top = sorted(ref.logprobs[i].values(), key=lambda lp: lp.rank)
                gap = top[0].logprob - top[1].logprob
                assert gap < NEAR_TIE, f"diverged at token {i} on a clear winner (gap {gap:.3f})"
                break
            equal += 1
            assert math.isclose(ref.logprobs[i][a].logprob, got.logprobs[i][b].logprob,
                                abs_tol=SAME_TOKEN_LOGPROB_TOL)
    print(f"\nflash_attn vs triton, block_size {block_size}: {equal}/{total} greedy tokens "
          f"equal before each sequence's first divergence ({equal / total:.1%})")

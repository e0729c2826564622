"""Qwen2 (QKV bias) and Mistral (sliding window) against transformers (chapter 12).

Tiny random models, fp32 on CPU: logits within 1e-4 of transformers' and greedy tokens equal,
with prompts longer than Mistral's window; Mistral also under chunked prefill (chunks of 16
tokens) and under preemption (a KV budget too small for the batch), with and without
prefix caching. The torch attention backend's window is what these tests exercise; the
Triton kernels' window is checked against it in tests/kernels/test_window_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from course_ids import ENGINE, MODEL

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.models import ModelConfig, get_model_class, supported_architectures
from nanovllm.weights.loader import load_safetensors

transformers = pytest.importorskip("transformers")

WINDOW = 12
# The assignment ids each architecture's runs reach (nanovllm/course): Mistral's windowed
# attention replaces causal/paged/decode attention, so its runs grade the window instead.
MISTRAL_MODEL = ("01.rmsnorm", "01.rope", "12.sliding_window")
MISTRAL_ENGINE = MISTRAL_MODEL + tuple(
    i for i in ENGINE if i not in MODEL and i not in ("02.paged_attention", "03.decode_attention"))


def _archs(qwen2_ids: tuple[str, ...], mistral_ids: tuple[str, ...]) -> list:
    return [pytest.param("Qwen2ForCausalLM", marks=pytest.mark.assignment(*qwen2_ids)),
            pytest.param("MistralForCausalLM", marks=pytest.mark.assignment(*mistral_ids))]


def _tiny_hf_model(arch: str, path):
    common = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if arch == "Qwen2ForCausalLM":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    else:
        config = transformers.MistralConfig(**common, head_dim=32, sliding_window=WINDOW,
                                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # randomise norms and biases, so a missing one cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, _tiny_hf_model(request.param, path), path


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MistralForCausalLM"])
def test_registered_and_configured(arch, tmp_path):
    path = tmp_path
    _tiny_hf_model(arch, path)
    assert arch in supported_architectures()
    cfg = ModelConfig.from_pretrained(path)
    if arch == "Qwen2ForCausalLM":  # the bias is the architecture's, and its window is off
        assert cfg.sliding_window is None and not cfg.attention_bias
        model = get_model_class(arch)(cfg)
        attn = model.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    else:
        assert cfg.sliding_window == WINDOW


@pytest.mark.parametrize("tiny", _archs(MODEL, MISTRAL_MODEL), indirect=True)
def test_logits_match_transformers(tiny):
    arch, hf, path = tiny
    cfg = ModelConfig.from_pretrained(path)
    ours = get_model_class(arch)(cfg)
    load_safetensors(ours, path)
    n = 5 * WINDOW + 3
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(n)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4


PREEMPT = pytest.mark.assignment("06.preempt")


@pytest.mark.parametrize("tiny", _archs(ENGINE, MISTRAL_ENGINE), indirect=True)
@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=16),  # chunked prefill: chunks shorter than the prompts
    pytest.param(dict(num_kv_blocks=12, enable_prefix_caching=False), marks=PREEMPT),
    pytest.param(dict(num_kv_blocks=12, enable_prefix_caching=True), marks=PREEMPT),
], ids=["plain", "chunked", "preempt", "preempt-prefix-cache"])
def test_engine_greedy_matches_transformers(tiny, options):
    arch, hf, path = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 29, 41, 60)]
    if arch == "MistralForCausalLM" and "num_kv_blocks" in options:
        options = dict(options, num_kv_blocks=6)  # its window frees blocks: 12 never run out
    llm = LLM(path, block_size=16, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == expected[0, len(prompt):].tolist()


@pytest.mark.assignment("12.sliding_window")
def test_sliding_window_mask_unit():
    from nanovllm.layers.torch_attention import sliding_window_mask, windowed_attention

    for lq, lk, window in [(1, 1, 1), (5, 5, 1), (7, 7, 3), (4, 20, 6), (1, 30, 8), (9, 9, 50)]:
        mask = sliding_window_mask(lq, lk, window)
        assert mask.shape == (lq, lk) and mask.dtype == torch.bool
        expected = [[lk - lq + i - window < j <= lk - lq + i for j in range(lk)]
                    for i in range(lq)]
        assert mask.tolist() == expected, (lq, lk, window)
    # attention through the mask equals a float64 softmax over each query's window, GQA
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
               for n, h in ((6, 4), (15, 2), (15, 2)))
    out = windowed_attention(q, k, v, 0.3, 4)
    for i in range(6):
        p = 9 + i
        for h in range(4):
            keys = slice(p - 3, p + 1)
            w = torch.softmax(0.3 * k[keys, h // 2] @ q[i, h], 0)
            torch.testing.assert_close(out[i, h], w @ v[keys, h // 2])


def test_qwen2_with_a_used_window_is_refused(tmp_path):
    import json

    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "use_sliding_window": True, "sliding_window": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_pretrained(tmp_path)

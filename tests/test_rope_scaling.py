"""RoPE scaling (nanovllm/layers/rotary.py, chapter 12) against transformers.

1. Frequencies and attention factor equal to ``transformers.modeling_rope_utils
   .ROPE_INIT_FUNCTIONS`` for linear, llama3, dynamic NTK (at the engine's maximum length: the
   engine's documented choice) and YaRN, configs spelled as transformers 5 (``rope_parameters``)
   and 4 (``rope_scaling`` + ``rope_theta``) write them.
2. Tiny random Llamas with each scaling: logits within 1e-4 of transformers' and greedy tokens
   equal, for prompts longer than the original (trained) context. Dynamic NTK's greedy run is
   compared with our own model decoding without a cache (transformers changes its frequencies
   with the length; its logits are compared at the engine's length, where they agree).
"""

from __future__ import annotations

import pytest
import torch
from course_ids import ENGINE, MODEL

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inverse_frequencies
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.weights.loader import load_safetensors

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

ORIGINAL = 32  # the tiny models' "trained" context
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": ORIGINAL},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "truncate": False, "original_max_position_embeddings": ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def _hf_config(scaling: dict, head_dim: int = 32, theta: float = 10000.0, **kw):
    # yarn and llama3 configs state the extended length; linear and dynamic the trained one
    max_pos = ORIGINAL if scaling["rope_type"] in ("linear", "dynamic") else 4 * ORIGINAL
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters={**scaling, "rope_theta": theta},
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        architectures=["LlamaForCausalLM"], **kw,
    )


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim, theta", [(32, 1e4), (128, 5e5)])
def test_frequencies_and_attention_factor_equal_transformers(name, head_dim, theta):
    hf_config = _hf_config(dict(SCALINGS[name]), head_dim, theta)
    ours = ModelConfig.from_dict(hf_config.to_dict())
    inv_freq = rope_inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling,
                                        ours.max_position_embeddings)
    kind = SCALINGS[name]["rope_type"]
    # dynamic: the frequencies transformers computes for a sequence of the engine's length
    seq_len = ours.max_position_embeddings if kind == "dynamic" else None
    expected, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=seq_len)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)


def test_transformers4_spelling_reads_the_same():
    scaling = SCALINGS["yarn-mscale"]
    v5 = ModelConfig.from_dict(_hf_config(dict(scaling)).to_dict())
    old = {k: v for k, v in _hf_config(dict(scaling)).to_dict().items() if k != "rope_parameters"}
    v4 = ModelConfig.from_dict({**old, "rope_theta": 1e4, "rope_scaling": {
        **{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "yarn"}})
    assert v4.max_position_embeddings == v5.max_position_embeddings == 8 * ORIGINAL
    assert torch.equal(
        rope_inverse_frequencies(32, v4.rope_theta, v4.rope_scaling),
        rope_inverse_frequencies(32, v5.rope_theta, v5.rope_scaling),
    )


def test_served_length_and_bad_scaling():
    for kind, length in (("linear", 4 * ORIGINAL), ("dynamic", 4 * ORIGINAL),
                         ("yarn", 4 * ORIGINAL), ("llama3", 4 * ORIGINAL)):
        assert ModelConfig.from_dict(_hf_config(dict(SCALINGS[kind])).to_dict()
                                     ).max_position_embeddings == length
    base = {k: v for k, v in _hf_config(dict(SCALINGS["linear"])).to_dict().items()
            if k != "rope_parameters"}
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="needs a 'factor'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "linear"}})


def test_yarn_attention_factor_is_in_the_tables():
    """The Triton RoPE kernel reads rope.cos/rope.sin, so the factor must live in them."""
    scaling = {**SCALINGS["yarn"]}
    plain = RotaryEmbedding(32, 128, 1e4, {**scaling, "attention_factor": 1.0})
    yarn = RotaryEmbedding(32, 128, 1e4, scaling)
    gain = rope_attention_factor(scaling)
    assert gain == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    torch.testing.assert_close(yarn.cos, plain.cos * gain)
    torch.testing.assert_close(yarn.sin, plain.sin * gain)


def _tiny(name: str, path):
    config = _hf_config(dict(SCALINGS[name]))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # randomise the norms too
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=["linear", "dynamic", "yarn", "llama3"], scope="module")
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, _tiny(request.param, path), path


@pytest.mark.assignment(*MODEL)
def test_logits_match_transformers_beyond_the_trained_length(tiny):
    name, hf, path = tiny
    cfg = ModelConfig.from_pretrained(path)
    ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, path)
    # 4 x the trained length: for dynamic NTK, transformers then uses exactly the frequencies
    # of the engine's maximum length (the engine's fixed choice; chapter 12 §3)
    n = cfg.max_position_embeddings
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(n)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.assignment(*ENGINE)
def test_engine_greedy_matches_transformers_beyond_the_trained_length(tiny):
    name, hf, path = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 77, 100)]
    llm = LLM(path, block_size=16, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        if name == "dynamic":  # transformers re-derives dynamic NTK per length (chapter 12 §3):
            expected = _greedy_without_cache(path, prompt, 10)  # our fixed-frequency model
        else:
            with torch.no_grad():
                expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected = expected[0, len(prompt):].tolist()
        assert out.token_ids == expected


def _greedy_without_cache(path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by a whole forward pass per token: no KV cache, no paging."""
    cfg = ModelConfig.from_pretrained(path)
    model = get_model_class(cfg.architecture)(cfg)
    load_safetensors(model, path)
    ids = list(prompt)
    with torch.no_grad(), attention_metadata(None):
        for _ in range(n):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]

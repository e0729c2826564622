"""Qwen3-MoE and Mixtral against transformers (chapter 16).

Tiny random models saved with ``save_pretrained`` (per-expert tensors, stacked at load), fp32
on CPU: logits within 1e-4 of transformers' and greedy tokens through ``LLM.generate`` equal
to ``generate``'s. The Qwen3-MoE model mixes sparse and dense layers (``mlp_only_layers``) and
is run with and without ``norm_topk_prob``. The router weights are drawn larger than
transformers' init so that no token sits on a near-tie between two experts.
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

ROUTE = ("16.route",)
VARIANTS = {  # name -> (architecture, extra config)
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3moe-unnormalized": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", dict(sliding_window=None)),
}


def tiny_moe_model(variant: str, path, seed: int = 0):
    """Save a tiny random Hugging Face MoE model of ``variant`` in ``path``; return it."""
    arch, extra = VARIANTS[variant]
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  num_experts_per_tok=2, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    if arch == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(**common, **extra, num_experts=8,
                                             moe_intermediate_size=32, intermediate_size=96)
    else:
        config = transformers.MixtralConfig(**common, **extra, num_local_experts=4,
                                            intermediate_size=48)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # the router: decisive scores
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, tiny_moe_model(request.param, path), path


def test_registered_and_configured(tmp_path):
    tiny_moe_model("qwen3moe", tmp_path)
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= set(supported_architectures())
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2 and cfg.moe.intermediate_size == 32
    assert cfg.moe.renormalize and cfg.moe.sparse_layers == (True, False, True)
    model = get_model_class(cfg.architecture)(cfg)
    layers = model.model.layers
    assert layers[0].mlp.experts.w13.weight.shape == (8, 64, 64)
    assert layers[0].mlp.experts.w2.weight.shape == (8, 64, 32)
    assert layers[1].mlp.gate_up_proj.weight.shape == (192, 64)  # the dense layer


@pytest.mark.assignment(*MODEL, *ROUTE)
@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral"])
def test_transformers_in_memory_layout_loads_too(variant, tmp_path):
    """Fused experts (``experts.gate_up_proj`` [E, 2I, H]), as transformers 5 holds them."""
    from safetensors.torch import save_file

    hf = tiny_moe_model(variant, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              tmp_path / "model.safetensors")
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, tmp_path)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(9)))
        assert (logits - hf(ids[None]).logits[0]).abs().max() <= 1e-4


def test_dense_only_config_is_refused_as_moe():
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_experts": 0}
    with pytest.raises(ValueError, match="names no experts"):
        get_model_class("Qwen3MoeForCausalLM")(ModelConfig.from_dict(cfg))
    cfg.update(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(cfg)


@pytest.mark.assignment(*MODEL, *ROUTE)
@pytest.mark.parametrize("tiny", list(VARIANTS), indirect=True)
def test_logits_match_transformers(tiny):
    _, hf, path = tiny
    cfg = ModelConfig.from_pretrained(path)
    ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, path)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(37)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.assignment(*ENGINE, *ROUTE)
@pytest.mark.parametrize("tiny", list(VARIANTS), indirect=True)
def test_engine_greedy_matches_transformers(tiny):
    _, hf, path = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    llm = LLM(path, block_size=16, max_num_batched_tokens=32)  # chunked prefill too
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, 12)

"""Tiny random Llama and Qwen3 models: our logits equal transformers' (fp32, CPU).

Tolerance: max |ours - theirs| <= 1e-4 on logits of order 1, i.e. fp32 rounding noise
from a different order of operations, far below any real bug.
"""

from __future__ import annotations

import pytest
import torch
from course_ids import ENGINE, MODEL

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.weights.loader import load_safetensors

TOLERANCE = 1e-4

CASES = {
    # name: (architecture, heads, kv heads, head dim, hidden)
    "llama-gqa3-d64": ("LlamaForCausalLM", 6, 2, 64, 192),
    "llama-mha-d32": ("LlamaForCausalLM", 4, 4, 32, 128),
    "qwen3-gqa2-d128": ("Qwen3ForCausalLM", 4, 2, 128, 256),
    "qwen3-gqa4-d64": ("Qwen3ForCausalLM", 8, 2, 64, 256),
}


def _tiny_hf_model(arch: str, heads: int, kv_heads: int, head_dim: int, hidden: int, path):
    import transformers

    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    config = config_cls(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=(arch == "LlamaForCausalLM"),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # randomise the norms too, so a misplaced norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=list(CASES), scope="module")
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return _tiny_hf_model(*CASES[request.param], path), path


@pytest.mark.assignment(*MODEL)
def test_logits_match_transformers(tiny):
    hf, path = tiny
    cfg = ModelConfig.from_pretrained(path)
    ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, path)
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(37)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= TOLERANCE


@pytest.mark.assignment(*ENGINE)
def test_engine_greedy_matches_transformers(tiny):
    hf, path = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 17, 33, 48)]
    llm = LLM(path, block_size=16, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        assert out.token_ids == expected[0, len(prompt) :].tolist()

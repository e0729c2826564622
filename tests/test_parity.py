"""Greedy outputs equal transformers' token for token on SmolLM2 (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Water boils at",
    "The quick brown fox",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Q: What is 12 times 7?\nA:",
    "The three laws of thermodynamics are",
    "My favourite recipe for pancakes starts with",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "SELECT name, age FROM users WHERE",
    "The mitochondria is",
    "Explain recursion to a five-year-old. " * 6,  # a longer prompt spanning blocks
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _generate(smollm2_dir, **options):
    llm = LLM(smollm2_dir, **options)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_transformers(smollm2_dir, hf_greedy, async_scheduling):
    _, ours = _generate(smollm2_dir, async_scheduling=async_scheduling)
    assert ours == hf_greedy


def test_greedy_matches_transformers_under_preemption(smollm2_dir, hf_greedy):
    # 40 blocks of 16 tokens cannot hold 16 growing sequences at once.
    llm, ours = _generate(
        smollm2_dir, num_kv_blocks=40, enable_prefix_caching=False, async_scheduling=True
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert ours == hf_greedy


def test_greedy_matches_transformers_with_small_chunks(smollm2_dir, hf_greedy):
    llm, ours = _generate(smollm2_dir, max_num_batched_tokens=37)
    assert ours == hf_greedy

"""Prefix caching changes how much is computed, never what is generated (chapter 04)."""

from __future__ import annotations

import pytest
from course_ids import ENGINE

from nanovllm import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, cite no sources, and say "
    "'I don't know' when you are unsure. Keep a friendly tone. "
) * 3
QUESTIONS = [
    "What is 2 + 2?",
    "Name a primary colour.",
    "What is the capital of Italy?",
    "Who wrote Hamlet?",
    "What is H2O?",
    "How many legs has a spider?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# A fixed KV budget: on a GPU the default takes 90% of the free memory, for one engine only.
KV_BLOCKS = 512


def LLM_TOKENIZER(path):  # noqa: N802
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    llm = LLM(smollm2_dir, enable_prefix_caching=False, num_kv_blocks=KV_BLOCKS)
    prompts = [SYSTEM + q for q in QUESTIONS]
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.assignment(*ENGINE)
def test_prefix_caching_gives_identical_outputs_and_hits(smollm2_dir, reference):
    prompts, expected = reference
    llm = LLM(smollm2_dir, enable_prefix_caching=True, num_kv_blocks=KV_BLOCKS)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warm the cache with the shared prefix
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    assert bm.prefix_hit_rate > 0.5
    assert all(o.metrics.num_cached_prompt_tokens > 0 for o in outs)


@pytest.mark.assignment(*ENGINE, "06.preempt")
def test_prefix_caching_under_preemption(smollm2_dir, reference):
    prompts, expected = reference
    # Room for the longest request plus one block: sequences must take turns.
    longest = max(len(ids) for ids in LLM_TOKENIZER(smollm2_dir)(prompts)["input_ids"])
    budget = -(-(longest + GREEDY.max_tokens) // 16) + 1
    llm = LLM(smollm2_dir, enable_prefix_caching=True, num_kv_blocks=budget)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.assignment(*ENGINE)
def test_a_burst_sharing_a_system_prompt_hits_as_well_with_async_scheduling(smollm2_dir):
    """Sixteen requests arrive together. Hashes are registered when a block's computation is
    scheduled, so the fifteen behind the first reuse the system prompt in the very step
    that computes it, with async scheduling as without (it used to get ~40% fewer)."""
    prompts = [SYSTEM + f"Question {i}: what is {i} + {i}?" for i in range(16)]
    ids = LLM_TOKENIZER(smollm2_dir)(prompts)["input_ids"]
    shared = next(i for i, column in enumerate(zip(*ids)) if len(set(column)) > 1)
    ideal = 15 * (shared // 16 * 16)  # every full block of the shared prefix, after the first
    results = {}
    for mode in (False, True):
        llm = LLM(smollm2_dir, async_scheduling=mode, num_kv_blocks=KV_BLOCKS)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        cached = sum(o.metrics.num_cached_prompt_tokens for o in outs)
        results[mode] = cached, [o.token_ids for o in outs]
    assert results[True][1] == results[False][1]
    assert results[True][0] >= results[False][0]
    assert results[True][0] == ideal > 0

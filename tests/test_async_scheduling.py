"""Async scheduling (the CPU plans step n+1 while the device runs step n) changes no output.

On a CPU the overlap itself buys nothing, but the bookkeeping is the same: placeholder
tokens, tokens fed from the previous step's sampler output, stops discovered one step late
and the extra token they computed dropped. Every test runs both modes and compares.
"""

from __future__ import annotations

import pytest
from course_ids import ENGINE
from test_scheduler import (  # noqa: F401
    PRIORITIES,
    PROMPTS,
    _params,
    make_tiny_llama,
    one_torch_thread,
)

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import PLACEHOLDER


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-async"))


def run(path, params, prompts=PROMPTS, **options):
    llm = LLM(path, num_kv_blocks=options.pop("num_kv_blocks", 256), **options)
    priority = PRIORITIES if prompts is PROMPTS else None
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return llm, outs


def both_modes(path, params, **options):
    (_, sync), (llm, overlapped) = (
        run(path, params, async_scheduling=mode, **options) for mode in (False, True)
    )
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert [o.outputs[0].finish_reason for o in overlapped] == [
        o.outputs[0].finish_reason for o in sync
    ]
    assert all(PLACEHOLDER not in o.token_ids for o in overlapped)
    return llm, sync


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 3},
        {"num_kv_blocks": 12, "max_num_batched_tokens": 40},  # preemption
        {"num_kv_blocks": 12, "scheduler_policy": "priority", "enable_prefix_caching": False},
        {"max_model_len": 72},  # the longest prompt stops at the model length
    ],
    ids=["default", "chunks-of-3", "preemption", "priority-preemption", "max-model-len"],
)
@pytest.mark.assignment(*ENGINE)
def test_async_equals_sync(tiny, options):
    llm, sync = both_modes(tiny, _params(24), **options)
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if "max_model_len" in options:
        assert {o.outputs[0].finish_reason for o in sync} == {"length"}
        assert any(len(o.token_ids) < 24 for o in sync)


@pytest.mark.assignment(*ENGINE)
def test_stops_found_one_step_late_drop_the_extra_token(tiny):
    _, reference = run(tiny, _params(24), async_scheduling=False)
    # Stop each request at a token it generates mid-way: async learns of it a step late.
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out.token_ids[5]])
        for out in reference
    ]
    _, outs = both_modes(tiny, params)
    for out, ref in zip(outs, reference):
        stop = ref.token_ids[5]
        assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1]
        assert out.outputs[0].finish_reason == "stop"


def test_seeded_sampling_is_identical(tiny):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=16) for i in range(8)]
    both_modes(tiny, params)


def test_stop_strings_with_a_tokenizer(tmp_path, smollm2_dir):
    path = make_tiny_llama(tmp_path / "tiny-text", tokenizer_dir=smollm2_dir)
    _, reference = run(path, _params(16), async_scheduling=False)
    text = reference[3].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [SamplingParams(temperature=0, max_tokens=16, stop=[stop]) for _ in PROMPTS]
    _, outs = both_modes(path, params)
    assert outs[3].outputs[0].finish_reason == "stop"
    assert stop not in outs[3].outputs[0].text


def test_abort_while_a_step_is_in_flight(tiny):
    llm = LLM(tiny, num_kv_blocks=256, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    seq = engine.requests[ids[0]]
    [out] = engine.abort_request(ids[0])
    assert out.finish_reason == "abort" and out.new_token_ids == []
    assert seq.finish_reason == "abort" and PLACEHOLDER not in seq.token_ids
    assert engine.abort_request(ids[0]) == []  # over already
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != ids[0] and PLACEHOLDER not in out.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

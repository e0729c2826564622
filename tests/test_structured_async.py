"""Structured output under async scheduling (chapter 15, ``structured_output/masks.py``): a
step with a constrained request stays in the pipeline (its sampling waits for the step in
flight, its forward pass does not), greedy tokens equal the synchronous run's, a workload with
no constrained request never takes that path, and ``min_tokens`` yields to a constraint that
is complete (it used to end the request with "error")."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch
from serve_helpers import make_tiny_chat_model
from test_scheduler import make_llm, one_torch_thread  # noqa: F401

from nanovllm import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
COLORS = ["red", "green", "blue"]
DIGITS = r"[0-9]+"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """The same tiny model, synchronous and async; each engine's ``launch`` records whether
    it deferred sampling (the path taken)."""
    made = {}
    for mode in (False, True):
        llm = make_llm(tiny_dir, num_kv_blocks=64, max_model_len=256, async_scheduling=mode)
        runner, launch = llm.engine.runner, llm.engine.runner.launch
        runner.deferred = []

        def spy(batch, defer_sampling=False, runner=runner, launch=launch):
            runner.deferred.append(defer_sampling)
            return launch(batch, defer_sampling=defer_sampling)

        runner.launch = spy
        made[mode] = llm
    yield made
    made.clear()
    gc.collect()


def generate(llm, prompts, params):
    llm.engine.runner.deferred.clear()
    return llm.generate(prompts, params, use_tqdm=False)


def mixed_params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [
        SamplingParams(temperature=0, max_tokens=40,
                       structured_outputs=so(json=PERSON, disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=so(choice=COLORS)),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, logprobs=1,
                       structured_outputs=so(regex=DIGITS)),
    ]


def test_greedy_constrained_tokens_equal_with_async_on_and_off(engines):
    prompts = ["A person as JSON:", "A color:", "Once upon a time", "A number:"]
    sync = generate(engines[False], prompts, mixed_params())
    assert not any(engines[False].engine.runner.deferred)  # nothing in flight: never defers
    pipelined = generate(engines[True], prompts, mixed_params())
    assert any(engines[True].engine.runner.deferred)  # the constrained path was taken
    for s, a in zip(sync, pipelined):
        assert s.outputs[0].token_ids == a.outputs[0].token_ids
        assert s.outputs[0].finish_reason == a.outputs[0].finish_reason
    person, color, _, number = (o.outputs[0] for o in pipelined)
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert color.text in COLORS and re.fullmatch(DIGITS, number.text)
    assert len(number.logprobs) == len(number.token_ids)


def test_no_constrained_request_never_defers_sampling(engines):
    """The nano-vllm workload's path: with no constrained request the async pipeline takes
    exactly the path it took before structured output (no deferred sampling, no extra wait)."""
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = generate(engines[True], ["Hello", "The sky is", "One two"], plain)
    runner = engines[True].engine.runner
    assert runner.deferred and not any(runner.deferred)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_yields_to_a_complete_constraint(engines, async_scheduling):
    """A choice completes in a token or two; ``min_tokens=6`` bans EOS, the choice allows
    only EOS: the constraint wins and the request stops (it used to end with "error")."""
    llm = engines[async_scheduling]
    choice = SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=COLORS))
    hot = SamplingParams(temperature=1.5, seed=1, max_tokens=10, min_tokens=6, n=2,
                         repetition_penalty=1.2, logit_bias={2: 5.0},
                         structured_outputs=StructuredOutputsParams(choice=COLORS))
    outs = generate(llm, ["A color:", "Pick one:"], [choice, hot])
    for sample in [outs[0].outputs[0], *outs[1].outputs]:
        assert sample.finish_reason == "stop" and sample.text in COLORS


def test_min_tokens_still_holds_back_a_constraint_that_may_go_on(engines):
    """Digits may always continue: EOS stays banned until ``min_tokens``."""
    params = SamplingParams(temperature=0, max_tokens=9, min_tokens=5, logit_bias={2: 50.0},
                            structured_outputs=StructuredOutputsParams(regex=DIGITS))
    out = generate(engines[True], ["A number:"], params)[0].outputs[0]
    assert re.fullmatch(DIGITS, out.text)
    assert len(out.text) == 5 and out.token_ids[-1] == 2  # five digits, then EOS at once


def test_only_stop_allowed_names_complete_constraints(engines):
    from nanovllm.structured_output.masks import bitmask_words

    engine = engines[False].engine
    backend = engine.input_processor._grammars  # made by the requests above
    tok = engine.tokenizer
    state = backend.new_state(StructuredOutputsParams(choice=COLORS))
    regex = backend.new_state(StructuredOutputsParams(regex=DIGITS))
    bitmask = torch.zeros(2, bitmask_words(backend.vocab_size), dtype=torch.int32)
    state.fill(bitmask, 0)
    assert not state.only_stop_allowed(bitmask, 0)  # nothing chosen yet
    for token in tok.encode("red", add_special_tokens=False):
        state.accept(token)
    for token in tok.encode("42", add_special_tokens=False):
        regex.accept(token)
    state.fill(bitmask, 0)
    regex.fill(bitmask, 1)
    assert state.only_stop_allowed(bitmask, 0)  # "red" is whole: only EOS may follow
    assert not regex.only_stop_allowed(bitmask, 1)  # complete, but more digits may follow


def test_overlap_benchmark_times_the_matcher_work_against_the_step(engines):
    """``benchmarks/structured_output``'s overlap record on the tiny model: every timed step
    spent time filling masks, advancing matchers and in the forward pass; on a CPU nothing
    is hidden."""
    from nanovllm.benchmarks.structured_output import overlap_row

    engine = engines[True].engine
    rows = [overlap_row(engine, batch, steps=2, warm=1) for batch in (1, 3)]
    assert not engine.has_unfinished_requests()
    for row in rows:
        assert row["fill_ms"] > 0 and row["accept_ms"] > 0 and row["forward_ms"] > 0
        assert row["hidden_fraction"] == 0.0  # the CPU's forward pass runs in the host's thread
        assert 0 < row["hideable_fraction"] <= 1 and 0 < row["matcher_share"] < 1

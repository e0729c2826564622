"""Bad input raises a ValueError that names the problem, and the engine keeps working."""

from __future__ import annotations

import json

import pytest

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, max_model_len=128)


GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ([], "empty"),
        ("word " * 200, "max_model_len"),
        ([1, 2, 10**9], "token ids"),
    ],
)
def test_bad_prompt(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(tmp_path / "no-such-model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(tmp_path)


def test_unknown_option(smollm2_dir):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(smollm2_dir, max_num_seq=4)  # misspelled


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [GREEDY, GREEDY], use_tqdm=False)


def test_one_bad_prompt_submits_nothing_and_others_still_complete(llm):
    good = ["The capital of France is", "def add(a, b):"]
    expected = [o.token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)]
    with pytest.raises(ValueError):
        llm.generate(good + [""], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # a request already inside the engine survives a bad one submitted beside it
    llm.engine.add_request("survivor", good[0], GREEDY)  # the only request in the engine
    with pytest.raises(ValueError):
        llm.engine.add_request(None, "word " * 200, GREEDY)
    tokens = []
    while llm.engine.has_unfinished_requests():
        tokens += [t for out in llm.engine.step() for t in out.new_token_ids]
    assert tokens == expected[0]
    again = [o.token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)]
    assert again == expected

"""The sampler: greedy, filters, Gumbel-max frequencies, and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, filter_logits


def _tensors(n, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, vocab=6, generators=None):
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return SamplingTensors(
        full(temperature, torch.float32),
        full(top_k or vocab, torch.int64),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
        generators or [None] * n,
        temperature == 0,
        top_k is not None or top_p < 1 or min_p > 0,
    )


@pytest.mark.assignment("01.filter_logits")
def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].tolist()  # noqa: E731
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    assert kept(top_k=one(2, torch.int64), top_p=one(1.0), min_p=one(0.0)) == [1, 1, 0, 0, 0]
    # nucleus 0.8: 0.4 + 0.3 = 0.7 < 0.8, so the third token is still needed
    assert kept(top_k=one(5, torch.int64), top_p=one(0.8), min_p=one(0.0)) == [1, 1, 1, 0, 0]
    # min_p 0.5: keep p >= 0.2
    assert kept(top_k=one(5, torch.int64), top_p=one(1.0), min_p=one(0.5)) == [1, 1, 0, 0, 0]


def test_gumbel_max_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 20000
    logits = torch.log(probs).expand(n, -1).clone()
    tokens = Sampler(seed=0)(logits, _tensors(n))
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~3 standard errors at n = 20000
    assert freq[-1] == 0


def test_greedy_is_argmax_and_temperature_zero_rows_stay_greedy():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, _tensors(8, temperature=0.0, vocab=50)), logits.argmax(-1))


@pytest.mark.assignment("01.filter_logits")
def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(Sampler()(logits, _tensors(16, top_k=1, vocab=50)), logits.argmax(-1))


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir)


def test_seeded_request_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate(["Tell me a story"], seeded, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16)
    batch = llm.generate(
        ["Hello", "Tell me a story", "Why is the sky blue?"], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16)
    assert llm.generate(["Tell me a story"], different, use_tqdm=False)[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_at = greedy.token_ids[3]
    stopped = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


def test_stop_string_is_cut_from_the_text(llm):
    out = llm.generate(
        "def fibonacci(n):",
        SamplingParams(temperature=0, max_tokens=40, stop=["return"]),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and "return" not in out.text


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.text and out.finish_reason == "stop"

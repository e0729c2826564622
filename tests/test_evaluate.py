"""nanovllm.evaluate: perplexity equals transformers' on SmolLM2 (fp32, CPU); greedy
agreement on hand-made token lists."""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm import LLM
from nanovllm.evaluate import greedy_agreement, perplexity
from nanovllm.outputs import CompletionOutput, RequestOutput

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a small village, there lived an old baker.",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def hf_nll(smollm2_dir):
    """(summed NLL, scored tokens) per text: cross-entropy of transformers' shifted logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    results = []
    for text in TEXTS:
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            logits = model(ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        results.append((nll.item(), ids.shape[1] - 1))
    return results


def test_perplexity_matches_transformers(llm, hf_nll):
    result = perplexity(llm, TEXTS)
    total_nll, total_tokens = sum(s for s, _ in hf_nll), sum(n for _, n in hf_nll)
    assert result.num_tokens == total_tokens
    assert result.mean_nll == pytest.approx(total_nll / total_tokens, rel=1e-3)
    assert result.perplexity == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-3)
    assert result.per_text == pytest.approx([math.exp(s / n) for s, n in hf_nll], rel=1e-3)
    # Token ids give the same result as the texts they encode.
    again = perplexity(llm, [llm.tokenizer.encode(t) for t in TEXTS])
    assert again.perplexity == pytest.approx(result.perplexity, rel=1e-6)


@pytest.mark.parametrize("texts", [[[42]], ["Hello", TEXTS[0]], [], "a string, not a list"])
def test_perplexity_rejects_short_texts(llm, texts):
    assert len(llm.tokenizer.encode("Hello")) == 1  # one token: nothing to score
    with pytest.raises(ValueError):
        perplexity(llm, texts)


def _output(token_ids: list[int]) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", token_ids, "length")], True)


def test_greedy_agreement_identical():
    ref = [[1, 2, 3, 4], [5, 6]]
    result = greedy_agreement(ref, [list(r) for r in ref])
    assert (result.exact_match, result.prefix_agreement, result.token_agreement) == (1, 1, 1)
    assert result.first_divergence == [None, None]


def test_greedy_agreement_divergence():
    # The first request diverges at position 2 of 4; the second is identical.
    ref = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
    cand = [[1, 2, 9, 4], [5, 6, 7, 8, 9, 10]]
    result = greedy_agreement(ref, cand)
    assert result.first_divergence == [2, None]
    assert result.exact_match == 0.5
    assert result.prefix_agreement == pytest.approx((2 / 4 + 1) / 2)
    assert result.token_agreement == pytest.approx((2 + 6) / 10)
    # One request alone: 0.5 prefix agreement; RequestOutputs count by their token ids.
    alone = greedy_agreement([_output(ref[0])], [_output(cand[0])])
    assert (alone.exact_match, alone.prefix_agreement, alone.token_agreement) == (0, 0.5, 0.5)


def test_greedy_agreement_lengths_and_errors():
    # Diverging at the first token; a longer candidate; a shorter one; empty references.
    result = greedy_agreement(
        [[1, 2], [1, 2], [1, 2, 3, 4], [], []], [[7, 2], [1, 2, 3], [1, 2], [], [1]]
    )
    assert result.first_divergence == [0, 2, 2, None, 0]
    assert result.exact_match == pytest.approx(1 / 5)
    assert result.prefix_agreement == pytest.approx((0 + 1 + 0.5 + 1 + 0) / 5)
    assert result.token_agreement == pytest.approx((0 + 2 + 2) / 8)
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [[1], [2]])
    with pytest.raises(ValueError):
        greedy_agreement([], [])

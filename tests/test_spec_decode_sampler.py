"""Chapter 14's assignments alone: the rejection sampler (``14.rejection_sample``) and the
prompt-lookup proposer (``14.ngram_propose``), on fresh random inputs against independent
references; and the engine-level proof of exactness: per position, the tokens sampled with
speculation follow the same distribution as without (a chi-square test, significance 0.001).
"""

from __future__ import annotations

import random

import pytest
import test_scheduler
import torch
from course_ids import ENGINE
from test_scheduler import make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.engine.spec_decode.ngram_proposer import ngram_propose
from nanovllm.engine.spec_decode.rejection_sampler import rejection_sample

ALPHA = 1e-3  # a test fails when a p-value falls below this (fixed seeds: deterministic)


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with ``dof`` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def goodness_of_fit(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``tokens`` (1-D) being drawn from ``probs`` [V] (cells expecting < 5 pooled)."""
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


def homogeneity(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """p-value of two samples of tokens coming from one distribution (2 x V table)."""
    table = torch.stack([torch.bincount(a, minlength=vocab), torch.bincount(b, minlength=vocab)]
                        ).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum().item()
    return chi2_sf(stat, table.shape[1] - 1)


def random_probs(gen: torch.Generator, *shape: int, sharp: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * sharp).softmax(dim=-1)


# -- 14.rejection_sample ---------------------------------------------------------------------
@pytest.mark.assignment("14.rejection_sample")
def test_greedy_keeps_the_argmax_prefix_and_replaces_the_first_mismatch():
    gen = torch.Generator().manual_seed(1)
    batch, k, vocab = 64, 4, 11
    target = torch.randint(vocab, (batch, k + 1), generator=gen)
    one_hot = torch.nn.functional.one_hot(target, vocab).float()
    # Each proposal matches the arg-max with probability 1/2; padding past num_drafts.
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.5, target[:, :k],
                         (target[:, :k] + 1) % vocab)
    num_drafts = torch.randint(k + 1, (batch,), generator=gen)
    drafts[torch.arange(k)[None, :] >= num_drafts[:, None]] = -1
    uniforms = torch.rand(batch, k, generator=gen)
    accepted, next_probs = rejection_sample(one_hot, drafts, num_drafts, None, uniforms)
    for b in range(batch):
        a = 0
        while a < num_drafts[b] and drafts[b, a] == target[b, a]:
            a += 1
        assert accepted[b] == a
        assert next_probs[b].argmax() == target[b, a] and next_probs[b].max() == 1


@pytest.mark.assignment("14.rejection_sample")
@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["draft-model", "ngram"])
def test_first_token_follows_the_target_distribution(deterministic_draft):
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 40_000, 9
    p, q = random_probs(gen, vocab), random_probs(gen, vocab)
    drafts = torch.multinomial(q, batch, replacement=True, generator=gen)[:, None]
    target = p.expand(batch, 2, vocab)
    draft_probs = None if deterministic_draft else q.expand(batch, 1, vocab)
    accepted, next_probs = rejection_sample(target, drafts, torch.ones(batch, dtype=torch.long),
                                            draft_probs, torch.rand(batch, 1, generator=gen))
    resampled = torch.multinomial(next_probs, 1, generator=gen)[:, 0]
    first = torch.where(accepted > 0, drafts[:, 0], resampled)
    assert goodness_of_fit(first, p) > ALPHA
    if not deterministic_draft:  # the acceptance rate is sum(min(p, q)) (Leviathan, thm 3.5)
        rate = accepted.float().mean().item()
        assert abs(rate - torch.minimum(p, q).sum().item()) < 0.015


@pytest.mark.assignment("14.rejection_sample")
def test_every_position_follows_its_target_distribution():
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 40_000, 3, 7
    p, q = random_probs(gen, k + 1, vocab), random_probs(gen, k, vocab)
    drafts = torch.stack([torch.multinomial(q[j], batch, replacement=True, generator=gen)
                          for j in range(k)], dim=1)
    accepted, next_probs = rejection_sample(
        p.expand(batch, k + 1, vocab), drafts, torch.full((batch,), k), q.expand(batch, k, vocab),
        torch.rand(batch, k, generator=gen))
    final = torch.multinomial(next_probs, 1, generator=gen)[:, 0]
    for j in range(k + 1):  # token j exists when the first j proposals were accepted
        reached = accepted >= j
        token = drafts[:, min(j, k - 1)] if j < k else final
        token = torch.where(accepted > j, token, final) if j < k else final
        assert goodness_of_fit(token[reached], p[j]) > ALPHA


@pytest.mark.assignment("14.rejection_sample")
def test_edge_cases_padding_no_proposals_and_identical_distributions():
    gen = torch.Generator().manual_seed(4)
    batch, k, vocab = 8, 3, 5
    p = random_probs(gen, batch, k + 1, vocab)
    drafts = torch.randint(vocab, (batch, k), generator=gen)
    # No proposals: the next token comes from position 0, whatever the padding holds.
    accepted, next_probs = rejection_sample(p, drafts, torch.zeros(batch, dtype=torch.long),
                                            None, torch.zeros(batch, k))
    assert accepted.tolist() == [0] * batch and torch.allclose(next_probs, p[:, 0])
    # K = 0 (nobody in the batch proposed).
    accepted, next_probs = rejection_sample(p[:, :1], drafts[:, :0], torch.zeros(batch).long(),
                                            None, torch.zeros(batch, 0))
    assert accepted.tolist() == [0] * batch and torch.allclose(next_probs, p[:, 0])
    # q = p accepts everything (u < 1); after a rejection nothing more is kept.
    q = p[:, :k].clone()
    accepted, next_probs = rejection_sample(p, drafts, torch.full((batch,), k), q,
                                            torch.rand(batch, k, generator=gen))
    assert accepted.tolist() == [k] * batch and torch.allclose(next_probs, p[:, k])
    # q = p except q(d) = 1 at position 0: max(0, p - q) has no mass, the guard gives p.
    sure = q.clone()
    sure[torch.arange(batch), 0, drafts[:, 0]] = 1.0
    u = torch.tensor([[0.999999, 0.0, 0.0]]).expand(batch, k)
    accepted, next_probs = rejection_sample(p, drafts, torch.full((batch,), k), sure, u)
    assert accepted.tolist() == [0] * batch  # rejected at 0: later u = 0 does not matter
    assert torch.allclose(next_probs, p[:, 0])
    # one-hot q at position 0: the residual is p without the proposal, renormalised.
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    accepted, next_probs = rejection_sample(p, drafts, torch.full((batch,), k), one_hot, u)
    residual = p[:, 0].clone()
    residual[torch.arange(batch), drafts[:, 0]] = 0
    assert accepted.tolist() == [0] * batch
    assert torch.allclose(next_probs, residual / residual.sum(-1, keepdim=True))
    # A deterministic proposal (None) is the one-hot draft distribution.
    u = torch.rand(batch, k, generator=gen)
    a1, n1 = rejection_sample(p, drafts, torch.full((batch,), k), None, u)
    a2, n2 = rejection_sample(p, drafts, torch.full((batch,), k), one_hot, u)
    assert a1.tolist() == a2.tolist() and torch.allclose(n1, n2, atol=1e-6)


# -- 14.ngram_propose ------------------------------------------------------------------------
def reference_ngram(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                text = list(tokens)
                while len(text) < len(tokens) + k:  # continue the text by the match
                    text.append(text[len(text) - (len(tokens) - n - i)])
                return text[len(tokens):]
    return []


@pytest.mark.assignment("14.ngram_propose")
def test_ngram_worked_examples():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    # past the end of the text, the match's period continues it: 1 2 | 3 4 1 2 | 3 ...
    assert ngram_propose([1, 2, 3, 4, 1, 2], 5, 1, 3) == [3, 4, 1, 2, 3]
    # the longest match wins over a more recent shorter one
    assert ngram_propose([5, 6, 7, 9, 6, 8, 0, 5, 6], 1, 1, 2) == [7]
    # the most recent occurrence of the longest match
    assert ngram_propose([1, 2, 3, 1, 2, 4, 1, 2], 1, 2, 2) == [4]
    # overlapping the suffix is allowed: a run of one token proposes k more of it
    assert ngram_propose([9, 9, 9, 9], 3, 2, 3) == [9, 9, 9]
    assert ngram_propose([5, 7, 5, 7, 5], 3, 1, 3) == [7, 5, 7]


@pytest.mark.assignment("14.ngram_propose")
def test_ngram_edge_cases():
    assert ngram_propose([], 3, 1, 3) == []
    assert ngram_propose([4], 3, 1, 3) == []
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1], 0, 1, 3) == []  # k = 0
    assert ngram_propose([1, 2, 1], 2, 2, 3) == []  # only a 1-token match, min_n is 2
    import numpy as np

    tokens = np.array([3, 1, 4, 1, 5, 3, 1])
    out = ngram_propose(tokens, 2, 1, 2)
    assert out == [4, 1] and all(type(t) is int for t in out)
    assert tokens.tolist() == [3, 1, 4, 1, 5, 3, 1]


@pytest.mark.assignment("14.ngram_propose")
def test_ngram_matches_a_brute_force_reference():
    rng = random.Random(5)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, low = rng.randrange(1, 6), rng.randrange(1, 4)
        high = rng.randrange(low, 6)
        assert ngram_propose(tokens, k, low, high) == reference_ngram(tokens, k, low, high)


# -- the engine: the same distribution with and without speculation ------------------------
SMALL_VOCAB = 12


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # a 12-token vocabulary: cells fill up
        patch.setattr(test_scheduler, "VOCAB", SMALL_VOCAB)
        return make_tiny_llama(tmp_path_factory.mktemp("tiny-vocab12"), seed=3)


def sample_positions(path, spec, seed: int, n: int = 1000) -> torch.Tensor:
    llm = LLM(path, num_kv_blocks=320, seed=seed, speculative_config=spec)
    params = SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[1, 5, 7]] * n, params, use_tqdm=False)
    return torch.tensor([o.token_ids for o in outs])  # [n, 4]


@pytest.mark.parametrize("spec", [
    {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
     "prompt_lookup_max": 1},
], ids=["draft_layers", "ngram"])
@pytest.mark.assignment(*ENGINE, "01.filter_logits", "14.rejection_sample", "14.ngram_propose")
def test_sampled_tokens_keep_the_distribution_per_position(small_vocab, spec):
    plain = sample_positions(small_vocab, None, seed=11)
    speculative = sample_positions(small_vocab, spec, seed=12)
    for position in range(plain.shape[1]):
        p_value = homogeneity(plain[:, position], speculative[:, position], SMALL_VOCAB)
        assert p_value > ALPHA, f"position {position}: p = {p_value:.2e}"

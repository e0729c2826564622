"""The sampler: greedy, filters, Gumbel-max frequencies, and per-request seeds.

The tests of ``filter_logits`` alone (assignment ``01.filter_logits``) check hand-computed
masks (per row, in vocabulary order, top-p and min-p after the top-k renormalisation, the top
token always kept, top-p 1 keeping all) and random rows against a float64 reference.

The tests of ``Sampler.forward`` alone (assignment ``01.sampler``) compare frequencies with
the softmax probabilities by Pearson's chi-square on fixed seeds (so they cannot flake),
check that a seeded row's tokens do not depend on the rest of the batch, that greedy rows take
the arg-max among sampled ones, that the noise stream is the documented one, and that nothing
reads a device value on the host.
"""

from __future__ import annotations

import pytest
import torch
from course_ids import ENGINE

from nanovllm import LLM, SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, filter_logits

SAMPLER = "01.sampler"


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


def _one_row_settings(n, top_k=None, top_p=1.0, min_p=0.0, vocab=5):
    """Per-row filter settings; each argument a value for every row or a list of n values."""
    per_row = lambda v: v if isinstance(v, list) else [v] * n  # noqa: E731
    return dict(top_k=torch.tensor([vocab if k is None else k for k in per_row(top_k)]),
                top_p=torch.tensor(per_row(top_p), dtype=torch.float32),
                min_p=torch.tensor(per_row(min_p), dtype=torch.float32))


@pytest.mark.assignment("01.filter_logits")
def test_filters_each_row_its_own_settings_in_vocabulary_order():
    """The probabilities of the test above, shuffled over the vocabulary: each row keeps what
    its own setting says, at the tokens' own places, and nothing else."""
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    place = [3, 0, 4, 1, 2]  # the token of rank r sits at vocabulary index place[r]
    row = torch.empty(5)
    for rank, p in enumerate(probs):
        row[place[rank]] = torch.log(torch.tensor(p))
    logits = row.expand(4, 5).clone()
    settings = _one_row_settings(4, top_k=[2, None, None, None], top_p=[1.0, 0.8, 1.0, 1.0],
                                 min_p=[0.0, 0.0, 0.5, 0.0])
    out = filter_logits(logits, **settings)

    def at_places(kept_ranks):
        return [place.index(i) in kept_ranks for i in range(5)]

    assert torch.isfinite(out).tolist() == [at_places({0, 1}), at_places({0, 1, 2}),
                                            at_places({0, 1}), at_places({0, 1, 2, 3, 4})]
    assert (out[~torch.isfinite(out)] == float("-inf")).all()  # dropped means -inf, not NaN


@pytest.mark.assignment("01.filter_logits")
def test_filters_return_a_new_tensor_with_the_kept_logits_unchanged():
    gen = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(6, 40, generator=gen)
    before = logits.clone()
    settings = _one_row_settings(6, top_k=[40, 7, 1, 40, 12, 40],
                                 top_p=[1.0, 1.0, 1.0, 0.6, 0.9, 1.0],
                                 min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.2], vocab=40)
    out = filter_logits(logits, **settings)
    assert out.shape == logits.shape and out.dtype == torch.float32
    assert torch.equal(logits, before), "the input was modified"
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept]), "a kept logit changed"
    assert kept.sum(-1)[[1, 2]].tolist() == [7, 1]  # the top-k rows (their p/min-p are off)
    assert kept[2, logits[2].argmax()]
    assert torch.equal(filter_logits(logits, **_one_row_settings(6, vocab=40)), logits)  # all off


@pytest.mark.assignment("01.filter_logits")
def test_top_p_and_min_p_see_the_distribution_renormalised_after_top_k():
    """Top-3 of [0.4, 0.3, 0.15, 0.1, 0.05] renormalised: [0.47, 0.35, 0.18]. With top-p 0.8
    the mass above the third token is 0.82 >= 0.8 (it goes), where over the whole distribution
    it would be 0.7 (it would stay)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).expand(2, 5).clone()
    out = filter_logits(logits, **_one_row_settings(2, top_k=3, top_p=[0.8, 0.9]))
    assert torch.isfinite(out).tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    # min-p compares with the largest probability: 0.15 / 0.4 = 0.375 keeps the third at 0.35
    out = filter_logits(logits, **_one_row_settings(2, top_k=4, min_p=[0.35, 0.4]))
    assert torch.isfinite(out).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


@pytest.mark.assignment("01.filter_logits")
def test_the_top_token_always_stays_and_top_p_one_keeps_everything():
    """[0, -20, -20, -20]: in fp32 the top probability is 1.0 exactly and the running mass
    before the other tokens is already 1, yet top-p 1 must keep them. A tiny top-p or a min-p
    of 1 keeps the top token alone; tokens tied with the largest stay under min-p 1
    (kept when at least min_p times the largest)."""
    logits = torch.tensor([[-20.0, 0.0, -20.0, -20.0]]).expand(3, 4).clone()
    out = filter_logits(logits, **_one_row_settings(3, top_p=[1.0, 1e-3, 1.0],
                                                   min_p=[0.0, 0.0, 1.0], vocab=4))
    assert torch.isfinite(out).tolist() == [[1, 1, 1, 1], [0, 1, 0, 0], [0, 1, 0, 0]]
    tied = torch.tensor([[2.0, -1.0, 2.0, 0.0]])
    out = filter_logits(tied, **_one_row_settings(1, min_p=1.0, vocab=4))
    assert torch.isfinite(out).tolist() == [[1, 0, 1, 0]]


def _filter_reference(row: torch.Tensor, k: int, top_p: float, min_p: float) -> list[bool]:
    """The handout's rules in float64, token by token, for a row without ties."""
    ranked = sorted(range(len(row)), key=lambda i: -float(row[i]))[:k]
    weights = torch.tensor([float(row[i]) for i in ranked], dtype=torch.float64).softmax(0)
    keep, above = [False] * len(row), 0.0
    for i, p in zip(ranked, weights.tolist()):
        assert top_p >= 1 or abs(above - top_p) > 1e-4, "too close to call in fp32"
        assert abs(p - min_p * float(weights[0])) > 1e-6, "too close to call in fp32"
        keep[i] = (above < top_p or top_p >= 1) and p >= min_p * float(weights[0])
        above += p
    return keep


@pytest.mark.assignment("01.filter_logits")
def test_filters_match_a_float64_reference_on_random_rows():
    gen = torch.Generator().manual_seed(12)
    n, vocab = 24, 30
    logits = 2 * torch.randn(n, vocab, generator=gen)
    top_k = torch.randint(1, vocab + 1, (n,), generator=gen)
    top_k[::4] = vocab  # some rows without top-k
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    top_p[1::3] = 1.0
    min_p = torch.rand(n, generator=gen) * 0.3
    min_p[2::3] = 0.0
    out = filter_logits(logits, top_k, top_p, min_p)
    for r in range(n):
        expected = _filter_reference(logits[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert torch.isfinite(out[r]).tolist() == expected, r


@pytest.mark.assignment(SAMPLER)
def test_gumbel_max_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 20000
    logits = torch.log(probs).expand(n, -1).clone()
    tokens = Sampler(seed=0)(logits, _tensors(n))
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~3 standard errors at n = 20000
    assert freq[-1] == 0


@pytest.mark.assignment(SAMPLER)
def test_greedy_is_argmax_and_temperature_zero_rows_stay_greedy():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, _tensors(8, temperature=0.0, vocab=50)), logits.argmax(-1))


@pytest.mark.assignment("01.filter_logits", SAMPLER)
def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(Sampler()(logits, _tensors(16, top_k=1, vocab=50)), logits.argmax(-1))


# -- Sampler.forward alone (01.sampler) ---------------------------------------------------------
def _rows(temperatures, generators=None, top_k=None, vocab=8):
    """SamplingTensors for rows with these temperatures (and, optionally, top-k)."""
    n = len(temperatures)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    k = torch.full((n,), top_k or vocab, dtype=torch.int64)
    return SamplingTensors(temps, k, torch.ones(n), torch.zeros(n), generators or [None] * n,
                           all(t == 0 for t in temperatures), top_k is not None)


def _chi2_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of the token counts against ``probs`` (tokens of
    probability 0 must never appear)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = len(tokens) * probs.double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was drawn"
    chi2 = ((counts - expected)[kept] ** 2 / expected[kept]).sum()
    dof = torch.tensor((int(kept.sum()) - 1) / 2, dtype=torch.float64)
    return 1 - torch.special.gammainc(dof, chi2 / 2).item()


def _logits(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.assignment(SAMPLER)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_the_softmax_at_each_temperature(temperature):
    z = _logits(8, seed=1)
    n = 40_000
    tokens = Sampler(seed=2)(z.expand(n, -1), _rows([temperature] * n))
    assert tokens.shape == (n,) and tokens.dtype == torch.int64
    assert _chi2_p_value(tokens, (z / temperature).softmax(-1)) > 1e-3


@pytest.mark.assignment(SAMPLER)
def test_temperatures_mix_in_one_batch_each_row_its_own():
    """Rows of one batch alternate between four settings (greedy among them); each setting's
    rows follow their own distribution, and greedy rows take the arg-max."""
    z = _logits(8, seed=3)
    temperatures = [0.3, 0.0, 1.0, 3.0]
    n = 12_000
    rows = temperatures * n
    tokens = Sampler(seed=4)(z.expand(len(rows), -1), _rows(rows))
    for which, temperature in enumerate(temperatures):
        mine = tokens[which :: len(temperatures)]
        if temperature == 0:
            assert (mine == z.argmax()).all()
        else:
            assert _chi2_p_value(mine, (z / temperature).softmax(-1)) > 1e-3, temperature


@pytest.mark.assignment(SAMPLER, "01.filter_logits")  # (its rows filter)
def test_seeded_rows_follow_the_distribution_from_their_own_generators():
    """Each row has a generator of its own seed: across rows the tokens still follow the
    filtered softmax (top-k 5), and two generators of one seed give the same row."""
    z = _logits(8, seed=5)
    n = 20_000
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    tokens = Sampler(seed=6)(z.expand(n, -1), _rows([0.8] * n, generators, top_k=5))
    expected = filter_logits((z / 0.8)[None], torch.tensor([5]), torch.ones(1), torch.zeros(1))
    assert _chi2_p_value(tokens, expected[0].softmax(-1)) > 1e-3
    again = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    assert torch.equal(Sampler(seed=7)(z.expand(n, -1), _rows([0.8] * n, again, top_k=5)), tokens)


@pytest.mark.assignment(SAMPLER, "01.filter_logits")  # (its rows filter)
def test_a_seeded_request_does_not_depend_on_its_batch():
    """The same seeded request, step after step, alone or among other rows (seeded, unseeded,
    greedy, filtered), at any place in the batch and under any shared seed: the same tokens."""
    vocab, steps = 50, 6
    mine = [_logits(vocab, seed=10 + s) for s in range(steps)]  # the request's logits per step

    def run(neighbours_before: int, neighbours_after: int, shared_seed: int, top_k=None):
        own = torch.Generator().manual_seed(1234)
        other_gen = torch.Generator().manual_seed(99)
        sampler, tokens = Sampler(seed=shared_seed), []
        for step in range(steps):
            n = neighbours_before + 1 + neighbours_after
            logits = _logits(n, vocab, seed=100 * shared_seed + step)
            logits[neighbours_before] = mine[step]
            temps = [0.0 if r % 3 == 0 else 1.0 + r / 4 for r in range(n)]
            temps[neighbours_before] = 0.9
            generators = [other_gen if r % 2 else None for r in range(n)]
            generators[neighbours_before] = own
            out = sampler(logits, _rows(temps, generators, top_k=top_k, vocab=vocab))
            tokens.append(int(out[neighbours_before]))
        return tokens

    alone = run(0, 0, shared_seed=0)
    assert run(3, 4, shared_seed=1) == alone
    assert run(6, 0, shared_seed=2) == alone
    assert run(0, 9, shared_seed=3, top_k=vocab) == alone  # the filter path, a no-op filter
    assert len(set(alone)) > 1  # really sampled


@pytest.mark.assignment(SAMPLER)
def test_greedy_rows_take_the_argmax_among_sampled_rows_in_any_dtype():
    logits = _logits(16, 100, seed=20).bfloat16()
    temps = [0.0 if r % 2 else 1.5 for r in range(16)]
    tokens = Sampler(seed=0)(logits, _rows(temps, vocab=100))
    assert tokens.dtype == torch.int64 and tokens.shape == (16,)
    greedy = logits.float().argmax(-1)
    assert torch.equal(tokens[1::2], greedy[1::2])
    assert not torch.equal(tokens[0::2], greedy[0::2])  # 8 rows at T = 1.5: some differ
    all_greedy = Sampler(seed=0)
    state = all_greedy.generator.get_state()
    assert torch.equal(all_greedy(logits, _rows([0.0] * 16, vocab=100)), greedy)
    assert torch.equal(all_greedy.generator.get_state(), state)  # all greedy: nothing drawn


def _reference_tokens(logits, temps, generators, shared):
    """The documented noise stream, written row by row: one [B, V] draw from the shared
    generator, each seeded row redrawn from its own; the token is argmax(p / E)."""
    noise = torch.empty(logits.shape).exponential_(generator=shared)
    tokens = []
    for r, (row, t) in enumerate(zip(logits, temps)):
        if generators[r] is not None:
            noise[r] = torch.empty(logits.shape[1]).exponential_(generator=generators[r])
        if t == 0:
            tokens.append(int(row.argmax()))
        else:
            tokens.append(int(((row / t).softmax(-1) / noise[r]).argmax()))
    return tokens


@pytest.mark.assignment(SAMPLER)
def test_the_noise_is_the_documented_stream():
    """A seed must mean the same tokens in every implementation (the notebooks print them)."""
    logits = _logits(7, 30, seed=30)
    temps = [1.0, 0.0, 0.7, 1.3, 2.0, 0.0, 1.0]
    seeds = [None, 5, 6, None, 7, None, 8]

    def generators():
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    expected = _reference_tokens(logits, temps, generators(), torch.Generator().manual_seed(3))
    tokens = Sampler(seed=3)(logits, _rows(temps, generators(), vocab=30))
    assert tokens.tolist() == expected


class _NoHostSync(torch.Tensor):
    """A tensor that fails on every operation which, on a GPU, would make the host wait for
    the device: reading a value (``item``, ``tolist``, ``bool``...), a copy to the host, or an
    operation whose result size depends on the values (``nonzero``, boolean-mask indexing)."""

    FORBIDDEN = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
        torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
        torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
        torch.unique, torch.Tensor.unique, torch.Tensor.any, torch.Tensor.all,
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        index = args[1] if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) else None
        parts = index if isinstance(index, tuple) else (index,)
        if func in cls.FORBIDDEN or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts
        ):
            raise AssertionError(f"{getattr(func, '__name__', func)} waits for the device")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.assignment(SAMPLER, "01.filter_logits")  # (its rows filter)
def test_no_value_crosses_to_the_host():
    logits = _logits(6, 40, seed=40).as_subclass(_NoHostSync)
    temps = [0.0, 1.0, 0.5, 0.0, 2.0, 1.0]
    generators = [None, torch.Generator().manual_seed(1), None, None, None,
                  torch.Generator().manual_seed(2)]
    params = _rows(temps, generators, top_k=10, vocab=40)
    params.temperatures = params.temperatures.as_subclass(_NoHostSync)
    params.top_k, params.top_p, params.min_p = (
        t.as_subclass(_NoHostSync) for t in (params.top_k, params.top_p, params.min_p))
    tokens = Sampler(seed=0)(logits, params).as_subclass(torch.Tensor)
    assert tokens.shape == (6,)
    with pytest.raises(AssertionError, match="waits for the device"):  # the detector works
        bool(params.temperatures[0] > 0)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir)


@pytest.mark.assignment(*ENGINE, "01.filter_logits")
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

"""Logits processing and logprobs against references written independently (chapter 01).

Each request's settings are plain Python (a ``Row``); the references loop over rows and
tokens the way the rules are written down (OpenAI, vLLM, Hugging Face), and only
``pack`` builds the batched tensors that the engine would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from nanovllm.layers.logits_processors import LogitsProcessingTensors, process_logits
from nanovllm.layers.sampler import compute_logprobs

V = 1000
NEG_INF = float("-inf")


@dataclass
class Row:
    prompt: list[int]
    output: list[int]
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] = field(default_factory=dict)
    allowed: list[int] | None = None
    banned: list[int] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)  # >= 1 token each

    def is_off(self) -> bool:
        return (self.presence, self.frequency, self.repetition) == (0, 0, 1) and not (
            self.bias or self.allowed is not None or self.banned or self.bad_words
        )


def padded(lists: list[list[int]], extra: int = 0, left: bool = False) -> torch.Tensor:
    """Rows of ids padded with -1 on the right (or the left), ``extra`` more columns."""
    width = max(map(len, lists), default=0) + extra
    out = torch.full((len(lists), width), -1, dtype=torch.int64)
    for i, ids in enumerate(lists):
        start = width - len(ids) if left else 0
        out[i, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def pairs(rows: list[Row], of) -> tuple[torch.Tensor, torch.Tensor]:
    found = [(r, tok) for r, row in enumerate(rows) for tok in of(row)]
    ids = torch.tensor(found, dtype=torch.int64).reshape(-1, 2)
    return ids[:, 0], ids[:, 1]


def pack(rows: list[Row], device: str = "cpu", extra_padding: int = 2) -> LogitsProcessingTensors:
    """The engine's job: per-row settings -> batched tensors (every field set)."""
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)
    bias_rows, bias_toks = pairs(rows, lambda row: row.bias)
    bias_vals = f32([v for row in rows for v in row.bias.values()])
    words = [(r, w) for r, row in enumerate(rows) for w in row.bad_words]
    t = LogitsProcessingTensors(
        prompt_ids=padded([row.prompt for row in rows], extra_padding),
        output_ids=padded([row.output for row in rows], extra_padding),
        output_lens=torch.tensor([len(row.output) for row in rows]),
        presence_penalty=f32([row.presence for row in rows]),
        frequency_penalty=f32([row.frequency for row in rows]),
        repetition_penalty=f32([row.repetition for row in rows]),
        bias=(bias_rows, bias_toks, bias_vals),
        allowed=pairs(rows, lambda row: row.allowed or []),
        banned=pairs(rows, lambda row: row.banned),
        bad_sequences=(
            torch.tensor([r for r, _ in words], dtype=torch.int64),
            padded([w[:-1] for _, w in words], left=True),
            torch.tensor([len(w) - 1 for _, w in words], dtype=torch.int64),
            torch.tensor([w[-1] for _, w in words], dtype=torch.int64),
        ),
    )
    for name, value in vars(t).items():
        moved = tuple(x.to(device) for x in value) if isinstance(value, tuple) else value.to(device)
        setattr(t, name, moved)
    return t


def reference(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Row by row, token by token, in vLLM v1's order."""
    out = logits.clone()
    for r, row in enumerate(rows):
        x = out[r].tolist()
        if row.allowed is not None:
            x = [v if tok in row.allowed else NEG_INF for tok, v in enumerate(x)]
        for tok in row.banned:
            x[tok] = NEG_INF
        for word in row.bad_words:  # vLLM: the generated tokens must end with word[:-1]
            n = len(word) - 1
            if n <= len(row.output) and row.output[len(row.output) - n :] == word[:-1]:
                x[word[-1]] = NEG_INF
        for tok, b in row.bias.items():
            x[tok] += b
        for tok in set(row.prompt) | set(row.output):
            x[tok] = x[tok] / row.repetition if x[tok] > 0 else x[tok] * row.repetition
        for tok in set(row.output):
            count = row.output.count(tok)
            x[tok] -= row.frequency * count + row.presence * (count > 0)
        out[r] = torch.tensor(x)
    return out


def random_rows(seed: int) -> list[Row]:
    """Up to 8 rows: a quarter with every setting off, the others with each feature on
    half the time; a small token range, so that tokens repeat and bad words match."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(0, 40, n).tolist()
    rows = []
    for _ in range(rng.integers(1, 9)):
        row = Row(prompt=tok(rng.integers(1, 12)), output=tok(rng.integers(0, 10)))
        rows.append(row)
        if rng.random() < 0.25:  # a row with every setting off
            continue
        on = lambda: rng.random() < 0.5
        if on():
            row.presence, row.frequency = rng.uniform(-2, 2, 2).round(3).tolist()
        if on():
            row.repetition = float(rng.uniform(0.5, 2.0))
        if on():
            row.bias = {int(t): float(rng.uniform(-5, 5)) for t in tok(3)}
        if on():
            row.allowed = tok(rng.integers(1, 20))
        if on():
            row.banned = tok(2)
        if on():
            k = int(rng.integers(0, len(row.output) + 1))  # a suffix of the output: matches
            row.bad_words = [row.output[len(row.output) - k :] + tok(1), tok(3), tok(20)]
    return rows


def fresh_logits(batch: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(batch, V, generator=gen)).to(device)


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_and_off_rows_are_untouched(seed):
    rows = random_rows(seed)
    logits = fresh_logits(len(rows), seed)
    got = process_logits(logits.clone(), pack(rows))
    torch.testing.assert_close(got, reference(logits, rows), rtol=1e-5, atol=1e-5)
    for r, row in enumerate(rows):
        if row.is_off():
            assert torch.equal(got[r], logits[r])


def test_all_off_is_bit_identical():
    rows = [Row(prompt=[1, 2, 2], output=o) for o in ([], [3], [4, 4, 5])]
    logits = fresh_logits(3, 0)
    assert torch.equal(process_logits(logits.clone(), pack(rows)), logits)
    assert torch.equal(process_logits(logits.clone(), LogitsProcessingTensors()), logits)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    lists=st.lists(
        st.tuples(
            st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
            st.lists(st.integers(0, 30), max_size=12),
            st.floats(0.1, 3.0),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_repetition_matches_hugging_face(seed, lists):
    rows = [Row(prompt=p, output=o, repetition=penalty) for p, o, penalty in lists]
    logits = fresh_logits(len(rows), seed)
    got = process_logits(logits.clone(), pack(rows))
    for r, row in enumerate(rows):  # HF sees prompt + output, one unpadded row at a time
        hf = RepetitionPenaltyLogitsProcessor(penalty=np.float32(row.repetition).item())
        expected = hf(torch.tensor([row.prompt + row.output]), logits[r : r + 1].clone())
        assert torch.equal(got[r], expected[0])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    lists=st.lists(
        st.tuples(
            st.lists(st.integers(0, 20), max_size=15),
            st.floats(-2, 2, width=32),
            st.floats(-2, 2, width=32),
        ),
        min_size=1,
        max_size=8,
    ),
    extra_padding=st.integers(0, 3),
)
def test_frequency_and_presence_follow_openai(seed, lists, extra_padding):
    # The prompt repeats output tokens to show that it does not count.
    rows = [Row(prompt=o + [0, 1], output=o, frequency=f, presence=p) for o, f, p in lists]
    logits = fresh_logits(len(rows), seed)
    got = process_logits(logits.clone(), pack(rows, extra_padding=extra_padding))
    expected = logits.double().clone()
    for r, row in enumerate(rows):
        for tok in set(row.output):
            count = row.output.count(tok)
            expected[r, tok] -= row.frequency * count + row.presence * (count > 0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_padding_never_counts():
    pen = dict(repetition=2.0, frequency=1.0, presence=1.0)
    rows = [Row([], [], **pen), Row([5], [], **pen), Row([], [6], **pen)]
    logits = fresh_logits(len(rows), 3)
    logits[:, 0] = -1.0  # where clamped padding would land
    got = process_logits(logits.clone(), pack(rows, extra_padding=3))
    changed = {(r, t) for r, t in (got != logits).nonzero().tolist()}
    assert changed == {(1, 5), (2, 6)}
    torch.testing.assert_close(got, reference(logits, rows))


def test_bad_sequences_edge_cases():
    rows = [
        Row(prompt=[7, 8], output=[1, 2, 3], bad_words=[[2, 3, 10], [1, 2, 11], [3, 12]]),
        Row(prompt=[7, 8], output=[3], bad_words=[[8, 3, 13], [3, 15]]),  # 8 is in the prompt
        Row(prompt=[7], output=[], bad_words=[[5], [1, 14]]),  # prefix_len 0; no output yet
        Row(prompt=[7], output=[2, 3]),  # not listed
    ]
    logits = fresh_logits(len(rows), 1)
    got = process_logits(logits.clone(), pack(rows))
    banned = {(0, 10), (0, 12), (1, 15), (2, 5)}
    assert {(r, t) for r, t in (got == NEG_INF).nonzero().tolist()} == banned
    torch.testing.assert_close(got, reference(logits, rows))


def test_allowed_tokens_all_banned_leaves_the_row_all_minus_inf():
    rows = [Row(prompt=[1], output=[], allowed=[3, 4], banned=[3, 4]), Row(prompt=[1], output=[])]
    logits = fresh_logits(2, 2)
    got = process_logits(logits.clone(), pack(rows))
    assert torch.equal(got[0], torch.full((V,), NEG_INF)) and torch.equal(got[1], logits[1])


def logprob_reference(logits: torch.Tensor, sampled: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.double(), dim=-1)
    picked = lp[torch.arange(len(sampled)), sampled]
    ranks = [1 + int((lp[r] > picked[r]).sum()) for r in range(len(sampled))]
    top = lp.topk(k, dim=-1)
    return picked, torch.tensor(ranks), top.indices, top.values


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("seed", range(4))
def test_compute_logprobs_matches_float64(seed, k):
    logits = fresh_logits(8, seed)  # continuous draws: no ties
    sampled = torch.randint(V, (8,), generator=torch.Generator().manual_seed(seed))
    sampled[0] = logits[0].argmax()  # rank 1
    got = compute_logprobs(torch.log_softmax(logits, dim=-1), sampled, k)
    expected = logprob_reference(logits, sampled, k)
    torch.testing.assert_close(got[0].double(), expected[0], rtol=0, atol=1e-5)
    assert torch.equal(got[1], expected[1]) and got[1][0] == 1
    assert got[2].shape == (8, k) and torch.equal(got[2], expected[2])
    torch.testing.assert_close(got[3].double(), expected[3], rtol=0, atol=1e-5)


def test_rank_of_a_tie_is_its_worst_place_as_in_vllm():
    logprobs = torch.tensor([[0.4, 0.4, 0.2]]).log()
    _, rank, ids, _ = compute_logprobs(logprobs, torch.tensor([0]), 1)
    assert rank.tolist() == [2] and ids.tolist() in ([[0]], [[1]])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("seed", range(6))
def test_cuda_matches_cpu_without_host_sync(seed):
    rows = random_rows(seed)
    logits, t = fresh_logits(len(rows), seed), pack(rows)
    on_gpu, t_gpu = logits.cuda(), pack(rows, "cuda")
    sampled = torch.zeros(len(rows), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = process_logits(on_gpu, t_gpu)
        logprobs = compute_logprobs(torch.log_softmax(got, dim=-1), sampled, 3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    expected = process_logits(logits.clone(), t)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    cpu = compute_logprobs(torch.log_softmax(expected, dim=-1), sampled.cpu(), 3)
    for a, b in zip(logprobs, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)

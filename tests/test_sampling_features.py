"""vLLM's request-level sampling features on SmolLM2 (real weights, fp32, CPU).

Logprobs and prompt logprobs are compared with transformers' ``log_softmax`` of the same
model; repetition penalty with ``model.generate``; presence and frequency penalties with a
reference greedy loop over transformers' logits. ``min_tokens``, ``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``n`` (parallel sampling, prompt KV computed once),
preemption and ``logprobs_mode="processed_logprobs"`` are checked end to end, and every new
``SamplingParams`` field rejects bad values. Engine-level tests run with and without async
scheduling.
"""

from __future__ import annotations

import gc
import math
from functools import lru_cache

import numpy as np
import pytest
import torch
from test_scheduler import one_torch_thread  # noqa: F401 -- autouse: one thread per module

from nanovllm import LLM, SamplingParams
from nanovllm.validation import SEED_RANGE

TOL = 1e-4
KV_BLOCKS = 64
MAX_LEN = 256
PROMPT = "The capital of France is"
# ~35 tokens: three chunks under max_num_batched_tokens=16
LONG_PROMPT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria use the "
    "energy of sunlight to make sugars from carbon dioxide and water, releasing oxygen into "
    "the air as a byproduct."
)
# >= 48 tokens each, different from their first block on (no shared cached prefix)
STORY_A = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the "
    "wick, polished the great brass lens, and watched the fishing boats pass safely beyond "
    "the black rocks while the gulls circled overhead and the cold tide rolled in."
)
STORY_B = (
    "Every spring the village held a market in the square: farmers brought cheese, honey and "
    "apples, a baker sold warm bread from a cart, children chased each other between the "
    "stalls, and an old man played the accordion by the fountain until sunset."
)
POEM = "Write a short poem about the sea, the wind and the stars at night:"
YES = [{"role": "user", "content": "Say only: yes"}]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def make_llm(path, **options) -> LLM:
    options = {"num_kv_blocks": KV_BLOCKS, "max_model_len": MAX_LEN, **options}
    return LLM(path, **options)


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


# -- transformers reference ------------------------------------------------------------


class Reference:
    """transformers' SmolLM2 (fp32): logprobs of every position, generate, greedy loops."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = self.tok.eos_token_id

    @lru_cache(maxsize=64)  # noqa: B019 -- one instance per module
    def logits(self, ids: tuple[int, ...]) -> torch.Tensor:
        """[len(ids), V] float32: row i scores the token after ids[: i + 1]."""
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0].float()

    def logprobs(self, ids) -> torch.Tensor:
        return self.logits(tuple(ids)).log_softmax(dim=-1)

    def generate(self, ids: list[int], **kw) -> list[int]:
        ids_t = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(
                ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                pad_token_id=self.eos, **kw,
            )
        return out[0, len(ids):].tolist()

    def penalized_greedy(self, ids: list[int], n: int, presence: float, frequency: float):
        """OpenAI's penalties over the generated tokens only, then arg-max."""
        out: list[int] = []
        for _ in range(n):
            logits = self.logits(tuple(ids + out))[-1].clone()
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                    minlength=logits.shape[0]).float()
            logits -= frequency * counts + presence * (counts > 0).float()
            out.append(int(logits.argmax()))
            if out[-1] == self.eos:
                break
        return out


@pytest.fixture(scope="module")
def ref(smollm2_dir) -> Reference:
    return Reference(smollm2_dir)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, smollm2_dir):
    engine = make_llm(smollm2_dir, async_scheduling=request.param)
    yield engine
    del engine
    gc.collect()


# -- checks shared by logprobs and prompt logprobs --------------------------------------


def check_position(entry, token: int, row: torch.Tensor, k: int, tok) -> None:
    """One position's {token id: Logprob} against transformers' logprobs ``row`` [V]."""
    assert token in entry
    assert entry[token].logprob == pytest.approx(float(row[token]), abs=TOL)
    # the engine's rank (compute_logprobs): tokens at least as likely, itself included
    near = int(((row - row[token]).abs() < TOL).sum())  # itself, plus any near-ties
    expected_rank = int((row >= row[token]).sum())
    if near == 1:
        assert entry[token].rank == expected_rank
    else:
        assert abs(entry[token].rank - expected_rank) < near
    top = sorted((t for t in entry if entry[t].rank <= k), key=lambda t: entry[t].rank)
    assert [entry[t].rank for t in top] == list(range(1, k + 1))
    assert len(entry) in (k, k + 1)  # the top k, plus the chosen token if not among them
    values, ids = row.topk(k + 1)
    for i, t in enumerate(top):
        assert entry[t].logprob == pytest.approx(float(row[t]), abs=TOL)
        isolated = (i == 0 or values[i - 1] - values[i] > TOL) and values[i] - values[i + 1] > TOL
        if isolated:
            assert t == int(ids[i]), f"top-{k} position {i}"
    for t, lp in entry.items():
        assert lp.decoded_token == tok.decode([t])


def check_prompt_logprobs(out, ref: Reference, k: int) -> None:
    ids = out.prompt_token_ids
    rows = ref.logprobs(ids)
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(ids), "one entry per prompt token"
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        check_position(out.prompt_logprobs[i], ids[i], rows[i - 1], k, ref.tok)


# -- 1. logprobs of generated tokens ----------------------------------------------------


def test_logprobs_match_transformers(llm, ref):
    out = run(llm, [PROMPT], greedy(max_tokens=8, logprobs=5))[0]
    sample = out.outputs[0]
    ids = out.prompt_token_ids + sample.token_ids
    rows = ref.logprobs(ids)
    start = len(out.prompt_token_ids) - 1
    assert len(sample.logprobs) == len(sample.token_ids) == 8
    for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        row = rows[start + j]
        assert token == int(row.argmax())  # greedy
        check_position(entry, token, row, 5, ref.tok)
    chosen = [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]
    assert sample.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-9)
    hf_sum = sum(float(rows[start + j, t]) for j, t in enumerate(sample.token_ids))
    assert sample.cumulative_logprob == pytest.approx(hf_sum, abs=TOL * len(chosen))
    assert out.prompt_logprobs is None


def test_zero_logprobs_and_none(llm, ref):
    none, zero = run(llm, [PROMPT, PROMPT], [greedy(max_tokens=2),
                                             greedy(max_tokens=2, logprobs=0, prompt_logprobs=0)])
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None
    assert none.prompt_logprobs is None
    # k = 0: only the chosen (or prompt) token itself, with its logprob and rank
    assert [list(e) for e in zero.outputs[0].logprobs] == [[t] for t in zero.token_ids]
    rows = ref.logprobs(zero.prompt_token_ids + zero.token_ids)
    start = len(zero.prompt_token_ids) - 1
    for j, (token, entry) in enumerate(zip(zero.token_ids, zero.outputs[0].logprobs)):
        check_position(entry, token, rows[start + j], 0, ref.tok)
    check_prompt_logprobs(zero, ref, 0)


def test_each_request_gets_its_own_number_of_logprobs(llm):
    one, five = run(llm, [PROMPT, PROMPT], [greedy(max_tokens=3, logprobs=1),
                                            greedy(max_tokens=3, logprobs=5)])
    assert [len(e) for e in five.outputs[0].logprobs] == [5, 5, 5]
    assert all(len(e) in (1, 2) for e in one.outputs[0].logprobs)


# -- 2. prompt logprobs -----------------------------------------------------------------


def test_prompt_logprobs_match_transformers_with_prefix_caching(llm, ref):
    assert llm.config.enable_prefix_caching
    params = greedy(max_tokens=1, prompt_logprobs=3)
    first = run(llm, [LONG_PROMPT], params)[0]
    check_prompt_logprobs(first, ref, 3)
    # The prompt's blocks are cached now; the same prompt again (twice in one call) must
    # still report every position, not only those after the cached prefix.
    for again in run(llm, [LONG_PROMPT, LONG_PROMPT], params):
        check_prompt_logprobs(again, ref, 3)
    # a cache hit for a request without prompt logprobs (the blocks really are cached)
    plain = run(llm, [LONG_PROMPT], greedy(max_tokens=1))[0]
    assert plain.metrics.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_with_chunked_prefill(smollm2_dir, ref, async_scheduling):
    llm = make_llm(smollm2_dir, max_num_batched_tokens=16, enable_chunked_prefill=True,
                   async_scheduling=async_scheduling)
    out = run(llm, [LONG_PROMPT], greedy(max_tokens=3, prompt_logprobs=3, logprobs=2))[0]
    assert len(out.prompt_token_ids) > 32  # three chunks at least
    assert sum(1 for s in llm.engine.stats.steps if s.num_prefill_tokens) >= 3
    check_prompt_logprobs(out, ref, 3)
    rows = ref.logprobs(out.prompt_token_ids + out.token_ids)
    start = len(out.prompt_token_ids) - 1
    for j, (token, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        check_position(entry, token, rows[start + j], 2, ref.tok)


# -- 3. penalties -----------------------------------------------------------------------


def test_penalties_match_transformers(llm, ref):
    rep, pen = run(llm, [POEM, POEM], [
        greedy(max_tokens=12, repetition_penalty=1.3),
        greedy(max_tokens=12, presence_penalty=0.6, frequency_penalty=0.9),
    ])
    ids = rep.prompt_token_ids
    assert rep.token_ids == ref.generate(ids, repetition_penalty=1.3, max_new_tokens=12)
    assert pen.token_ids == ref.penalized_greedy(ids, 12, presence=0.6, frequency=0.9)
    plain = ref.generate(ids, max_new_tokens=12)
    assert rep.token_ids != plain and pen.token_ids != plain  # the penalties did something


# -- 4. min_tokens, logit_bias, allowed_token_ids, bad_words ------------------------------


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm):
    eos = llm.engine.eos_token_ids
    plain = llm.chat(YES, greedy(max_tokens=20), use_tqdm=False)[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in eos
    assert len(plain.token_ids) < 8  # EOS comes early: min_tokens has work to do
    early = plain.token_ids[1]  # a token the model produces early (".")
    held, stopped, both = llm.chat([YES] * 3, [
        greedy(max_tokens=20, min_tokens=8),
        greedy(max_tokens=20, stop_token_ids=[early]),
        greedy(max_tokens=20, min_tokens=8, stop_token_ids=[early]),
    ], use_tqdm=False)
    assert len(held.token_ids) >= 8 and not eos & set(held.token_ids[:8])
    assert held.token_ids[0] == plain.token_ids[0]
    assert stopped.token_ids == plain.token_ids[:2]
    assert (stopped.finish_reason, stopped.outputs[0].stop_reason) == ("stop", early)
    assert len(both.token_ids) >= 8
    assert not (eos | {early}) & set(both.token_ids[:8])
    if both.finish_reason == "stop":
        assert both.token_ids[-1] in eos | {early}


def test_min_tokens_keeps_the_text_of_an_early_stop_string(llm):
    tok = llm.tokenizer
    out = llm.chat(YES, greedy(max_tokens=20, min_tokens=4, stop=["."]), use_tqdm=False)[0]
    held_text = tok.decode(out.token_ids[:3])  # tokens 1..min_tokens-1 never stop a request
    assert "." in held_text  # "Yes." then more: the stop string did come early
    assert len(out.token_ids) >= 4
    assert out.text.startswith(held_text)


def test_logit_bias_allowed_tokens_and_bad_words(llm):
    tok = llm.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    forced, = enc(" banana")
    a, b = enc(" the")[0], enc(" Paris")[0]
    biased, allowed, plain, no_paris, no_phrase = run(llm, [PROMPT] * 5, [
        SamplingParams(temperature=1.0, seed=3, max_tokens=4, logit_bias={forced: 100}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=[a, b]),
        greedy(max_tokens=12),
        greedy(max_tokens=12, bad_words=["Paris"]),
        greedy(max_tokens=12, bad_words=["Paris", "the capital"]),
    ])
    assert biased.token_ids == [forced] * 4
    assert len(allowed.token_ids) == 8 and set(allowed.token_ids) <= {a, b}
    assert "Paris" in plain.text  # without bad_words the model does say it

    def contains(ids, word):
        return any(ids[i:i + len(word)] == word for i in range(len(ids)))

    for out in (no_paris, no_phrase):
        assert "Paris" not in out.text
        assert not contains(out.token_ids, enc("Paris"))
        assert not contains(out.token_ids, enc(" Paris"))
    # a two-token bad word: its last token is banned right after its first
    assert contains(no_paris.token_ids, enc(" the capital"))  # it would be said otherwise
    assert not contains(no_phrase.token_ids, enc(" the capital"))
    assert not contains(no_phrase.token_ids, enc("the capital"))


# -- 5. parallel sampling (n) -----------------------------------------------------------


def test_parallel_sampling_is_seeded_and_computes_the_prompt_once(llm):
    stats, bs = llm.engine.stats, llm.config.block_size
    tok = llm.tokenizer
    len_a, len_b = len(tok.encode(STORY_A)), len(tok.encode(STORY_B))
    assert len_a >= 48 and len_b >= 48 and len_b % bs != 0

    def prefill_tokens(prompt, params):
        before = stats.num_prefill_tokens
        out = run(llm, [prompt], params)[0]
        return out, stats.num_prefill_tokens - before

    four = SamplingParams(n=4, seed=7, temperature=0.8, max_tokens=8)
    one, computed_one = prefill_tokens(STORY_A, SamplingParams(seed=7, temperature=0.8,
                                                               max_tokens=8))
    first, computed_four = prefill_tokens(STORY_B, four)
    second, computed_again = prefill_tokens(STORY_B, four)
    assert len(one.outputs) == 1 and computed_one == len_a
    # Sample 0 computes the whole prompt; samples 1..3, admitted in the same step, adopt its
    # full blocks from the prefix cache (registered when scheduled) and compute only the
    # rest: at most (len - 1) // bs blocks come from the cache, the last token never does.
    tail = len_b - bs * ((len_b - 1) // bs)
    assert computed_four == len_b + 3 * tail
    assert computed_four - len_b < 3 * bs
    assert computed_again == 4 * tail  # the whole prompt is cached now
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    tokens = [o.token_ids for o in first.outputs]
    assert tokens == [o.token_ids for o in second.outputs]  # reproducible
    assert all(len(t) == 8 for t in tokens) and len(set(map(tuple, tokens))) >= 2
    assert all(o.finish_reason == "length" for o in first.outputs)
    # sample i uses seed + i
    alone = run(llm, [STORY_B], SamplingParams(seed=8, temperature=0.8, max_tokens=8))[0]
    assert alone.token_ids == tokens[1]


def test_parallel_sampling_with_the_largest_seed(llm):
    try:
        params = SamplingParams(n=2, seed=SEED_RANGE[1], max_tokens=2)
    except ValueError:
        return  # rejecting it up front is fine too
    out = run(llm, [PROMPT], params)[0]
    assert [o.finish_reason for o in out.outputs] == ["length", "length"]


# -- 6. preemption ----------------------------------------------------------------------


PREEMPTION_PARAMS = [
    SamplingParams(n=3, seed=11, temperature=0.8, max_tokens=16, ignore_eos=True,
                   presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                   logprobs=2, prompt_logprobs=2),
    greedy(max_tokens=16, ignore_eos=True, repetition_penalty=1.2, logprobs=2),
]


def run_alone(smollm2_dir, **options):
    """Generate PREEMPTION_PARAMS in an engine of its own; (outputs, preemptions)."""
    llm = make_llm(smollm2_dir, **options)
    outputs = run(llm, [POEM, PROMPT], PREEMPTION_PARAMS)
    preemptions = llm.engine.scheduler.num_preemptions
    del llm
    gc.collect()
    return outputs, preemptions


@pytest.fixture(scope="module")
def unpreempted(smollm2_dir):
    outputs, preemptions = run_alone(smollm2_dir, async_scheduling=False)
    assert preemptions == 0
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_samples_penalties_and_logprobs(smollm2_dir, unpreempted,
                                                         async_scheduling):
    # 16 + 16 tokens = 2 blocks a sequence, 4 sequences: 4 blocks hold one and a bit
    preempted, preemptions = run_alone(smollm2_dir, num_kv_blocks=4,
                                       async_scheduling=async_scheduling)
    assert preemptions > 0
    for small, big in zip(preempted, unpreempted):
        assert len(small.outputs) == len(big.outputs)
        for s, b in zip(small.outputs, big.outputs):
            assert s.token_ids == b.token_ids and len(s.token_ids) == 16
            assert len(s.logprobs) == 16
            for es, eb in zip(s.logprobs, b.logprobs):
                assert es.keys() == eb.keys()
                for t in es:
                    assert es[t].logprob == pytest.approx(eb[t].logprob, abs=TOL)
                    assert es[t].rank == eb[t].rank
            assert s.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=16 * TOL)
    assert len({tuple(o.token_ids) for o in preempted[0].outputs}) >= 2  # really sampled
    small, big = preempted[0].prompt_logprobs, unpreempted[0].prompt_logprobs
    assert len(small) == len(big) == len(preempted[0].prompt_token_ids)  # none twice
    for es, eb in zip(small[1:], big[1:]):
        assert es.keys() == eb.keys()
        for t in es:
            assert es[t].logprob == pytest.approx(eb[t].logprob, abs=TOL)


# -- 7. processed logprobs --------------------------------------------------------------


def test_processed_logprobs_include_bias_and_temperature(smollm2_dir, ref):
    llm = make_llm(smollm2_dir, logprobs_mode="processed_logprobs", async_scheduling=False)
    bias_token = ref.tok.encode(" the", add_special_tokens=False)[0]
    bias = {bias_token: 2.5}
    out = run(llm, [PROMPT], SamplingParams(temperature=0.5, seed=5, max_tokens=6,
                                            logit_bias=bias, logprobs=3))[0]
    del llm
    gc.collect()
    sample = out.outputs[0]
    logits = ref.logits(tuple(out.prompt_token_ids + sample.token_ids))
    start = len(out.prompt_token_ids) - 1
    raw_differs = False
    for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
        row = logits[start + j].clone()
        row[bias_token] += 2.5
        processed = (row / 0.5).log_softmax(dim=-1)
        check_position(entry, token, processed, 3, ref.tok)
        raw = logits[start + j].log_softmax(dim=-1)
        raw_differs |= abs(float(raw[token]) - entry[token].logprob) > 10 * TOL
    assert raw_differs  # not the raw distribution


# -- 8. validation ----------------------------------------------------------------------

BAD_NEW_FIELDS = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True), ("n", "2"), ("n", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5), ("logprobs", True),
    ("logprobs", "5"),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", 2.0),
    ("prompt_logprobs", False),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", math.nan),
    ("presence_penalty", math.inf), ("presence_penalty", "1"), ("presence_penalty", None),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01), ("frequency_penalty", math.nan),
    ("frequency_penalty", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", None),
    ("min_tokens", -1), ("min_tokens", 65), ("min_tokens", 1.5), ("min_tokens", True),
    ("min_tokens", None),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: math.inf}),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {1.5: 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", {1: "x"}), ("logit_bias", [1, 2]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.5]),
    ("allowed_token_ids", [True]), ("allowed_token_ids", "12"), ("allowed_token_ids", 5),
    ("bad_words", [""]), ("bad_words", [1]), ("bad_words", "Paris"), ("bad_words", [None]),
]


@pytest.mark.parametrize(("field", "value"), BAD_NEW_FIELDS)
def test_new_fields_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_new_fields_accept_and_normalise_good_values():
    p = SamplingParams(
        n=np.int64(3), logprobs=0, prompt_logprobs=20, presence_penalty=-2,
        frequency_penalty=np.float32(2.0), repetition_penalty=np.float32(0.5),
        min_tokens=64, max_tokens=64, logit_bias={np.int64(5): 1e6, 6: -1e9, 7: 1},
        allowed_token_ids=(np.int64(1), 2), bad_words=("Paris",),
    )
    assert p.n == 3 and type(p.n) is int
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 1.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert p.allowed_token_ids == [1, 2] and all(type(t) is int for t in p.allowed_token_ids)
    assert p.bad_words == ["Paris"]
    assert type(p.frequency_penalty) is float and type(p.repetition_penalty) is float
    words = ["Paris"]
    q = SamplingParams(bad_words=words)
    words.append("London")
    assert q.bad_words == ["Paris"]  # a copy


def test_engine_rejects_token_settings_the_model_cannot_honour(llm):
    vocab = llm.engine.model_config.vocab_size
    tok = llm.tokenizer
    paris = tok.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    eos = sorted(llm.engine.eos_token_ids)
    bad = [
        greedy(logit_bias={vocab: 1.0}),
        greedy(allowed_token_ids=[vocab]),
        greedy(stop_token_ids=[vocab]),
        greedy(allowed_token_ids=paris, bad_words=["Paris"]),  # every allowed token banned
        greedy(allowed_token_ids=eos, min_tokens=1),
    ]
    for params in bad:
        with pytest.raises(ValueError):
            run(llm, [PROMPT], params)
    assert not llm.engine.has_unfinished_requests()

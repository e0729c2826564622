"""The async engine: many producer threads, streams, abort, shutdown, failures, asyncio.

A tiny random Llama with SmolLM2's tokenizer (``test_scheduler.make_tiny_llama``), so
prompts can be text and streamed text can be checked against the final output.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from test_isolation import PoisonablePolicy, run_in_threads
from test_scheduler import make_llm, make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import SamplingParams
from nanovllm.engine.async_engine import HEALTH_CHECK_S, AsyncEngine, EngineError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
WORDS = "alpha beta gamma delta river mountain engine token stream paris code tea".split()


def _prompts(n: int) -> list:
    rng = random.Random(1)
    out = []
    for i in range(n):  # half text (tokenized in the producer threads), half token ids
        if i % 2:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))))
        else:
            out.append([rng.randrange(49152) for _ in range(rng.randint(1, 40))])
    return out


PROMPTS = _prompts(200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-text"), tokenizer_dir=smollm2_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return make_llm(model_dir, num_kv_blocks=512).generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture
def engine(model_dir, request):
    options = getattr(request, "param", {})
    eng = AsyncEngine(make_llm(model_dir, num_kv_blocks=64, **options).engine)
    yield eng
    eng.shutdown(wait=False)
    assert not eng.is_running


ASYNC_TOO = pytest.mark.parametrize(
    "engine", [{}, {"async_scheduling": True}], indirect=True, ids=["sync", "async-scheduling"]
)


@ASYNC_TOO
def test_eight_producers_two_hundred_requests(engine, reference):
    results: dict[int, tuple] = {}

    def producer(k: int) -> None:
        streams = [(i, engine.submit(PROMPTS[i], GREEDY)) for i in range(k, 200, 8)]
        for i, stream in streams:
            chunks = list(stream) if k % 2 else []  # some consumers only want result()
            results[i] = (chunks, stream.result(timeout=60))

    assert run_in_threads(producer, 8) == [] and len(results) == 200
    for i, (chunks, out) in results.items():
        assert out.token_ids == reference[i].token_ids and out.finish_reason == "length"
        assert out.text == reference[i].text
        if chunks:
            assert [t for c in chunks for t in c.token_ids] == out.token_ids
            assert "".join(c.text for c in chunks) == out.text
            assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def test_bad_input_raises_in_the_callers_thread(engine, reference):
    caught = []

    def producer() -> None:
        for bad in ("", [], [10**9], "word " * 600):
            try:
                engine.submit(bad, GREEDY)
            except ValueError as exc:
                caught.append(exc)

    t = threading.Thread(target=producer)
    t.start()
    t.join()
    assert len(caught) == 4
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.submit("hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="request_id"):
        engine.submit("hi", GREEDY, request_id=7)
    first = engine.submit(PROMPTS[1], LONG, request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(PROMPTS[1], GREEDY, request_id="same")
    engine.abort("same")
    assert first.result(timeout=30).finish_reason == "abort"
    assert engine.submit(PROMPTS[0], GREEDY).result(30).token_ids == reference[0].token_ids


@pytest.mark.parametrize(
    "engine",
    [
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": True, "async_scheduling": True},
    ],
    indirect=True,
)
def test_abort_frees_blocks_and_ends_the_stream(engine):
    bm = engine.engine.block_manager
    stream = engine.submit(PROMPTS[2], LONG)
    chunks = iter(stream)
    first = [next(chunks) for _ in range(3)]
    assert engine.abort(stream.request_id)
    # the engine thread acted at a step boundary before abort returned
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    rest = list(chunks)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    out = stream.result(timeout=5)
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 400
    assert [t for c in first + rest for t in c.token_ids] == out.token_ids
    assert list(stream) == []  # read to the end already: no blocking
    assert not engine.abort(stream.request_id)  # already over
    assert not engine.abort("no-such-request")


def test_shutdown_without_wait_ends_every_stream(engine):
    streams = [engine.submit(p, LONG) for p in PROMPTS[:30]]
    engine.shutdown(wait=False)
    assert not engine.is_running
    reasons = [s.result(timeout=0).finish_reason for s in streams]
    assert set(reasons) == {"abort"}
    assert all(list(s)[-1].finish_reason == "abort" for s in streams)
    with pytest.raises(EngineError, match="shut down"):
        engine.submit(PROMPTS[0], GREEDY)
    assert not engine.abort(streams[0].request_id)


def test_shutdown_with_wait_finishes_every_request(engine, reference):
    streams = [engine.submit(p, GREEDY) for p in PROMPTS[:20]]
    engine.shutdown(wait=True)
    outs = [s.result(timeout=0) for s in streams]
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference[:20]]


def test_a_failing_step_fails_every_stream(engine, monkeypatch):
    runner, calls = engine.engine.runner, []
    real_launch = runner.launch

    def flaky_launch(batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_launch(batch)

    monkeypatch.setattr(runner, "launch", flaky_launch)
    streams = [engine.submit(p, LONG) for p in PROMPTS[:10]]
    for stream in streams:
        with pytest.raises(EngineError, match="boom") as info:
            stream.result(timeout=30)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(EngineError):
            list(stream)
    with pytest.raises(EngineError, match="boom"):
        engine.submit(PROMPTS[0], GREEDY)
    engine._thread.join(timeout=5)
    assert not engine.is_running


def test_an_idle_engine_thread_sleeps(engine):
    engine.submit(PROMPTS[0], GREEDY).result(timeout=30)
    time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1  # a spinning loop would burn ~0.5 s
    assert engine.is_running


def test_asyncio_streams_tokens_in_order(engine, reference):
    async def collect(i: int):
        return [chunk async for chunk in engine.stream(PROMPTS[i], GREEDY)]

    async def main():
        all_chunks = await asyncio.gather(*(collect(i) for i in range(12)))
        for i, chunks in enumerate(all_chunks):
            out = chunks[-1].output
            assert chunks[-1].finished and out.token_ids == reference[i].token_ids
            assert [t for c in chunks for t in c.token_ids] == out.token_ids
            assert "".join(c.text for c in chunks) == out.text == reference[i].text
        out = await engine.generate(PROMPTS[5], GREEDY)
        assert out.token_ids == reference[5].token_ids
        with pytest.raises(ValueError):
            engine.stream("", GREEDY)
        # leaving the loop early aborts the request: nobody would read its tokens
        stream = engine.stream(PROMPTS[2], LONG)
        async for _ in stream:
            break
        for _ in range(100):
            if stream.stream.done:
                break
            await asyncio.sleep(0.05)
        assert stream.stream.result(timeout=0).finish_reason == "abort"

    asyncio.run(main())


@ASYNC_TOO
def test_stop_strings_are_never_streamed(engine, reference):
    text = reference[1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # cut the known output in the middle
    params = SamplingParams(temperature=0, max_tokens=8, stop=[stop])
    chunks = list(engine.submit(PROMPTS[1], params))
    out = chunks[-1].output
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert "".join(c.text for c in chunks) == out.text


@pytest.mark.parametrize(
    "engine",
    [{"scheduler_policy": PoisonablePolicy()},
     {"scheduler_policy": PoisonablePolicy(), "async_scheduling": True}],
    indirect=True,
    ids=["sync", "async-scheduling"],
)
def test_one_failing_request_ends_alone_and_the_engine_serves_on(engine, reference):
    good = [engine.submit(PROMPTS[i], GREEDY) for i in range(6)]
    bad = engine.submit(PROMPTS[7], SamplingParams(max_tokens=4, user="poison"))
    later = [engine.submit(PROMPTS[i], GREEDY) for i in range(6, 9)]
    out = bad.result(timeout=30)
    assert out.finish_reason == "error" and "ZeroDivisionError" in out.error
    assert list(bad)[-1].finish_reason == "error"
    for i, stream in enumerate(good + later):
        assert stream.result(timeout=30).token_ids == reference[i].token_ids
    with pytest.raises(ValueError, match="seed"):  # a bad seed never reaches the engine
        engine.submit(PROMPTS[0], SamplingParams(seed=1.5))
    assert engine.submit(PROMPTS[9], GREEDY).result(30).token_ids == reference[9].token_ids
    assert engine.is_running
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_idle_wait_while_requests_take_turns(model_dir, async_scheduling, monkeypatch):
    """A KV cache that holds one request at a time, and a queue: each request can start only
    once the one before it has freed its blocks. The engine thread must go straight on and
    never take its 10 ms "nothing could be scheduled" nap (with async scheduling it used to,
    after every step that only delivered in-flight tokens)."""
    llm = make_llm(model_dir, num_kv_blocks=3, async_scheduling=async_scheduling)
    engine = AsyncEngine(llm.engine)
    naps = []
    real_wait = engine._wakeup.wait

    def wait(timeout=None):
        if timeout is not None and timeout != HEALTH_CHECK_S:  # (an idle engine's check)
            naps.append(timeout)
        return real_wait(timeout)

    monkeypatch.setattr(engine._wakeup, "wait", wait)
    prompts = [list(range(100 * i, 100 * i + 33)) for i in range(8)]  # 3 blocks each
    streams = [engine.submit(p, SamplingParams(temperature=0, max_tokens=4)) for p in prompts]
    assert all(s.result(30).finish_reason == "length" for s in streams)
    engine.shutdown()
    assert naps == []


def test_generated_ids_step_around_user_ids(engine):
    taken = engine.submit(PROMPTS[1], LONG, request_id="1")
    streams = [engine.submit(PROMPTS[0], GREEDY) for _ in range(50)]
    ids = [s.request_id for s in streams]
    assert len(set(ids)) == 50 and "1" not in ids
    assert all(s.result(30).finish_reason == "length" for s in streams)
    engine.abort("1")
    assert taken.result(30).finish_reason == "abort"


def test_the_shared_tokenizer_is_safe_from_many_threads(engine):
    tokenizer = engine.engine.tokenizer
    texts = [p for p in PROMPTS if isinstance(p, str)][:40]
    expected = [(tokenizer.encode(t), tokenizer.decode(tokenizer.encode(t))) for t in texts]
    results = {}

    def work(k):
        for _ in range(20):
            for i in range(k, len(texts), 8):
                ids = tokenizer.encode(texts[i])
                results[i] = (ids, tokenizer.decode(ids))

    assert run_in_threads(work, 8) == []
    assert [results[i] for i in range(len(texts))] == expected


@ASYNC_TOO
def test_n_samples_stream_through_one_stream(engine, model_dir):
    """n > 1: one stream, chunks tagged with their sample; each sample ends once (its
    finish_reason), the last chunk carries the request's output; logprobs travel along."""
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=6, logprobs=2)
    expected = make_llm(model_dir, num_kv_blocks=64).generate(PROMPTS[1], params, use_tqdm=False)
    chunks = list(engine.submit(PROMPTS[1], params))
    out = chunks[-1].output
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in expected[0].outputs]
    for i, sample in enumerate(out.outputs):
        mine = [c for c in chunks if c.index == i]
        assert [t for c in mine for t in c.token_ids] == sample.token_ids
        assert "".join(c.text for c in mine) == sample.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [sample.finish_reason]
        streamed = [lp for c in mine for lp in c.logprobs]
        assert [lp[t].logprob for lp, t in zip(streamed, sample.token_ids)] == [
            lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)
        ]


def test_aborting_an_n_request_frees_every_sample(engine):
    bm = engine.engine.block_manager
    params = SamplingParams(temperature=1.0, n=4, max_tokens=400, ignore_eos=True)
    stream = engine.submit(PROMPTS[2], params)
    chunks = iter(stream)
    next(chunks)
    assert engine.abort(stream.request_id)
    assert bm.num_free_blocks == bm.num_blocks
    out = stream.result(timeout=5)
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 4


def test_coalesce_merges_runs_of_plain_items_and_keeps_the_ends():
    from nanovllm.engine.stream import Item, coalesce

    end = Item([9], 0, None, None, "output")  # a request's last item
    items = [Item([1], 0, ["a"]), Item([2, 3], 0, ["b", "c"]), Item([4], 1, None),
             Item([5], 1, None), Item([6], 0, ["d"]), end]
    assert coalesce(items) == [Item([1, 2, 3], 0, ["a", "b", "c"]), Item([4, 5], 1, None),
                               Item([6], 0, ["d"]), end]
    assert coalesce([]) == [] and coalesce([end, end]) == [end, end]


def test_a_reader_that_falls_behind_gets_every_token_in_fewer_chunks(engine):
    async def slow_reader() -> tuple[list[int], str, int]:
        ids, text, chunks = [], "", 0
        async for chunk in engine.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24)):
            ids += chunk.token_ids
            text += chunk.text
            chunks += 1
            await asyncio.sleep(0.05)  # several engine steps per read
        return ids, text, chunks

    ids, text, chunks = asyncio.run(slow_reader())
    ref = engine.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24)).result(30)
    assert ids == ref.outputs[0].token_ids and text == ref.outputs[0].text
    assert chunks < 24

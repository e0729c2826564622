"""The OpenAI-compatible server with SmolLM2, through the official openai client (sync and
async): completions and chat, streamed and not, stop, n, logprobs, vLLM's extra fields;
greedy tokens equal LLM.generate's; errors in OpenAI's shape; a client that disconnects
frees its blocks. One server for the module (127.0.0.1, a free port), few tokens each.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from serve_helpers import wait_until_idle
from test_scheduler import one_torch_thread  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve import ServeConfig, ServerThread, build_app

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SAMPLED = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=5)
LOGPROBS = SamplingParams(temperature=0, max_tokens=4, logprobs=2)


@pytest.fixture(scope="module", params=["thread", "process"])
def smol(smollm2_dir, request):
    """References from LLM.generate first, then the same engine behind the server: stepped
    by a thread of this process, or (as ``nanovllm serve`` does by default) a copy of it
    in an engine-core process of its own (``core_client.py``)."""
    options = {"num_kv_blocks": 256, "max_num_seqs": 8}
    llm = LLM(smollm2_dir, **options)
    ref = {
        "greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        "chat": llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0],
        "sampled": llm.generate(PROMPTS[2], SAMPLED, use_tqdm=False)[0],
        "logprobs": llm.generate(PROMPTS[0], LOGPROBS, use_tqdm=False)[0],
    }
    if request.param == "process":
        llm.shutdown()
        engine = AsyncEngine.from_model(smollm2_dir, engine_process=True, **options)
    else:
        engine = AsyncEngine(llm.engine)
    app = build_app(engine, ServeConfig(model=str(smollm2_dir), served_model_name=MODEL))
    with ServerThread(app) as server:
        server.engine, server.ref = engine, ref
        yield server
    engine.shutdown(wait=False)


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_completions_greedy_tokens_equal_llm_generate(smol, client):
    for prompt, ref in zip(PROMPTS, smol.ref["greedy"]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True})
        (choice,) = out.choices
        assert choice.token_ids == ref.token_ids and choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason == "length"
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.usage.completion_tokens == 6 and out.model == MODEL
    # a batch of prompts: choices prompt-major, each equal to its own request
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.text for c in out.choices] == [r.text for r in smol.ref["greedy"][:2]]


def test_chat_greedy_equals_llm_chat(smol, client):
    ref = smol.ref["chat"]
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                         temperature=0, extra_body={"return_token_ids": True})
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.token_ids == ref.token_ids and choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    # OpenAI's newer name for the limit
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                         max_completion_tokens=2)
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"


def test_async_client_streams_equal_the_whole_answers(smol):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)

        async def complete(prompt):
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

        async def chat():
            stream = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

        try:
            return await asyncio.gather(*(complete(p) for p in PROMPTS), chat(), chat())
        finally:
            await client.close()

    *completions, chat1, chat2 = asyncio.run(main())
    for chunks, ref in zip(completions, smol.ref["greedy"]):
        *tokens, usage = chunks
        assert "".join(c.choices[0].text for c in tokens) == ref.text
        assert [c.choices[0].finish_reason for c in tokens][-1] == "length"
        assert usage.choices == [] and usage.usage.completion_tokens == 6
    ref = smol.ref["chat"]
    for chunks in (chat1, chat2):
        *deltas, usage = chunks
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.text
        assert deltas[-1].choices[0].finish_reason == ref.finish_reason
        assert usage.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(smol, client, stream):
    text = smol.ref["greedy"][0].text  # " Paris. ..." style continuation
    stop = text[3:6]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, stop=[stop, "never-seen"], stream=stream)
    if stream:
        chunks = list(out)
        got = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        assert chunks[-1].choices[0].stop_reason == stop
    else:
        got, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.choices[0].stop_reason == stop
    assert got == text[: text.index(stop)] and finish == "stop"


def test_n_samples_with_a_seed_equal_llm_generate(smol, client):
    ref = smol.ref["sampled"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, seed=3,
                                    temperature=0.8, max_tokens=5)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [o.text for o in ref.outputs]
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, seed=3,
                                            temperature=0.8, max_tokens=5, stream=True))
    for i, sample in enumerate(ref.outputs):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == sample.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [sample.finish_reason]
    # chat: n choices, one role chunk each
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, n=2,
                                                 max_tokens=3, stream=True, seed=1))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]


def test_logprobs_match_the_engines(smol, client):
    ref = smol.ref["logprobs"].outputs[0]
    expected = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(4)]
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                            temperature=0, logprobs=2, stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in
                c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(expected, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_vllm_extra_fields_through_the_body(smol, client):
    greedy = smol.ref["greedy"][1]
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0,
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "priority": 3,
                    "ignore_eos": True, "min_tokens": 2, "return_token_ids": True},
    )
    assert out.choices[0].token_ids == greedy.token_ids  # top_k=1 is greedy
    first = greedy.token_ids[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3,
                                    temperature=0, extra_body={"stop_token_ids": [first]})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == first
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3,
                                    temperature=0, logit_bias={str(first): -100},
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids[0] != first


BAD = [  # (endpoint, body, status, param or code)
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temprature": 0}, 400, "temprature"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, None),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, 400, None),
    ("completions", {"model": MODEL, "prompt": [1, True]}, 400, "prompt"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "word " * 9000}, 400, "context_length_exceeded"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("completions", [1, 2], 400, "invalid_body"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400,
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": ["hi"] * 20_000}, 400, "too_many_sequences"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["x" * 1001]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "bad_words": ["x"] * 129}, 400,
     "bad_words"),
    ("completions", {"model": MODEL, "prompt": "hi",
                     "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat/completions", {"model": "nope", "messages": QUESTION}, 404, "model_not_found"),
]


@pytest.mark.parametrize("endpoint, body, status, what", BAD)
def test_malformed_requests_get_openai_errors(smol, endpoint, body, status, what):
    r = httpx.post(f"{smol.url}/v1/{endpoint}", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if what is not None:
        assert what in (error["param"], error["code"]), error


def test_malformed_json_and_unknown_routes(smol, client):
    json_type = {"Content-Type": "application/json"}
    r = httpx.post(f"{smol.url}/v1/completions", content=b'{"prompt": "hi",', timeout=30,
                   headers=json_type)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    r = httpx.post(f"{smol.url}/v1/completions", content=b"[1, 2]", headers=json_type)
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    r = httpx.get(f"{smol.url}/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{smol.url}/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # a body that is not JSON -- what a page on another origin could POST without asking
    # (a "simple" cross-origin request) -- is refused unread
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = httpx.post(f"{smol.url}/v1/completions", content=b'{"prompt": "hi"}',
                       headers=headers, timeout=30)
        assert r.status_code == 415, (content_type, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    wait_until_idle(smol.engine)  # nothing was left behind


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(smol):
    load = smol.engine.engine.load
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smol.url}/v1/completions", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
        assert load().kv_usage > 0  # the request holds blocks
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    wait_until_idle(smol.engine, timeout=15)  # aborted (4000 tokens would take minutes)
    # a client that gives up waiting for a whole answer is aborted too
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{smol.url}/v1/completions", json=body, timeout=1.0)
    wait_until_idle(smol.engine)


def test_models_health_tokenize_detokenize_metrics(smol, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == smol.engine.engine.config.max_model_len
    assert card.root == MODEL  # the name served, never the model's folder
    assert httpx.get(f"{smol.url}/docs").status_code == 200  # no keys: the docs are open
    assert httpx.get(f"{smol.url}/health").json() == {"status": "ok"}
    tokens = httpx.post(f"{smol.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    ref = smol.ref["greedy"][0]
    assert tokens["tokens"] == ref.prompt_token_ids and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(f"{smol.url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == smol.ref["chat"].prompt_token_ids
    text = httpx.post(f"{smol.url}/detokenize", json={"tokens": ref.token_ids}).json()
    assert text == {"prompt": ref.text}
    metrics = httpx.get(f"{smol.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total"):
        assert f"nanovllm:{name}" in metrics
    def value(name: str) -> float:
        (line,) = [line for line in metrics.splitlines() if line.startswith(f"nanovllm:{name}")]
        return float(line.split()[-1])

    assert value("e2e_request_latency_seconds_count") >= 1
    assert value("engine_step_seconds_count") >= 2  # the core's steps (here: 2 tokens)
    assert value("engine_step_seconds_sum") > 0

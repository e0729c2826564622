"""The server against hostile clients, with a tiny random model (SmolLM2's tokenizer): a
huge prompt cannot stall other requests (tokenizing runs off the event loop), oversized
requests are refused before any tokenizing, bodies are capped before they are read, a
rate-limited key pays at entry, connections that never finish their headers are closed,
and every outcome -- 400s and aborts included -- is counted."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from serve_helpers import make_tiny_chat_model, running_server, wait_until_idle
from test_scheduler import one_torch_thread  # noqa: F401

from nanovllm.serve.config import ApiKey, Limits

MAX_LEN = 512  # the tiny model's context
BODY_LIMIT = 64 * 1024
OPEN, SLOW = {"Authorization": "Bearer sk-open"}, {"Authorization": "Bearer sk-slow"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, smollm2_dir):
    tiny = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-hostile"), smollm2_dir, MAX_LEN)
    keys = [ApiKey("sk-open", "open"), ApiKey("sk-slow", "slow", "slow")]
    classes = {"slow": Limits(requests_per_second=1, burst=1)}
    with running_server(tiny, engine_options={"num_kv_blocks": 128}, api_keys=keys,
                        key_classes=classes, max_body_bytes=BODY_LIMIT,
                        header_timeout=1.0) as server:
        yield server


class SlowEncode:
    """The tokenizer's ``encode``, but each call takes ``delay`` seconds (a huge prompt's
    time without a huge prompt); ``calls`` counts them, ``busy`` is set while one runs."""

    def __init__(self, encode, delay: float = 0.0) -> None:
        self.encode, self.delay, self.calls, self.busy = encode, delay, 0, threading.Event()

    def __call__(self, text, **kwargs):
        self.calls += 1
        self.busy.set()
        time.sleep(self.delay)
        return self.encode(text, **kwargs)


@pytest.fixture
def slow_tokenizer(srv, monkeypatch):
    tokenizer = srv.engine.engine.tokenizer  # the one the server encodes prompts with
    spy = SlowEncode(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", spy)
    return spy


def complete(srv, headers=OPEN, **body) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=headers, timeout=60,
                      json={"max_tokens": 2, **body})


def test_health_answers_while_a_prompt_is_tokenized(srv, slow_tokenizer):
    slow_tokenizer.delay = 3.0
    answers = []
    worker = threading.Thread(target=lambda: answers.append(complete(srv, prompt="tea " * 100)))
    worker.start()
    assert slow_tokenizer.busy.wait(30)
    start = time.monotonic()
    health = httpx.get(f"{srv.url}/health", timeout=30)
    models = httpx.get(f"{srv.url}/v1/models", headers=OPEN, timeout=30)
    waited = time.monotonic() - start
    worker.join(60)
    assert health.status_code == 200 and models.status_code == 200
    assert waited < 1.0, f"/health waited {waited:.2f} s for the tokenizer"
    assert answers[0].status_code == 200, answers[0].text


CAPPED = [  # (body, param or code): each refused before the tokenizer sees it
    ({"prompt": "tea " * (4 * MAX_LEN + 1)}, "context_length_exceeded"),  # > 16 chars/token
    ({"prompt": ["t"] * 2_000}, "too_many_sequences"),  # more than the queue holds
    ({"prompt": "tea", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "tea", "bad_words": ["a"] * 129}, "bad_words"),
    ({"prompt": "tea", "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ({"prompt": "tea", "max_tokens": 10**12}, "context_length_exceeded"),
]


@pytest.mark.parametrize("body, what", CAPPED)
def test_oversized_requests_are_refused_before_tokenizing(srv, slow_tokenizer, body, what):
    r = complete(srv, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert what in (error["param"], error["code"]), error
    assert slow_tokenizer.calls == 0


def test_max_tokens_beyond_the_context_is_a_400_not_clamped(srv):
    r = complete(srv, prompt="tea river", max_tokens=MAX_LEN - 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "context length is 512" in r.json()["error"]["message"]
    assert complete(srv, prompt="tea river", max_tokens=MAX_LEN - 8).status_code == 200


def test_the_body_is_capped_before_it_is_read(srv):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    r = httpx.post(f"{srv.url}/v1/completions", content=big, timeout=30,
                   headers={**OPEN, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), timeout=30,
                   headers={**OPEN, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text


def test_a_rate_limited_key_pays_at_entry(srv):
    """Six too-long prompts at once from a key limited to one request per second: one is
    read (and refused: 400), five are turned away at the door (429)."""
    statuses, start = [], threading.Barrier(6)

    def send() -> None:
        start.wait()
        statuses.append(complete(srv, SLOW, prompt="tea " * (4 * MAX_LEN + 1)).status_code)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(statuses) == [400] + [429] * 5


def test_401_names_its_scheme_and_the_docs_are_closed_with_keys(srv):
    r = complete(srv, headers={}, prompt="tea")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{srv.url}{path}").status_code == 404


def test_a_connection_that_never_finishes_its_headers_is_closed(srv):
    with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server (not by our 10 s timeout)
        assert time.monotonic() - start < 5
    with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request is served
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")


def counter(srv, name: str, label: str) -> float:
    metrics = httpx.get(f"{srv.url}/metrics").text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(f"nanovllm:{name}") and label in line)


def test_400s_and_aborts_are_counted(srv):
    before = counter(srv, "request_rejected_total", 'reason="invalid_request_error"')
    assert complete(srv, prompt="tea", temperature=-1).status_code == 400
    after = counter(srv, "request_rejected_total", 'reason="invalid_request_error"')
    assert after == before + 1
    aborts = counter(srv, "request_success_total", 'finished_reason="abort"')
    body = {"prompt": "tea", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=OPEN,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    wait_until_idle(srv.engine, timeout=15)
    deadline = time.monotonic() + 10
    while counter(srv, "request_success_total", 'finished_reason="abort"') < aborts + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)

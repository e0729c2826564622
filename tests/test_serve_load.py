"""The server under load, with a tiny random Llama (SmolLM2's tokenizer and chat template,
milliseconds per step, so a thousand requests fit in seconds on a 2-core CPU): 1,000 mixed
requests from 32 concurrent clients; a flood turned away with 429 while admitted requests
finish; API keys, per-key rate limits, priority and tenant per key; the load generator.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import make_tiny_chat_model, running_server, wait_until_idle
from test_scheduler import one_torch_thread  # noqa: F401

from nanovllm.serve.config import ApiKey, Limits

WORDS = "alpha beta gamma delta river mountain engine token stream paris code tea".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


def client_for(server, key: str = "none", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60,
                         **options)


def run_clients(work, n: int) -> list[BaseException]:
    """``work(k)`` on n threads started together; the errors they raised."""
    errors, start = [], threading.Barrier(n)

    def guarded(k):
        start.wait()
        try:
            work(k)
        except BaseException as err:  # noqa: BLE001 -- returned to the test
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return errors


def mixed_request(client: openai.OpenAI, rng: random.Random) -> tuple[int, set[str]]:
    """One request of a random kind; returns (choices seen, finish reasons)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    n, stream, max_tokens = rng.choice([1, 1, 1, 2]), rng.random() < 0.5, rng.randint(1, 3)
    extra = {"stop": [rng.choice(WORDS)]} if rng.random() < 0.2 else {}
    if rng.random() < 0.5:
        out = client.completions.create(model="tiny", prompt=prompt, n=n, stream=stream,
                                        max_tokens=max_tokens, temperature=0.7, **extra)
    else:
        messages = [{"role": "user", "content": prompt}]
        out = client.chat.completions.create(model="tiny", messages=messages, n=n, stream=stream,
                                             max_tokens=max_tokens, temperature=0.7, **extra)
    choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
    finished = {c.index: c.finish_reason for c in choices if c.finish_reason}
    assert sorted(finished) == list(range(n)), finished
    return n, set(finished.values())


def test_a_thousand_mixed_requests_from_32_clients(tiny):
    """None lost, none failed, no block leaked, within a time bound."""
    with running_server(tiny, engine_options={"num_kv_blocks": 256, "max_num_seqs": 32}) as srv:
        results, start = [], time.perf_counter()

        def client_loop(k: int) -> None:
            rng, client = random.Random(k), client_for(srv)
            for _ in range(1000 // 32 + (k < 1000 % 32)):
                results.append(mixed_request(client, rng))

        assert run_clients(client_loop, 32) == []
        elapsed = time.perf_counter() - start
        assert len(results) == 1000
        assert set().union(*(reasons for _, reasons in results)) <= {"stop", "length"}
        wait_until_idle(srv.engine, timeout=10)
        metrics = httpx.get(f"{srv.url}/metrics").text
    print(f"1,000 requests from 32 clients in {elapsed:.1f} s")
    assert elapsed < 120
    ended = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("nanovllm:request_success_total"))
    assert ended == sum(n for n, _ in results)


def test_a_flood_gets_429_while_admitted_requests_finish(tiny):
    options = {"num_kv_blocks": 256, "max_num_seqs": 2}
    with running_server(tiny, engine_options=options, max_queue_depth=2) as srv:
        done, refused = [], []

        def flood(k: int) -> None:
            client = client_for(srv)
            try:
                out = client.completions.create(model="tiny", prompt=f"{WORDS[k % 12]} river",
                                                max_tokens=60, extra_body={"ignore_eos": True})
                done.append(out.choices[0])
            except openai.RateLimitError as err:
                refused.append(err)

        assert run_clients(flood, 24) == []
        assert len(done) + len(refused) == 24
        assert 4 <= len(done) < 24 and refused  # capacity: 2 running + 2 waiting
        assert all(c.finish_reason == "length" and c.text for c in done)
        for err in refused:
            assert int(err.response.headers["retry-after"]) >= 1
            assert err.body["code"] == "queue_full"
        wait_until_idle(srv.engine, timeout=10)
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert f'reason="queue_full"}} {float(len(refused))}' in metrics


KEYS = [ApiKey("sk-alice", "alice", "interactive"), ApiKey("sk-bob", "bob", "batch"),
        ApiKey("sk-slow", "slow", "slow"), ApiKey("sk-thrifty", "thrifty", "thrifty")]
CLASSES = {"interactive": Limits(priority=0), "batch": Limits(priority=10),
           "slow": Limits(requests_per_second=0.25, burst=1),
           "thrifty": Limits(tokens_per_minute=30)}


def test_api_keys_limits_priority_and_tenants(tiny, monkeypatch):
    serve = {"api_keys": KEYS, "key_classes": CLASSES}
    with running_server(tiny, engine_options={"num_kv_blocks": 64}, **serve) as srv:
        seen = []
        real_stream = srv.engine.stream

        def spy(prompt, params, request_id=None, priority=0):
            seen.append((params.user, params.request_class, priority))
            return real_stream(prompt, params, request_id, priority)

        monkeypatch.setattr(srv.engine, "stream", spy)
        ask = lambda client, **kw: client.completions.create(model="tiny", prompt="tea",
                                                             max_tokens=2, **kw)
        with pytest.raises(openai.AuthenticationError):
            ask(client_for(srv))  # no key
        with pytest.raises(openai.AuthenticationError) as info:
            ask(client_for(srv, "sk-mallory"))
        assert info.value.body["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/health").status_code == 200  # open to probes
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        # priority: the key class's plus the request's; tenant and class: the key's
        ask(client_for(srv, "sk-alice"), user="ignored-with-keys")
        ask(client_for(srv, "sk-bob"), extra_body={"priority": 1})
        assert seen == [("alice", "interactive", 0), ("bob", "batch", 11)]
        # requests per second: a burst of one, then wait about 4 s
        slow = client_for(srv, "sk-slow")
        ask(slow)
        with pytest.raises(openai.RateLimitError) as info:
            ask(slow)
        assert 1 <= int(info.value.response.headers["retry-after"]) <= 4
        assert info.value.body["code"] == "rate_limit_exceeded"
        # tokens per minute: the prompt is taken on entry, the generated tokens at the end
        thrifty = client_for(srv, "sk-thrifty")
        thrifty.completions.create(model="tiny", prompt="tea", max_tokens=40,
                                   extra_body={"ignore_eos": True})
        with pytest.raises(openai.RateLimitError) as info:
            ask(thrifty)  # 41 of 30 tokens spent: in debt
        assert int(info.value.response.headers["retry-after"]) >= 20
        ask(client_for(srv, "sk-alice"))  # other keys are not affected
        wait_until_idle(srv.engine, timeout=10)


def test_without_keys_the_user_field_names_the_tenant(tiny, monkeypatch):
    with running_server(tiny, engine_options={"num_kv_blocks": 64}) as srv:
        seen = []
        real_stream = srv.engine.stream
        monkeypatch.setattr(srv.engine, "stream", lambda prompt, params, rid=None, pr=0: (
            seen.append((params.user, pr)) or real_stream(prompt, params, rid, pr)))
        client = client_for(srv)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, user="carol", extra_body={"priority": -2})
        assert seen == [("carol", -2)]


def test_the_load_generator_reports_latency_percentiles(tiny, tmp_path):
    from nanovllm.benchmarks.serve import main

    with running_server(tiny, engine_options={"num_kv_blocks": 256}) as srv:
        out = tmp_path / "load.json"
        main(["--base-url", srv.url, "--model", "tiny", "--rates", "20", "inf",
              "--num-requests", "12", "--input-len", "8", "--output-len", "4", "--seed", "0",
              "--slo-ttft", "10", "--slo-tpot", "10", "--json", str(out),
              "--figure", str(tmp_path / "load.png")])
        wait_until_idle(srv.engine, timeout=10)
    report = json.loads(out.read_text())
    assert [run["rate"] for run in report["runs"]] == [20, "inf"]
    for run in report["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0
        assert run["output_tokens"] == 12 * 4
        for metric in ("ttft", "tpot", "itl", "e2e"):
            stats = run[metric]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert run["goodput_rps"] == pytest.approx(run["request_throughput_rps"])
    assert (tmp_path / "load.png").stat().st_size > 0


def test_draining_answers_503_and_a_dead_engine_500_then_503(tiny, monkeypatch):
    with running_server(tiny, engine_options={"num_kv_blocks": 64}) as srv:
        client, serving = client_for(srv), srv.app.state.serving
        serving.draining = True  # what SIGTERM sets (test_serve_cli drains a real process)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="tea", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "unavailable"
        assert httpx.get(f"{srv.url}/health").status_code == 503
        serving.draining = False
        runner = srv.engine.engine.runner
        monkeypatch.setattr(runner, "launch", lambda batch: 1 / 0)  # the forward pass fails
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="tea", max_tokens=2)
        assert info.value.status_code == 500 and info.value.body["code"] == "engine_error"
        assert "ZeroDivisionError" in info.value.message
        srv.engine._thread.join(10)  # the engine stopped: every later request is refused
        stream = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                            json={"prompt": "tea", "max_tokens": 2, "stream": True})
        assert stream.status_code == 503 and httpx.get(f"{srv.url}/health").status_code == 503


@pytest.mark.parametrize("policy, alice_priority", [
    ("fcfs", 0), ("priority", 0), ("priority", -1000), ("fair", 0)])
def test_the_schedulers_policy_follows_the_keys(tiny, policy, alice_priority):
    """One slot; alice (class batch, priority 10) queues four requests, then bob (class
    interactive, priority 0) sends one. First come, first served: bob is last. Priority
    (his class) and fair (his own tenant) serve him next -- even when alice asks for
    priority -1000: a request may step back from its class, never ahead of it."""
    keys = [ApiKey("sk-alice", "alice", "batch"), ApiKey("sk-bob", "bob", "interactive")]
    classes = {"batch": Limits(priority=10), "interactive": Limits(priority=0)}
    options = {"num_kv_blocks": 64, "max_num_seqs": 1, "scheduler_policy": policy}
    with running_server(tiny, engine_options=options, api_keys=keys, key_classes=classes) as srv:
        order, scheduler = [], srv.engine.engine.scheduler

        def send(name: str) -> None:  # alice's long enough for bob to arrive in time
            client_for(srv, f"sk-{name}").completions.create(
                model="tiny", prompt="tea", max_tokens=150 if name == "alice" else 30,
                extra_body={"ignore_eos": True,
                            "priority": alice_priority if name == "alice" else 0})
            order.append(name)

        alices = [threading.Thread(target=send, args=("alice",)) for _ in range(4)]
        for t in alices:
            t.start()
        deadline = time.monotonic() + 30
        while len(scheduler.waiting) < 3:  # one runs, three wait
            assert time.monotonic() < deadline
            time.sleep(0.001)
        bob = threading.Thread(target=send, args=("bob",))
        bob.start()
        for t in [*alices, bob]:
            t.join(60)
    assert sorted(order) == ["alice"] * 4 + ["bob"]
    assert order.index("bob") == 4 if policy == "fcfs" else order.index("bob") <= 1, order


def test_the_load_generator_can_launch_its_own_server(tiny):
    from nanovllm.benchmarks.serve import main

    report = main(["--launch", str(tiny), "--option", "num_kv_blocks=128", "--rates", "inf",
                   "--num-requests", "4", "--input-len", "4", "--output-len", "3"])
    (run,) = report["runs"]
    assert run["completed"] == 4 and run["output_tokens"] == 12 and report["device"] == "cpu"

"""``python -m nanovllm.serve`` as a process: SIGTERM drains (requests in flight finish,
what outlives the grace period is aborted, new requests and ``/health`` get 503 meanwhile,
the process exits with status 0);
and the command line's errors. A tiny random model with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_helpers import make_tiny_chat_model, wait_for_health

from nanovllm.serve.cli import main

GRACE = 3.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-cli"), smollm2_dir, max_len=8192)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_events(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_sigterm_drains_then_exits(tiny):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nanovllm.serve", str(tiny), "--port", str(port),
           "--served-model-name", "tiny", "--grace-period", str(GRACE), "--log-level", "warning",
           "--option", "num_kv_blocks=1024"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, url)
        # A finishes within the grace period; B (8,000 tokens) cannot
        bodies = {"short": 30, "long": 8000}
        events = {name: [] for name in bodies}
        started = {name: threading.Event() for name in bodies}
        threads = [
            threading.Thread(target=stream_events, args=(
                f"{url}/v1/completions",
                {"prompt": "tea river", "max_tokens": n, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}},
                events[name], started[name]))
            for name, n in bodies.items()
        ]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started.values())
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # draining: still listening, but new requests and the health check get 503
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
        assert int(late.headers["retry-after"]) >= 1
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        for t in threads:
            t.join(GRACE + 30)
        returncode = proc.wait(GRACE + 30)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read().decode()
    assert returncode == 0, log  # a shutdown that was asked for, not death by signal
    assert elapsed < GRACE + 15
    for name, n in bodies.items():
        assert events[name][-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[name][:-1]]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        generated = chunks[-1]["usage"]["completion_tokens"]  # (a chunk may carry several)
        if name == "short":
            assert reasons[-1] == "length" and generated == n
        else:
            assert reasons[-1] == "abort" and generated < n


def test_help_and_config_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    usage = capsys.readouterr().out
    assert info.value.code == 0
    assert all(flag in usage for flag in ("--grace-period", "--max-body-bytes", "--header-timeout"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: /nowhere\nlimits: {requests_per_second: fast}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "limits.requests_per_second must be a number > 0" in capsys.readouterr().err
    assert main(["serve", "/nowhere", "--option", "no_such_knob=1"]) == 2
    assert "engine.no_such_knob" in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 2  # not a model folder: EngineConfig says so
    assert "config.json" in capsys.readouterr().err

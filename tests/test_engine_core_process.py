"""The engine core in its own process (chapter 10 §6, ``nanovllm/engine/core_client.py``):
what a thread-stepped engine guarantees holds across the process boundary, and the core's
death is an error for every open request -- a 503 from the server, whose process then exits
with status 1 -- never a hang. (tests/test_serve.py runs the whole API in both modes.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import make_tiny_chat_model, wait_for_health, wait_until_idle
from test_scheduler import make_llm, one_torch_thread  # noqa: F401
from test_serve_cli import free_port

from nanovllm import SamplingParams
from nanovllm.engine.async_engine import AsyncEngine, EngineError
from nanovllm.serve import ServeConfig, ServerThread, build_app

PROMPTS = ["tea river stone", "one two three four", "a b", "light rain on the hills"]
OPTIONS = {"num_kv_blocks": 128, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_tiny_chat_model(tmp_path_factory.mktemp("core") / "tiny", smollm2_dir)


def test_same_tokens_logprobs_and_samples_as_in_process(tiny):
    params = [SamplingParams(temperature=0, max_tokens=9, logprobs=2),
              SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[5, 9, 11])]
    ref = make_llm(tiny, **OPTIONS).generate(PROMPTS[:3], params, use_tqdm=False)
    with AsyncEngine.from_model(tiny, engine_process=True, **OPTIONS) as engine:
        outs = [engine.submit(p, sp).result(120) for p, sp in zip(PROMPTS, params)]
        for ours, theirs in zip(outs, ref):
            assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
            assert ([c.finish_reason for c in ours.outputs]
                    == [c.finish_reason for c in theirs.outputs])
        assert outs[0].outputs[0].cumulative_logprob == pytest.approx(
            ref[0].outputs[0].cumulative_logprob, abs=1e-4)
        m = outs[0].metrics  # the core's clock readings reached this process
        assert m.first_token_time is not None and m.finished_time >= m.first_token_time
        assert m.num_output_tokens == 9 and m.time_to_first_token > 0
        stats = engine.engine.stats  # and so did its steps
        assert stats.num_steps >= 9 and stats.num_decode_tokens >= 8


def test_abort_frees_blocks_and_reports_the_tokens_before_it(tiny):
    with AsyncEngine.from_model(tiny, engine_process=True, **OPTIONS) as engine:
        stream = engine.submit(PROMPTS[0], SamplingParams(max_tokens=5000, ignore_eos=True))
        seen = []
        for chunk in stream:
            seen += chunk.token_ids
            if len(seen) >= 5:
                break
        assert engine.abort(stream.request_id) is True
        out = stream.result(30)
        assert out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].token_ids[:len(seen)] == seen  # nothing lost or reordered
        wait_until_idle(engine)
        assert engine.abort(stream.request_id) is False  # finished: nothing to abort
        with pytest.raises(ValueError, match="prompt"):  # validated here, at once
            engine.submit("", SamplingParams())


def test_structured_output_across_the_process_boundary(tiny):
    from nanovllm import StructuredOutputsParams

    choices = ["tea", "river", "stone"]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    with AsyncEngine.from_model(tiny, engine_process=True, **OPTIONS) as engine:
        out = engine.submit(PROMPTS[0], constrained).result(120)
        assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
        with pytest.raises(ValueError):  # a bad constraint is refused here, at once
            engine.submit(PROMPTS[0], SamplingParams(
                structured_outputs=StructuredOutputsParams(regex="(unclosed")))


def test_a_bad_engine_option_is_a_value_error_from_the_core(tiny):
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncEngine.from_model(tiny, engine_process=True, max_model_len=10**6, **OPTIONS)


def test_killing_the_core_ends_every_request_with_503_and_health_fails(tiny):
    engine = AsyncEngine.from_model(tiny, engine_process=True, **OPTIONS)
    app = build_app(engine, ServeConfig(model=str(tiny), served_model_name="tiny"))
    with ServerThread(app) as server:
        body = {"prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True}  # (of 512)
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={**body, "stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            os.kill(engine.engine.process.pid, signal.SIGKILL)
            rest = list(lines)  # the stream ends (with an error event): it does not hang
        assert any("error" in line for line in rest), rest[-3:]
        late = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "unavailable"
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert not engine.is_running
        with pytest.raises(EngineError):
            engine.submit(PROMPTS[0])
    engine.shutdown(wait=False)


def test_a_request_in_flight_when_the_core_dies_gets_503(tiny):
    engine = AsyncEngine.from_model(tiny, engine_process=True, **OPTIONS)
    app = build_app(engine, ServeConfig(model=str(tiny), served_model_name="tiny"))
    body = {"prompt": PROMPTS[2], "max_tokens": 480, "ignore_eos": True}
    answer = {}
    with ServerThread(app) as server:
        waiting = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"{server.url}/v1/completions", json=body, timeout=60)))
        waiting.start()
        deadline = time.monotonic() + 30
        while engine.engine.stats.num_steps < 3:  # it is being decoded
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        os.kill(engine.engine.process.pid, signal.SIGKILL)
        waiting.join(60)
    assert answer["r"].status_code == 503, answer["r"].text
    assert "engine-core process exited" in answer["r"].json()["error"]["message"]
    engine.shutdown(wait=False)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_the_server_process_exits_1_when_its_core_dies(tiny):
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm.serve", str(tiny), "--port", str(port),
           "--served-model-name", "tiny", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}")
        cores = [c for c in children(proc.pid)
                 if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(cores) == 1, children(proc.pid)
        os.kill(cores[0], signal.SIGKILL)  # while idle: the engine thread's health check
        assert proc.wait(timeout=30) == 1
        assert b"engine has stopped" in proc.stdout.read()  # it said why
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

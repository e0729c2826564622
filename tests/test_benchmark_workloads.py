"""The throughput benchmark's workloads and its latency measurements (issue 17; chapter 11).

The shapes of ``long-prompts``, ``shared-prefix`` and ``arrivals`` (``benchmarks/workload.py``),
the default workloads unchanged draw for draw, latency percentiles on known numbers, the
concurrency cap and arrival times of ``latency.drive`` on a tiny random Llama, and the CLI
(``python -m nanovllm.benchmarks.throughput``) end to end on a CPU with tiny sizes.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_scheduler import make_tiny_llama, one_torch_thread  # noqa: F401 (autouse fixture)

from nanovllm import LLM
from nanovllm.benchmarks import latency
from nanovllm.benchmarks.throughput import main as throughput_main
from nanovllm.benchmarks.workload import WORKLOADS, Workload, make_workload, warm_up
from nanovllm.configs import config_path
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def digest(work: Workload) -> str:
    return hashlib.sha256(json.dumps([work.prompts, work.output_lens]).encode()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16384  # room for a long prompt past 8192 tokens
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    engine = LLM(str(tiny), device="cpu", num_kv_blocks=256)
    warm_up(engine)
    return engine


# -- the workloads -----------------------------------------------------------------------
def test_default_workloads_are_unchanged():
    """Recorded results (figures/data/bench_*.json) were measured on exactly these draws."""
    nano = make_workload("nano-vllm")
    assert nano.output_tokens == 133_966 and sum(map(len, nano.prompts)) == 142_827
    assert digest(nano) == "199c6f016a1bff739fe399ef430e2e67b723ccc922222a34259e5aaa10a10243"
    cpu = make_workload("cpu")
    assert cpu.output_tokens == 3023
    assert digest(cpu) == "daedfa9d0ed99d744c19a0d66737f6043cbe58dc07714592c920603410fb3775"
    assert nano.arrival_times is None and cpu.arrival_times is None
    # arrivals drawn after the lengths leave the requests themselves alone
    assert digest(make_workload("nano-vllm", request_rate=4.0)) == digest(nano)


def test_long_prompts_shape():
    work = make_workload("long-prompts")
    assert len(work.prompts) == 16 and work.output_lens == [128] * 16
    assert all(8192 <= len(p) <= 32768 for p in work.prompts)
    assert max(map(len, work.prompts)) > 24_000  # the range is really used
    qwen = json.loads((config_path("qwen3-0.6b") / "config.json").read_text())
    assert 8192 < work.max_model_len <= qwen["max_position_embeddings"]
    small = make_workload("long-prompts", 2, length_scale=1 / 64)
    assert small.output_lens == [2, 2] and all(128 <= len(p) <= 512 for p in small.prompts)


def test_shared_prefix_shape():
    work = make_workload("shared-prefix")
    assert len(work.prompts) == 128 and work.shared_prefix_len == 2048
    system = work.prompts[0][:2048]
    assert all(p[:2048] == system for p in work.prompts)
    own = [p[2048:] for p in work.prompts]
    assert all(64 <= len(o) <= 256 for o in own)
    assert len({tuple(o[:8]) for o in own}) == 128  # every user turn its own
    assert all(64 <= n <= 256 for n in work.output_lens)
    small = make_workload("shared-prefix", 3, length_scale=0.02)
    assert small.shared_prefix_len == 41 and all(p[:41] == small.prompts[0][:41]
                                                 for p in small.prompts)


def test_arrivals_shape_and_seeding():
    work = make_workload("arrivals")
    times = work.arrival_times
    assert len(work.prompts) == len(times) == 256 and times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / 16) < 0.2 / 16  # Poisson at the default 16 requests/s
    lens = [len(p) for p in work.prompts]
    assert min(lens) >= 16 and max(lens) <= 4096 and np.median(lens) < 1000  # mixed, skewed
    assert all(16 <= n <= 1024 for n in work.output_lens)
    again = make_workload("arrivals")
    assert again.arrival_times == times and digest(again) == digest(work)
    assert make_workload("arrivals", seed=1).arrival_times != times
    faster = make_workload("arrivals", request_rate=64.0)
    assert digest(faster) == digest(work) and faster.arrival_times[-1] < times[-1] / 2
    assert make_workload("arrivals", 4, request_rate=math.inf).arrival_times == [0.0] * 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope"), "unknown workload"),
    (dict(name="nano-vllm", length_scale=0.5), "length_scale"),
    (dict(name="arrivals", length_scale=0), "length_scale"),
    (dict(name="arrivals", request_rate=0.0), "request_rate"),
    (dict(name="cpu", num_requests=0), "num_requests"),
])
def test_bad_workload_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_workload(**kwargs)


# -- latency figures on known numbers ----------------------------------------------------
def test_latency_percentiles_on_synthetic_metrics():
    ttfts = [0.1 * (i + 1) for i in range(10)]  # 0.1 .. 1.0 s
    gaps = [0.01 * (i + 1) for i in range(10)]  # one decode gap per request
    metrics = []
    for i, (ttft, gap) in enumerate(zip(ttfts, gaps)):
        tokens = 1 if i == 0 else 5  # the first: one token, so no TPOT
        first = 100.0 + ttft
        metrics.append(RequestMetrics(
            arrival_time=100.0, first_scheduled_time=100.0 + ttft / 2, first_token_time=first,
            last_token_time=first + gap * (tokens - 1), finished_time=first + gap * (tokens - 1),
            num_output_tokens=tokens))
    stats = latency.latency_stats(metrics)
    assert set(stats) == {"ttft_s", "tpot_s", "e2e_s", "queue_s"}
    for q in (50, 90, 99):
        assert stats["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q))
        assert stats["tpot_s"][f"p{q}"] == pytest.approx(np.percentile(gaps[1:], q))
        assert stats["queue_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q) / 2)
    assert stats["ttft_s"]["count"] == 10 and stats["tpot_s"]["count"] == 9
    assert stats["ttft_s"]["mean"] == pytest.approx(0.55)
    assert latency.latency_stats([])["tpot_s"] == {"count": 0}


def test_prefix_cache_stats_counts_cached_prompt_tokens():
    def output(n_prompt: int, cached: int) -> RequestOutput:
        metrics = RequestMetrics(0.0, num_cached_prompt_tokens=cached)
        done = CompletionOutput(0, "", [1], "length")
        return RequestOutput("r", None, list(range(n_prompt)), [done], True, metrics)

    stats = latency.prefix_cache_stats([output(100, 0), output(100, 64), output(200, 96)])
    assert stats == {"prompt_tokens": 400, "cached_prompt_tokens": 160,
                     "prefix_cache_hit_rate": 0.4}


# -- driving the engine --------------------------------------------------------------------
def small_work(n: int, seed: int = 0) -> Workload:
    work = make_workload("cpu", n, seed)
    return Workload([p[:24] for p in work.prompts], [1 + n % 5 for n in work.output_lens])


def test_concurrency_cap_is_respected(llm):
    engine = llm.engine
    seen = []
    step = engine.step

    def counting_step():
        seen.append(len(engine.requests))  # unfinished requests as each step starts
        return step()

    engine.step = counting_step
    try:
        run = latency.drive(llm, small_work(7), concurrency=2)
    finally:
        del engine.step
    assert max(seen) == 2 and run.peak_concurrency == 2
    assert [len(o.token_ids) for o in run.outputs] == small_work(7).output_lens
    assert not engine.has_unfinished_requests()
    assert latency.drive(llm, small_work(7, seed=1)).peak_concurrency == 7  # no cap: all at once
    with pytest.raises(ValueError, match="concurrency"):
        latency.drive(llm, small_work(2), concurrency=0)


def test_requests_enter_at_their_arrival_times(llm):
    work = small_work(4, seed=2)
    work.arrival_times = [0.0, 0.05, 0.1, 0.3]
    run = latency.drive(llm, work)
    arrivals = [o.metrics.arrival_time for o in run.outputs]
    assert np.allclose(np.subtract(arrivals, arrivals[0]), work.arrival_times)
    assert all(o.metrics.first_scheduled_time >= o.metrics.arrival_time for o in run.outputs)
    assert run.seconds >= 0.3


def test_sweep_gives_one_row_per_level(llm):
    levels = [(1, small_work(3, seed=3)), (2, small_work(4, seed=4))]
    rows = latency.sweep_concurrency(llm, levels)
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert [r["requests"] for r in rows] == [3, 4]
    assert [r["peak_concurrency"] for r in rows] == [1, 2]
    assert all(r["ttft_s"]["count"] == r["requests"] and r["output_tok_s"] > 0 for r in rows)
    assert latency.level_requests(1) == 16 and latency.level_requests(64) == 256


# -- the CLI, end to end -------------------------------------------------------------------
def run_cli(tiny: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    throughput_main(["--model", str(tiny), *args, "--out", str(out)])
    return json.loads(out.read_text())


def test_cli_shared_prefix_with_a_concurrency_sweep(tiny, tmp_path):
    result = run_cli(tiny, tmp_path, "--workload", "shared-prefix", "--length-scale", "0.02",
                     "--num-requests", "3", "--concurrency", "1", "2",
                     "--attention-backend", "torch")
    assert result["workload"] == "shared-prefix" and result["attention_backend"] == "torch"
    assert result["requests"] == 3 and result["latency"]["ttft_s"]["count"] == 3
    assert result["nanovllm_tok_s"] > 0 and "--out" not in result["command"]
    sweep = result["concurrency_sweep"]
    assert [row["concurrency"] for row in sweep] == [1, 2]
    assert all(row["requests"] == 3 and row["peak_concurrency"] <= row["concurrency"]
               for row in sweep)
    # one at a time, the 2nd and 3rd requests find the 41-token system prompt's 2 full blocks
    assert sweep[0]["cached_prompt_tokens"] == 2 * 2 * 16
    assert 0 < sweep[0]["prefix_cache_hit_rate"] < 1


def test_cli_arrivals(tiny, tmp_path):
    result = run_cli(tiny, tmp_path, "--workload", "arrivals", "--length-scale", "0.02",
                     "--num-requests", "3", "--request-rate", "50")
    assert result["request_rate"] == 50 and result["requests"] == 3
    assert result["latency"]["e2e_s"]["count"] == 3


def test_cli_long_prompts_raise_max_model_len(tiny, tmp_path):
    work = make_workload("long-prompts", 1, length_scale=0.3)
    assert work.max_model_len > 8192  # past the engine's default
    result = run_cli(tiny, tmp_path, "--workload", "long-prompts", "--length-scale", "0.3",
                     "--num-requests", "1")
    assert result["max_model_len"] == work.max_model_len
    assert result["output_tokens"] == work.output_tokens


def test_cli_refuses_what_it_cannot_measure(tiny, capsys):
    with pytest.raises(SystemExit):
        throughput_main(["--model", str(tiny), "--workload", "arrivals", "--peer", "hf"])
    with pytest.raises(SystemExit):
        throughput_main(["--model", str(tiny), "--workload", "cpu", "--length-scale", "2"])
    assert "length_scale" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput_main(["--help"])
    usage = "".join(capsys.readouterr().out.split())  # (argparse wraps lines, even at "-")
    assert all(name in usage for name in WORKLOADS)

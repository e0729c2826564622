"""The measuring tools' shared helpers (``nanovllm/benchmarks/metadata.py`` and ``timing.py``)
and the layout they belong to: the engine's folders hold only the engine. CPU only."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

import nanovllm
from nanovllm.benchmarks import metadata, timing

PACKAGE = Path(nanovllm.__file__).parent


def test_run_metadata_names_device_date_versions_commit_and_command():
    meta = metadata.run_metadata("nanovllm.benchmarks.tool", ["--model", "m", "--n", "3"], "cpu")
    assert set(meta) == {"device", "date", "command", "python", "torch", "triton",
                         "transformers", "git_commit"}
    assert meta["device"].startswith("CPU (") and "threads" in meta["device"]
    assert datetime.fromisoformat(meta["date"]).utcoffset().total_seconds() == 0  # UTC
    assert meta["command"] == "python -m nanovllm.benchmarks.tool --model m --n 3"
    assert meta["torch"] == torch.__version__
    assert meta["python"] == ".".join(map(str, sys.version_info[:3]))
    label = metadata.run_metadata("m", [], "cuda", device_label="2x some GPU")["device"]
    assert label == "2x some GPU"  # given, so CUDA is not asked (there is none here)


def test_command_line_leaves_out_where_results_are_written():
    argv = ["--out", "/root/out/x.json", "--a", "1", "--json=r.json", "--figure", "f.png", "-v"]
    assert metadata.command_line("nanovllm.bench", argv) == "python -m nanovllm.bench --a 1 -v"
    assert metadata.command_line("m", []) == "python -m m"


def test_versions_and_commit_are_none_where_unknown(tmp_path):
    assert metadata.package_version("no-such-distribution-of-nanovllm") is None
    assert metadata.package_version("torch") is not None
    assert metadata.git_commit(tmp_path) is None  # no .git: an installed package


def test_stopwatch_measures_the_block():
    with timing.stopwatch("cpu") as watch:
        time.sleep(0.02)
    assert 0.02 <= watch.seconds < 1.0
    with pytest.raises(ValueError), timing.stopwatch(None):
        raise ValueError("the block's error passes through")


def test_time_calls_warms_up_then_times_each_call():
    calls, flushes = [], []
    times = timing.time_calls(lambda: calls.append(1), reps=5, warmup=2, device="cpu",
                              before=lambda: flushes.append(1))
    assert len(times) == 5 and len(calls) == 7 and len(flushes) == 5
    assert all(t >= 0 for t in times)
    # events=True needs a CUDA device; elsewhere the host clock times each call
    slow = timing.time_calls(lambda: time.sleep(0.01), reps=2, warmup=0, device="cpu",
                             events=True)
    assert all(0.01 <= t < 1.0 for t in slow)


def test_time_loop_is_the_mean_per_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.005)

    per_call = timing.time_loop(fn, iters=4, warmup=1, device="cpu")
    assert len(calls) == 5
    assert 0.005 <= per_call < 0.5


def test_engine_folders_hold_no_measuring_tools():
    tools = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
             if "benchmarks" not in p.parts and p.name != "bench.py"
             and ("bench" in p.stem or p.stem in {"profiling", "tuning", "quant_eval",
                                                    "long_context"})]
    assert tools == []
    alias = (PACKAGE / "bench.py").read_text()
    assert len(alias.splitlines()) < 10 and "nanovllm.benchmarks.throughput" in alias


def test_bench_alias_runs_the_throughput_benchmark():
    from nanovllm.bench import main
    from nanovllm.benchmarks.throughput import main as throughput_main

    assert main is throughput_main
    out = subprocess.run([sys.executable, "-m", "nanovllm.bench", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--decode-step" in out.stdout

"""Tensor parallelism with Ray placing the workers (nanovllm/engine/ray_executor.py, chapter
17 §4), on one local Ray cluster for the whole module (CPU, gloo): the same greedy tokens as
one rank, the placement group's bundles, and a killed worker is an error, not a hang.

These tests carry no assignment id: a Ray cluster's daemons are not what a grader's sandbox gives
a graded run, and the engine path they cover is graded by its own tests (nanovllm/course)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from ray_helpers import start_local_ray
from test_scheduler import make_tiny_llama

from nanovllm import LLM, SamplingParams
from nanovllm.engine.executor import WorkerDiedError

ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, list(range(10, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for every test here (starting one costs seconds)."""
    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-ray")))


def options(**extra):
    return {"num_kv_blocks": 64, "dtype": "float32", **extra}


def test_ray_tp2_matches_one_rank(cluster, tiny):
    with LLM(tiny, **options()) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(tiny, **options(tensor_parallel_size=2, distributed_executor_backend="ray"))
    try:
        executor = llm.engine.runner.executor
        assert type(executor).__name__ == "RayExecutor"
        (worker,) = executor.workers
        assert worker.poll() is None and worker.pid != os.getpid()
        # the placement group holds one bundle per rank (rank 0's kept for this process)
        (group,) = [g for g in ray.util.placement_group_table().values()
                    if g["state"] == "CREATED"]
        assert len(group["bundles"]) == 2
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == expected
    # shutdown gave the bundles back
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_a_killed_ray_worker_is_an_error_not_a_hang(cluster, tiny):
    llm = LLM(tiny, **options(tensor_parallel_size=2, distributed_executor_backend="ray"))
    try:
        (worker,) = llm.engine.runner.executor.workers
        os.kill(worker.pid, signal.SIGKILL)  # (a local cluster: the worker is on this host)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()


def test_unknown_backend_is_refused(tiny):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(tiny, **options(distributed_executor_backend="slurm"))

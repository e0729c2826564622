"""The tensor-parallel measuring tools on CPU (chapter 09): the control-plane benchmark sends
real plans both ways and records what it measured; the all-reduce sweep runs at any size."""

from __future__ import annotations

import json
import time

import pytest
import torch

from nanovllm.benchmarks import control_plane
from nanovllm.benchmarks.tensor_parallel import _allreduce_rank, allreduce_sweep, spawn_ranks
from nanovllm.engine.executor import free_port


def test_control_plane_records_both_transports_for_every_plan(tmp_path, capsys):
    out = tmp_path / "control.json"
    control_plane.main(["--iters", "20", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m nanovllm.benchmarks.control_plane")
    assert record["device"].startswith("CPU") and record["date"]
    rows = record["rows"]
    names = list(control_plane.plans())
    assert [(r["plan"], r["transport"]) for r in rows] == [
        (n, t) for n in names for t in control_plane.TRANSPORTS]
    for row in rows:
        assert 0 < row["sender_p50_us"] and 0 < row["latency_p50_us"] <= row["latency_p90_us"]
    sizes = {r["plan"]: r["bytes"] for r in rows}
    assert sizes["decode, batch 1"] < sizes["decode, batch 64"] < sizes["decode, batch 256"]
    assert sizes["prefill, 16,384 tokens"] > sizes["decode, batch 256"]
    assert capsys.readouterr().out.count("shm") == len(names)


def test_plans_have_the_shapes_of_real_steps():
    plan = control_plane.decode_plan(64, context=1024, block_size=16)
    assert plan.num_tokens == plan.num_seqs == plan.num_decodes == 64
    assert plan.ints.shapes["block_tables"] == (64, 64) and plan.ints.buffer.size == 65 + 64 * 65
    prefill = control_plane.prefill_plan(tokens=4096, seqs=4, block_size=16)
    assert prefill.num_tokens == 4096 and prefill.max_seqlen_q == 1024
    assert prefill.ints.shapes["block_tables"] == (4, 64)


def test_allreduce_sweep_at_chosen_sizes():
    rows = allreduce_sweep(2, sizes=[2 << 10, 8 << 10], iters=5)
    assert [r["bytes"] for r in rows] == [2 << 10, 8 << 10]
    assert all(r["eager_us"] > 0 and r["eager_busbw_gbs"] > 0 for r in rows)


def test_allreduce_sweep_refuses_more_gpus_than_there_are():
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        allreduce_sweep(2, device="cuda") if torch.cuda.device_count() < 2 else pytest.skip()


def test_a_failing_rank_is_an_error_at_once_not_a_wait():
    """Rank 1 dies (here: CUDA asked of a machine without it, or rank 1 of one GPU); rank 0
    waits in the rendezvous for it forever, so the caller must not wait for rank 0."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("every rank finds its GPU here")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code"):
        spawn_ranks(_allreduce_rank, 2, (2, free_port(), [2048], 1, True), results=1,
                    timeout=300)
    assert time.monotonic() - start < 60

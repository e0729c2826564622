"""The scheduler as the one owner of request state (chapter 06): ``schedule()`` returns a
``SchedulerOutput``, and ``update_from_output`` alone advances requests, also under async
scheduling where a step's tokens arrive one step late."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from course_ids import SCHEDULER

import nanovllm
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import ModelRunnerOutput
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.sampling_params import SamplingParams

PACKAGE = Path(nanovllm.__file__).parent
# (a test in which nothing finishes or is preempted never frees a block)
UNFREED = tuple(a for a in SCHEDULER if a != "04.free")


def _scheduler(num_blocks=64, budget=64, max_model_len=None, eos=()) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True, scheduler_policy="fcfs")
    stop = StopChecker(None, set(eos), max_model_len)
    return Scheduler(config, BlockManager(num_blocks, 4, True), stop)


def _seq(n=6, **params) -> Sequence:
    return Sequence(list(range(100, 100 + n)), SamplingParams(**{"max_tokens": 3, **params}))


def test_only_the_scheduler_writes_num_computed_tokens():
    """No module of the engine but the scheduler (and a sequence's constructor) assigns a
    request's progress. The exceptions stage a scene with no engine: a benchmark harness that
    fakes a cached prompt, a diagram and an analysis question that lay out prefilled
    sequences by hand."""
    allowed = {"engine/scheduler.py", "engine/sequence.py", "benchmarks/decode_step.py",
               "viz/kernel_diagrams.py", "course/analysis_questions.py"}
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr == "num_computed_tokens":
                        writers.add(path.relative_to(PACKAGE).as_posix())
    assert writers <= allowed, writers - allowed
    assert "engine/scheduler.py" in writers


@pytest.mark.assignment(*UNFREED)
def test_schedule_only_decides_and_update_advances():
    sched = _scheduler()
    seq = _seq()
    sched.add(seq)
    out = sched.schedule(now=0.0)
    assert out.seqs == [seq] and out.num_new_tokens == [6] and out.samples == [True]
    assert seq.num_computed_tokens == 0 and seq.num_tokens == 6  # nothing advanced yet
    reports = sched.update_from_output(out, ModelRunnerOutput.constant(out, 7))
    assert seq.num_computed_tokens == 6 and seq.output_token_ids == [7]
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in reports] == [
        (seq.request_id, [7], None)]


@pytest.mark.assignment(*UNFREED)
def test_async_placeholder_is_resolved_by_the_next_update():
    """Step 2 is scheduled before step 1's token is known: the sequence holds a placeholder
    that the update carrying step 1's tokens fills in."""
    sched = _scheduler()
    seq = _seq(max_tokens=5)
    sched.add(seq)
    first = sched.schedule(now=0.0)
    assert sched.update_from_output(first, None) == []  # launched; its token is in flight
    assert seq.token_ids[-1] == PLACEHOLDER and seq.num_computed_tokens == 6
    second = sched.schedule(now=1.0)
    assert second.num_new_tokens == [1] and second.is_decode == [True]
    reports = sched.update_from_output(second, ModelRunnerOutput.constant(first, 42))
    assert seq.token_ids[-2:] == [42, PLACEHOLDER] and seq.num_computed_tokens == 7
    assert [r.new_token_ids for r in reports] == [[42]]


@pytest.mark.assignment(*SCHEDULER)
def test_length_limit_retires_at_launch_and_finishes_on_arrival():
    sched = _scheduler()
    seq = _seq(max_tokens=1)
    sched.add(seq)
    out = sched.schedule(now=0.0)
    sched.update_from_output(out, None)  # its only token is in flight: never schedule it again
    assert seq not in sched.running and seq.request_id in sched.requests
    assert sched.schedule(now=1.0).seqs == []
    reports = sched.update_from_output(sched.schedule(now=2.0), ModelRunnerOutput.constant(out, 9))
    assert [(r.new_token_ids, r.finish_reason) for r in reports] == [([9], "length")]
    assert seq.is_finished and not sched.requests and seq.block_table == []


@pytest.mark.assignment(*SCHEDULER)
def test_a_stop_token_found_late_drops_the_token_in_flight():
    sched = _scheduler(eos={0})
    seq = _seq(max_tokens=10)
    sched.add(seq)
    first = sched.schedule(now=0.0)
    sched.update_from_output(first, None)
    second = sched.schedule(now=1.0)
    reports = sched.update_from_output(second, ModelRunnerOutput.constant(first, 0))  # EOS
    assert [(r.new_token_ids, r.finish_reason) for r in reports] == [([0], "stop")]
    assert seq.output_token_ids == [0] and sched.block_manager.num_free_blocks == 64
    # step 2's token arrives for a finished request: dropped, nothing reported
    assert sched.update_from_output(sched.schedule(now=2.0),
                                    ModelRunnerOutput.constant(second, 5)) == []
    assert sched.schedule(now=3.0).finished_seq_ids == set()  # handed out once, earlier


@pytest.mark.assignment(*SCHEDULER)
def test_finished_and_preempted_sequences_are_named_in_the_output():
    sched = _scheduler(num_blocks=4, budget=64)
    a, b = _seq(8, max_tokens=20), _seq(7, max_tokens=20)
    b.token_ids[0] = 1  # a different prompt: nothing shared
    sched.add(a)
    sched.add(b)
    out = sched.schedule(now=0.0)
    assert out.seqs == [a, b] and out.preempted == []
    sched.update_from_output(out, ModelRunnerOutput.constant(out, 7))
    # a's ninth token needs a third block, and the 4 blocks are taken: b, ranked last, goes
    out = sched.schedule(now=1.0)
    assert out.preempted == [b] and out.seqs == [a]
    assert b.num_computed_tokens == 0 and b.block_table == []
    sched.finish_requests([a.request_id])
    assert sched.schedule(now=3.0).finished_seq_ids == {a.seq_id}

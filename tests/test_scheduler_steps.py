"""The scheduler's two smallest decisions on their own (chapter 06): how much of a sequence
fits this step (``Scheduler._chunk``) and what preempting a sequence does
(``Scheduler._preempt``). The engine-level tests (test_scheduler.py) check that together they
never change the generated tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def scheduler(chunked: bool, num_blocks: int = 64) -> Scheduler:
    config = SimpleNamespace(
        max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=chunked,
        scheduler_policy="fcfs",
    )
    return Scheduler(config, BlockManager(num_blocks, 4, False))


@pytest.mark.assignment("06.chunk")
@pytest.mark.parametrize("chunked", [True, False])
def test_chunk_takes_all_that_fits_or_a_chunk_or_nothing(chunked):
    sched = scheduler(chunked)
    for remaining in range(1, 40):
        for budget in range(0, 40):
            n = sched._chunk(remaining, budget)
            if remaining <= budget:
                expected = remaining
            else:
                expected = budget if chunked else 0
            assert n == expected, (remaining, budget, chunked, n)
    assert (sched.waiting, sched.running, sched.num_preemptions) == ([], [], 0)


def _running(prompt_len: int, outputs: int) -> Sequence:
    seq = Sequence(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=50))
    seq.token_ids.extend([7] * outputs)
    seq.status = SequenceStatus.RUNNING
    return seq


@pytest.mark.assignment("06.preempt", "04.free")
def test_preempt_without_blocks_requeues_and_counts():
    sched = scheduler(True)
    seq = _running(6, 2)
    tokens = list(seq.token_ids)
    sched._preempt(seq)
    assert seq.status == SequenceStatus.WAITING and sched.waiting == [seq]
    assert seq.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    assert seq.token_ids == tokens, "preemption keeps the generated tokens"
    assert seq.num_computed_tokens == 0


@pytest.mark.assignment("06.preempt", "04.allocate", "04.free")
def test_preempt_releases_every_block_and_recomputes_everything():
    sched = scheduler(True, num_blocks=16)
    bm = sched.block_manager
    seqs = [_running(9, 0), _running(5, 0)]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(7)  # its first output token
    free_before = bm.num_free_blocks
    victim = seqs[0]
    held = len(victim.block_table)
    sched._preempt(victim)
    assert bm.num_free_blocks == free_before + held and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_tokens == 10
    assert sched.waiting == [victim] and sched.num_preemptions == 1
    sched._preempt(seqs[1])
    assert bm.num_free_blocks == 16 and sched.num_preemptions == 2
    assert [s.metrics.num_preemptions for s in seqs] == [1, 1]

"""Own tests of the scheduler's two central decisions (chapter 06), each graded alone:
admission of waiting sequences (``Scheduler._admit``, assignment 06.admit: §1 and §4,
chunked prefill and head-of-line blocking) and the running sequences' loop with recompute
preemption (``Scheduler._schedule_running``, assignment 06.preempt: §1 and §5).

Both call the block manager (chapter 04's ``cached_prefix``, ``allocate`` and ``free``, which
are assignments of their own). So that a test here reaches no region but the one it grades,
the scheduler runs over ``FakeBlocks``, a stand-in written below that keeps the interface
the scheduler calls (block counting by ceiling division, all-or-nothing ``allocate``, a
``cached_prefix`` that returns what the test put there) and records each call. The expected
batches come from hand-worked cases or from small reference loops written in this file.
Each test calls the method under test directly, as ``Scheduler.schedule`` does (``schedule``
itself runs both regions); the policies used (FCFS, priority, and test-local ones) hold no
assignment region. test_scheduler_steps.py runs the same decisions over the real block
manager.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from test_scheduler_steps import _reference_running, scheduled  # shared with the engine-path tests

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import SchedulerOutput
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 4  # tokens per KV block
CACHED_IDS = itertools.count(10_000)  # ids of stand-in cached blocks (never in the pool)
_fresh = itertools.count(1000, 100)  # distinct prompts


class FakeBlocks:
    """A stand-in for ``BlockManager``: only block counts. A sequence holding ``t`` blocks
    whose table must cover ``c`` tokens takes ``ceil(c / 4) - t`` more from a pool of
    ``num_blocks``, all or nothing; cached blocks (``cached_prefix``'s answers, set per
    sequence in ``self.cached``) come from outside the pool and cost nothing. ``calls``
    logs every call the scheduler makes."""

    null_block = None

    def __init__(self, num_blocks: int = 64) -> None:
        self.block_size = BS
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.cached: dict[int, list[int]] = {}  # seq_id -> what cached_prefix returns
        self.owned: dict[int, list[int]] = {}  # seq_id -> pool blocks it holds
        self.calls: list[tuple] = []
        self._ids = itertools.count()

    def cached_prefix(self, seq: Sequence) -> list[int]:
        self.calls.append(("cached_prefix", seq))
        return list(self.cached.get(seq.seq_id, []))

    def num_blocks_to_allocate(self, seq: Sequence, n: int, cached=()) -> int:
        covered = seq.num_computed_tokens + len(cached) * BS + n
        return max(-(-covered // BS) - len(seq.block_table) - len(cached), 0)

    def allocate(self, seq: Sequence, n: int, cached=()) -> bool:
        self.calls.append(("allocate", seq, n, list(cached)))
        need = self.num_blocks_to_allocate(seq, n, cached)
        if need > self.num_free_blocks:
            return False
        fresh = [next(self._ids) for _ in range(need)]
        self.num_free_blocks -= need
        self.owned.setdefault(seq.seq_id, []).extend(fresh)
        seq.block_table += list(cached) + fresh
        return True

    def free(self, seq: Sequence) -> None:
        self.calls.append(("free", seq, seq.num_computed_tokens))
        self.num_free_blocks += len(self.owned.pop(seq.seq_id, []))
        seq.block_table, seq.block_hashes = [], []

    def num_freeable_blocks(self, seqs: list[Sequence]) -> int:
        return sum(len(self.owned.get(s.seq_id, [])) for s in seqs)

    def release_outside_window(self, seq: Sequence) -> int:
        return 0

    def take_orphans(self) -> set[int]:
        return set()

    def made(self, kind: str) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == kind]


def scheduler(budget=64, num_blocks=64, max_num_seqs=8, chunked=True, policy="fcfs"):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked, scheduler_policy=policy)
    return Scheduler(config, FakeBlocks(num_blocks))


def waiting(sched: Scheduler, prompt_len: int, priority=0, arrival=0.0) -> Sequence:
    start = next(_fresh)
    seq = Sequence(list(range(start, start + prompt_len)), SamplingParams(max_tokens=50),
                   priority=priority)
    seq.metrics.arrival_time = arrival
    sched.add(seq)
    return seq


def running(sched: Scheduler, prompt_len: int, computed: int, outputs=0, priority=0):
    """A running sequence holding blocks for its ``computed`` tokens (given by the stand-in
    directly), after ``outputs`` generated tokens (the newest not computed yet)."""
    seq = waiting(sched, prompt_len, priority=priority)
    seq.token_ids += [7] * outputs
    seq.num_delivered_tokens = outputs
    seq.metrics.first_scheduled_time = 0.0
    bm = sched.block_manager
    blocks = [next(bm._ids) for _ in range(-(-computed // BS))]
    assert len(blocks) <= bm.num_free_blocks
    bm.num_free_blocks -= len(blocks)
    bm.owned[seq.seq_id] = list(blocks)
    seq.block_table = list(blocks)
    seq.num_computed_tokens = computed
    seq.status = SequenceStatus.RUNNING
    sched.waiting.remove(seq)
    sched.running.append(seq)
    return seq


def admit(sched: Scheduler, batch: SchedulerOutput | None = None, now=5.0) -> SchedulerOutput:
    """``_admit`` as ``schedule`` calls it, after the running sequences took ``batch``."""
    batch = batch if batch is not None else SchedulerOutput()
    ordered = sched.policy.order(sched.running + sched.waiting, now)
    rank = {s.seq_id: i for i, s in enumerate(ordered)}
    sched._admit([s for s in ordered if s.status is SequenceStatus.WAITING], batch, rank, now)
    return batch


def decode_in(batch: SchedulerOutput, seq: Sequence, n: int = 1) -> None:
    """Put ``n`` tokens of running ``seq`` in ``batch``, as the running loop would (its
    blocks are the stand-in's: no allocation needed for the test's accounting)."""
    batch.add(seq, n)


# -- 06.admit ------------------------------------------------------------------------------


@pytest.mark.assignment("06.admit")
def test_admit_own_fills_the_budget_in_rank_order_and_sets_the_state():
    sched = scheduler(budget=16)
    a, b, c = waiting(sched, 6), waiting(sched, 10), waiting(sched, 3)
    batch = admit(sched, now=5.0)
    assert scheduled(batch) == [(a.seq_id, 6), (b.seq_id, 10)]  # 16 of 16: c gets nothing
    assert batch.num_tokens == 16 and batch.samples == [True, True]
    assert sched.running == [a, b] and sched.waiting == [c]
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]
    assert [s.num_computed_tokens for s in (a, b, c)] == [0, 0, 0]  # nothing cached
    assert a.metrics.first_scheduled_time == b.metrics.first_scheduled_time == 5.0
    assert a.metrics.num_cached_prompt_tokens == 0 and c.metrics.first_scheduled_time is None
    bm = sched.block_manager
    assert bm.made("allocate") == [(a, 6, []), (b, 10, [])]  # each with its own n
    assert [len(s.block_table) for s in (a, b, c)] == [2, 3, 0] and bm.made("free") == []


@pytest.mark.assignment("06.admit")
@pytest.mark.parametrize("chunked", [True, False])
def test_admit_own_chunks_a_long_prompt_or_blocks_the_line(chunked):
    sched = scheduler(budget=16, chunked=chunked)
    r = running(sched, 8, computed=8, outputs=1)
    batch = SchedulerOutput()
    decode_in(batch, r)  # a decode took 1 of the 16 tokens
    long, short = waiting(sched, 20), waiting(sched, 2)
    batch = admit(sched, batch)
    if chunked:  # the first chunk takes all that is left (15); short then has no budget
        assert scheduled(batch) == [(r.seq_id, 1), (long.seq_id, 15)]
        assert batch.samples == [True, False] and sched.running == [r, long]
        assert sched.waiting == [short] and long.num_computed_tokens == 0
        assert sched.block_manager.made("allocate") == [(long, 15, [])]
    else:  # it waits whole, and the short one behind it, which would fit, waits too
        assert scheduled(batch) == [(r.seq_id, 1)]
        assert sched.running == [r] and sched.waiting == [long, short]
        assert long.status is SequenceStatus.WAITING and long.metrics.first_scheduled_time is None
        assert sched.block_manager.made("allocate") == []


@pytest.mark.assignment("06.admit")
def test_admit_own_a_cached_prefix_counts_as_computed_and_costs_no_budget():
    sched = scheduler(budget=5)
    bm = sched.block_manager
    seq = waiting(sched, 21)  # 16 of its 21 tokens cached: 5 to compute
    again = waiting(sched, 18)  # 16 cached too, but no budget is left for its 2
    again.metrics.first_scheduled_time = 1.0  # admitted once before (then preempted)
    prefix = [next(CACHED_IDS) for _ in range(4)]
    bm.cached[seq.seq_id] = bm.cached[again.seq_id] = prefix
    batch = admit(sched, now=5.0)
    assert scheduled(batch) == [(seq.seq_id, 5)]  # 5 of 5: the budget is exactly used
    assert batch.samples == [True]  # (num_computed_tokens was set before batch.add)
    assert seq.num_computed_tokens == 16 and seq.metrics.num_cached_prompt_tokens == 16
    assert seq.metrics.first_scheduled_time == 5.0
    assert bm.made("allocate") == [(seq, 5, prefix)]  # the cached blocks go to allocate
    assert sched.waiting == [again] and again.num_computed_tokens == 0
    sched.max_num_batched_tokens = 2
    batch = admit(sched, now=6.0)
    assert scheduled(batch) == [(again.seq_id, 2)]
    assert again.num_computed_tokens == 16 and again.metrics.first_scheduled_time == 1.0
    assert again.metrics.num_cached_prompt_tokens == 0  # set on the first admission only
    assert sched.waiting == []


@pytest.mark.assignment("06.admit")
def test_admit_own_stops_at_the_first_that_does_not_fit():
    # out of KV blocks: a takes 3 of 5; b needs 3; c needs 1 but may not overtake b
    sched = scheduler(num_blocks=5)
    a, b, c = waiting(sched, 12), waiting(sched, 9), waiting(sched, 2)
    batch = admit(sched)
    assert scheduled(batch) == [(a.seq_id, 12)]
    assert sched.waiting == [b, c] and b.status is SequenceStatus.WAITING
    assert b.block_table == [] and b.metrics.first_scheduled_time is None
    assert [call[0] for call in sched.block_manager.made("allocate")] == [a, b]  # not c
    # out of slots (max_num_seqs): one running, two admitted, the rest wait
    sched = scheduler(max_num_seqs=3)
    r = running(sched, 5, computed=5, outputs=1)
    batch = SchedulerOutput()
    decode_in(batch, r)
    queued = [waiting(sched, 3) for _ in range(4)]
    batch = admit(sched, batch)
    assert scheduled(batch) == [(r.seq_id, 1)] + [(s.seq_id, 3) for s in queued[:2]]
    assert sched.running == [r, *queued[:2]] and sched.waiting == queued[2:]
    assert all(s.block_table == [] for s in queued[2:])
    # nothing waiting: nothing changes
    batch = SchedulerOutput()
    sched._admit([], batch, {}, 9.0)
    assert scheduled(batch) == [] and sched.waiting == queued[2:]


class _NewestFirst:
    """A test-local policy: latest arrival first, and it records ``on_admit``."""

    def __init__(self) -> None:
        self.admitted: list[tuple[Sequence, float]] = []

    def order(self, seqs, now):
        return sorted(seqs, key=lambda s: (-s.metrics.arrival_time, s.seq_id))

    def on_admit(self, seq, now):
        self.admitted.append((seq, now))


@pytest.mark.assignment("06.admit")
def test_admit_own_follows_the_policy_and_keeps_the_waiting_order():
    policy = _NewestFirst()
    sched = scheduler(budget=7, policy=policy)
    seqs = [waiting(sched, n, arrival=float(t)) for t, n in enumerate([4, 4, 4, 3, 3])]
    batch = admit(sched, now=7.0)
    # ranked newest first: seqs[4] (3), seqs[3] (3), then seqs[2] (4) finds 1 token left
    # and chunks it; seqs[1] and seqs[0] find none
    assert scheduled(batch) == [(seqs[4].seq_id, 3), (seqs[3].seq_id, 3), (seqs[2].seq_id, 1)]
    assert policy.admitted == [(seqs[4], 7.0), (seqs[3], 7.0), (seqs[2], 7.0)]
    assert sched.running == [seqs[4], seqs[3], seqs[2]]
    assert sched.waiting == [seqs[0], seqs[1]]  # their earlier order, not the ranking's


@pytest.mark.assignment("06.admit")
def test_admit_own_an_eviction_returns_its_tokens_and_the_victim_keeps_waiting():
    """Priority policy (``preempts_to_admit``): ``_fit`` evicts a lower-ranked running
    sequence for a slot; its tokens leave the batch (budget for the next admission) and it
    ends in ``self.waiting`` after the ones that were waiting before."""
    sched = scheduler(budget=16, max_num_seqs=2, policy="priority")
    r1 = running(sched, 4, computed=4, outputs=1, priority=4)
    r2 = running(sched, 10, computed=4, priority=5)  # a prompt computed in chunks
    batch = SchedulerOutput()
    decode_in(batch, r1)
    decode_in(batch, r2, 6)
    urgent, second = waiting(sched, 8, priority=0), waiting(sched, 7, priority=3)
    late = waiting(sched, 5, priority=6)  # ranked below both running ones: waits
    batch = admit(sched, batch)
    # urgent (9 left) evicts r2; second (then 7 left, exactly) evicts r1
    assert scheduled(batch) == [(urgent.seq_id, 8), (second.seq_id, 7)]
    assert batch.preempted == [r2, r1] and sched.running == [urgent, second]
    assert sched.waiting == [late, r2, r1] and sched.num_preemptions == 2
    assert r2.status is SequenceStatus.WAITING and r1.num_computed_tokens == 0


def _reference_admission(prompts, cached, budget, chunked, max_num_seqs, free_blocks):
    """FCFS admission from an empty engine, without the package: (index, tokens, computed)
    admitted, the cached blocks costing neither budget nor pool blocks."""
    admitted = []
    for i, (length, hit) in enumerate(zip(prompts, cached)):
        rest = length - hit * BS
        n = rest if rest <= budget else (budget if chunked else 0)
        blocks = -(-(hit * BS + n) // BS) - hit
        if n == 0 or len(admitted) == max_num_seqs or blocks > free_blocks:
            break
        admitted.append((i, n, hit * BS))
        budget, free_blocks = budget - n, free_blocks - blocks
    return admitted


@pytest.mark.assignment("06.admit")
@pytest.mark.parametrize("seed", range(4))
def test_admit_own_matches_a_reference_on_random_queues(seed):
    rng = random.Random(seed)
    for _ in range(60):
        prompts = [rng.randint(1, 24) for _ in range(rng.randint(1, 8))]
        cached = [rng.randint(0, (n - 1) // BS) if rng.random() < 0.4 else 0 for n in prompts]
        budget, chunked = rng.randint(1, 48), rng.random() < 0.5
        max_num_seqs, num_blocks = rng.randint(1, 6), rng.randint(2, 20)
        sched = scheduler(budget, num_blocks, max_num_seqs, chunked)
        seqs = [waiting(sched, n) for n in prompts]
        for seq, hit in zip(seqs, cached):
            sched.block_manager.cached[seq.seq_id] = [next(CACHED_IDS) for _ in range(hit)]
        batch = admit(sched)
        expected = _reference_admission(prompts, cached, budget, chunked, max_num_seqs,
                                        num_blocks)
        case = (prompts, cached, budget, chunked, max_num_seqs, num_blocks)
        assert scheduled(batch) == [(seqs[i].seq_id, n) for i, n, _ in expected], case
        assert [s.num_computed_tokens for s in batch.seqs] == [c for _, _, c in expected]
        assert sched.running == [seqs[i] for i, _, _ in expected]
        assert sched.waiting == seqs[len(expected):]
        assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)


# -- 06.preempt ----------------------------------------------------------------------------


def run_running(sched: Scheduler, ranked: list[Sequence]) -> tuple[SchedulerOutput, bool]:
    batch = SchedulerOutput()
    return batch, sched._schedule_running(ranked, batch)


@pytest.mark.assignment("06.preempt")
def test_preempt_own_running_sequences_share_the_budget_in_rank_order():
    sched = scheduler(budget=16)
    a = running(sched, 5, computed=5, outputs=1)  # decodes: 1 token
    b = running(sched, 14, computed=4)  # a prompt in chunks: 10 left
    c = running(sched, 3, computed=4, outputs=2)
    d = running(sched, 12, computed=4)  # 8 left, 4 of budget
    e = running(sched, 6, computed=6, outputs=1)  # nothing left for it
    held = list(e.block_table)
    sched.running = [e, d, c, b, a]  # (rebuilt in rank order)
    batch, preempted = run_running(sched, [a, b, c, d, e])
    assert not preempted and batch.preempted == []
    assert scheduled(batch) == [(a.seq_id, 1), (b.seq_id, 10), (c.seq_id, 1), (d.seq_id, 4)]
    assert batch.num_tokens == 16 and batch.is_decode == [True, False, True, False]
    assert sched.running == [a, b, c, d, e]  # e waits for budget, its blocks kept
    assert e.block_table == held and e.status is SequenceStatus.RUNNING
    assert [s.num_computed_tokens for s in (a, b, c, d, e)] == [5, 4, 4, 4, 6]
    bm = sched.block_manager
    assert bm.made("allocate") == [(a, 1, []), (b, 10, []), (c, 1, []), (d, 4, [])]
    assert bm.made("free") == [] and sched.num_preemptions == 0


@pytest.mark.assignment("06.preempt")
def test_preempt_own_out_of_blocks_the_lowest_ranked_is_preempted():
    sched = scheduler(num_blocks=7)
    a = running(sched, 8, computed=8, outputs=1)  # its 9th token needs a third block
    b = running(sched, 5, computed=5, outputs=1)  # room in its second block
    c = running(sched, 9, computed=9, outputs=1)  # 3 blocks
    assert sched.block_manager.num_free_blocks == 0
    batch, preempted = run_running(sched, [a, b, c])
    assert preempted and batch.preempted == [c]
    assert scheduled(batch) == [(a.seq_id, 1), (b.seq_id, 1)] and sched.running == [a, b]
    assert c.status is SequenceStatus.WAITING and sched.waiting == [c]
    assert c.num_computed_tokens == 0 and c.block_table == [] and c.num_tokens == 10
    assert c.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    bm = sched.block_manager
    assert bm.made("free") == [(c, 9)]  # freed once, before its progress was reset
    # a's allocation failed, c was preempted, then a tried again and got a block
    assert [call[:2] for call in bm.made("allocate")] == [(a, 1), (a, 1), (b, 1)]
    assert bm.num_free_blocks == 2


@pytest.mark.assignment("06.preempt")
def test_preempt_own_victims_come_from_the_back_until_it_fits():
    sched = scheduler(num_blocks=7)
    a = running(sched, 12, computed=4)  # a chunk of 8 needs 2 more blocks
    b = running(sched, 5, computed=5, outputs=1)  # 2 blocks, room for its token
    c = running(sched, 4, computed=3)  # 1 block each
    d = running(sched, 4, computed=3)
    e = running(sched, 3, computed=3)
    assert sched.block_manager.num_free_blocks == 1
    batch, preempted = run_running(sched, [a, b, c, d, e])
    assert batch.preempted == [e] and preempted  # one block freed is enough
    assert scheduled(batch) == [(a.seq_id, 8), (b.seq_id, 1), (c.seq_id, 1), (d.seq_id, 1)]
    assert sched.running == [a, b, c, d]
    sched = scheduler(num_blocks=5)
    a = running(sched, 16, computed=4)  # 12 left: 3 more blocks
    b, c, d = (running(sched, 4, computed=3) for _ in range(3))
    assert sched.block_manager.num_free_blocks == 1
    batch, preempted = run_running(sched, [a, b, c, d])
    assert batch.preempted == [d, c] and sched.waiting == [d, c]  # b, above them, is spared
    assert scheduled(batch) == [(a.seq_id, 12), (b.seq_id, 1)] and sched.running == [a, b]
    assert sched.num_preemptions == 2


@pytest.mark.assignment("06.preempt")
def test_preempt_own_with_nothing_ranked_below_a_sequence_preempts_itself():
    sched = scheduler(num_blocks=4)
    a = running(sched, 7, computed=7, outputs=1)  # 2 blocks, room for its token
    b = running(sched, 8, computed=8, outputs=1)  # 2 blocks, its token needs a third
    batch, preempted = run_running(sched, [a, b])
    assert preempted and batch.preempted == [b] and scheduled(batch) == [(a.seq_id, 1)]
    assert sched.running == [a] and sched.waiting == [b] and b.block_table == []
    assert a not in batch.preempted and b.status is SequenceStatus.WAITING
    sched = scheduler(num_blocks=2)
    only = running(sched, 8, computed=8, outputs=1)
    batch, preempted = run_running(sched, [only])
    assert preempted and batch.preempted == [only] and sched.running == []
    batch, preempted = run_running(scheduler(num_blocks=2), [])
    assert not preempted and scheduled(batch) == [] and batch.preempted == []


@pytest.mark.assignment("06.preempt")
@pytest.mark.parametrize("seed", range(4))
def test_preempt_own_matches_a_reference_on_random_engines(seed):
    rng = random.Random(seed)
    for _ in range(60):
        sched = scheduler(num_blocks=rng.randint(4, 24), budget=rng.randint(1, 40))
        seqs = []
        for _ in range(rng.randint(1, 6)):
            prompt = rng.randint(1, 20)
            decoding = rng.random() < 0.6
            computed = prompt if decoding else rng.randint(0, prompt - 1)
            if sched.block_manager.num_free_blocks < -(-computed // BS):
                break
            seqs.append(running(sched, prompt, computed, outputs=int(decoding)))
        out, victims = _reference_running(
            [s.num_tokens - s.num_computed_tokens for s in seqs],
            [s.num_computed_tokens for s in seqs],
            [len(s.block_table) for s in seqs],
            sched.block_manager.num_free_blocks, sched.max_num_batched_tokens)
        batch, preempted = run_running(sched, seqs)
        assert scheduled(batch) == [(seqs[i].seq_id, n) for i, n in out]
        assert batch.preempted == [seqs[i] for i in victims] and preempted == bool(victims)
        assert sched.running == [s for i, s in enumerate(seqs) if i not in victims]
        assert sched.waiting == [seqs[i] for i in victims]
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert all(seqs[i].status is SequenceStatus.WAITING for i in victims)


def test_the_stand_in_counts_blocks_like_the_handout_says():
    """(Not graded.) FakeBlocks' all-or-nothing ceiling arithmetic, checked by hand."""
    bm = FakeBlocks(3)
    seq = Sequence(list(range(9)), SamplingParams(max_tokens=1))
    assert not bm.allocate(seq, 13) and seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate(seq, 5) and len(seq.block_table) == 2 and bm.num_free_blocks == 1
    seq.num_computed_tokens = 5
    assert bm.allocate(seq, 3) and len(seq.block_table) == 2  # 8 tokens: 2 blocks
    bm.free(seq)
    assert bm.num_free_blocks == 3 and seq.block_table == []

"""The scheduler's three central decisions, each on its own (chapters 06 and 11):
admission under the token and sequence budgets (``Scheduler._admit``), the running
sequences' loop with recompute preemption (``Scheduler._schedule_running``), and the
placeholder protocol of async scheduling (``Scheduler._advance``). A stand-alone scheduler
over a real block manager (4-token blocks); no model. The engine-level tests
(test_scheduler.py, test_async_scheduling.py) check that together they never change the
generated tokens."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.sampling_params import SamplingParams

BS = 4  # tokens per KV block
ADMIT = ("06.admit", "04.cached_prefix", "04.allocate")
RUNNING = ("06.preempt", "04.allocate")
_fresh = itertools.count(1000, 100)  # distinct prompts: no prefix shared by accident


def scheduler(chunked=True, num_blocks=64, budget=64, max_num_seqs=8, policy="fcfs",
              prefix_caching=False, max_model_len=None, eos=()) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked, scheduler_policy=policy)
    stop = StopChecker(None, set(eos), max_model_len)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching), stop)


def waiting(sched: Scheduler, prompt_len: int, max_tokens=50, priority=0, tokens=None):
    start = next(_fresh)
    tokens = tokens or list(range(start, start + prompt_len))
    seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens), priority=priority)
    seq.metrics.arrival_time = 0.0
    sched.add(seq)
    return seq


def running(sched: Scheduler, prompt_len: int, computed: int, outputs=0, priority=0):
    """A running sequence holding blocks for its ``computed`` tokens, after ``outputs``
    generated tokens (the newest not computed yet)."""
    seq = waiting(sched, prompt_len, priority=priority)
    seq.token_ids += [7] * outputs
    seq.num_delivered_tokens = outputs
    assert sched.block_manager.allocate(seq, computed)
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
    ranked = [s for s in ordered if s.status is SequenceStatus.WAITING]
    sched._admit(ranked, batch, rank, now)
    return batch


def in_batch(sched: Scheduler, batch: SchedulerOutput, seq: Sequence, n: int) -> None:
    """Schedule ``n`` tokens of running ``seq`` as the running loop would."""
    assert sched.block_manager.allocate(seq, n)
    batch.add(seq, n)


def scheduled(batch: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


# -- 06.admit: admission under the token and sequence budgets ------------------------------


@pytest.mark.assignment(*ADMIT)
@pytest.mark.parametrize("chunked", [True, False])
def test_admit_fills_the_budget_in_order_and_uses_it_exactly(chunked):
    sched = scheduler(chunked, budget=16)
    a, b, c = waiting(sched, 6), waiting(sched, 10), waiting(sched, 3)
    batch = admit(sched, now=5.0)
    assert scheduled(batch) == [(a.seq_id, 6), (b.seq_id, 10)]  # 16 of 16: c gets nothing
    assert batch.num_tokens == 16 and batch.samples == [True, True]
    assert sched.running == [a, b] and sched.waiting == [c]
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]
    assert [s.num_computed_tokens for s in (a, b, c)] == [0, 0, 0]  # schedule only decides
    assert a.metrics.first_scheduled_time == b.metrics.first_scheduled_time == 5.0
    assert c.metrics.first_scheduled_time is None
    assert [len(a.block_table), len(b.block_table), len(c.block_table)] == [2, 3, 0]


@pytest.mark.assignment(*ADMIT)
@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_larger_than_the_budget_left_is_chunked_or_blocks_the_line(chunked):
    sched = scheduler(chunked, budget=16)
    r = running(sched, 8, computed=8, outputs=1)
    batch = SchedulerOutput()
    in_batch(sched, batch, r, 1)  # a decode took 1 of the 16 tokens
    long, short = waiting(sched, 20), waiting(sched, 2)
    batch = admit(sched, batch)
    if chunked:  # the first chunk takes all that is left; the rest comes in later steps
        assert scheduled(batch) == [(r.seq_id, 1), (long.seq_id, 15)]
        assert batch.samples == [True, False] and sched.running == [r, long]
        assert sched.waiting == [short] and len(long.block_table) == 4
    else:  # it waits whole, and the short one behind it, which would fit, waits too
        assert scheduled(batch) == [(r.seq_id, 1)]
        assert sched.running == [r] and sched.waiting == [long, short]
        assert long.block_table == [] and long.status is SequenceStatus.WAITING


@pytest.mark.assignment(*ADMIT)
def test_admission_stops_at_max_num_seqs():
    sched = scheduler(max_num_seqs=3)
    r = running(sched, 5, computed=5, outputs=1)
    batch = SchedulerOutput()
    in_batch(sched, batch, r, 1)
    queued = [waiting(sched, 3) for _ in range(4)]
    batch = admit(sched, batch)
    assert scheduled(batch) == [(r.seq_id, 1)] + [(s.seq_id, 3) for s in queued[:2]]
    assert sched.running == [r, *queued[:2]] and sched.waiting == queued[2:]
    assert all(s.block_table == [] for s in queued[2:])


@pytest.mark.assignment(*ADMIT)
def test_a_request_without_kv_blocks_blocks_the_line():
    sched = scheduler(num_blocks=5)  # 20 tokens of KV cache
    a, b, c = waiting(sched, 12), waiting(sched, 9), waiting(sched, 2)
    batch = admit(sched)
    # a takes 3 blocks; b needs 3 of the 2 left; c needs 1, but may not overtake b
    assert scheduled(batch) == [(a.seq_id, 12)]
    assert sched.waiting == [b, c] and sched.block_manager.num_free_blocks == 2


@pytest.mark.assignment(*ADMIT, "04.free")
@pytest.mark.parametrize("chunked", [True, False])
def test_a_cached_prefix_counts_as_computed_and_costs_no_budget(chunked):
    sched = scheduler(chunked, budget=5, prefix_caching=True)
    bm = sched.block_manager
    shared = list(range(500, 516))  # four full blocks
    done = Sequence(shared + [1, 2], SamplingParams(max_tokens=1))
    assert bm.allocate(done, 18)
    done.num_computed_tokens = 18
    bm.free(done)  # finished: its blocks stay findable in the prefix cache
    seq = waiting(sched, 0, tokens=shared + [3, 4, 5, 6, 8])  # 21 tokens, 16 of them cached
    again = waiting(sched, 0, tokens=shared + [9, 9])  # also cached, but no budget is left
    again.metrics.first_scheduled_time = 1.0  # admitted once before (then preempted)
    batch = admit(sched, now=5.0)
    assert scheduled(batch) == [(seq.seq_id, 5)]  # 5 of 5: the budget is exactly used
    assert seq.num_computed_tokens == 16 and seq.metrics.num_cached_prompt_tokens == 16
    assert len(seq.block_table) == 6 and seq.block_table[:4] == bm.cached_prefix(again)
    assert sched.waiting == [again] and again.num_computed_tokens == 0
    sched.max_num_batched_tokens = 2
    batch = admit(sched, now=6.0)
    assert scheduled(batch) == [(again.seq_id, 2)]
    assert again.num_computed_tokens == 16 and again.metrics.first_scheduled_time == 1.0
    assert again.metrics.num_cached_prompt_tokens == 0  # set on the first admission only


@pytest.mark.assignment(*ADMIT, "04.free")
def test_an_urgent_request_evicts_the_least_important_and_gets_its_budget():
    """Priority policy (``preempts_to_admit``): ``_fit`` evicts for a slot, and the evicted
    sequence's tokens go back to the step's budget."""
    sched = scheduler(budget=16, max_num_seqs=2, policy="priority")
    r1 = running(sched, 4, computed=4, outputs=1, priority=4)
    r2 = running(sched, 10, computed=4, priority=5)  # a prompt computed in chunks
    batch = SchedulerOutput()
    in_batch(sched, batch, r1, 1)
    in_batch(sched, batch, r2, 6)
    urgent, second = waiting(sched, 8, priority=0), waiting(sched, 7, priority=3)
    batch = admit(sched, batch)
    # urgent (9 left) evicts r2; second (7 left, exactly) evicts r1 in turn
    assert scheduled(batch) == [(urgent.seq_id, 8), (second.seq_id, 7)]
    assert batch.preempted == [r2, r1] and sched.running == [urgent, second]
    assert sched.waiting == [r2, r1] and r2.block_table == [] and r1.num_computed_tokens == 0
    assert sched.num_preemptions == 2


def _reference_admission(prompts, budget, chunked, max_num_seqs, free_blocks):
    """FCFS admission from an empty engine, without the package: (index, tokens) admitted."""
    admitted = []
    for i, length in enumerate(prompts):
        n = length if length <= budget else (budget if chunked else 0)
        blocks = -(-n // BS)
        if n == 0 or len(admitted) == max_num_seqs or blocks > free_blocks:
            break
        admitted.append((i, n))
        budget, free_blocks = budget - n, free_blocks - blocks
    return admitted


@pytest.mark.assignment(*ADMIT)
@pytest.mark.parametrize("seed", range(4))
def test_admission_matches_a_reference_on_random_queues(seed):
    rng = random.Random(seed)
    for _ in range(50):
        prompts = [rng.randint(1, 24) for _ in range(rng.randint(1, 8))]
        budget, chunked = rng.randint(1, 48), rng.random() < 0.5
        max_num_seqs, num_blocks = rng.randint(1, 6), rng.randint(2, 20)
        sched = scheduler(chunked, num_blocks, budget, max_num_seqs)
        seqs = [waiting(sched, n) for n in prompts]
        batch = admit(sched)
        expected = _reference_admission(prompts, budget, chunked, max_num_seqs, num_blocks)
        assert scheduled(batch) == [(seqs[i].seq_id, n) for i, n in expected], (prompts, budget)
        assert sched.running == [seqs[i] for i, _ in expected]
        assert sched.waiting == seqs[len(expected):]


# -- 06.preempt: the running sequences' loop, recompute preemption ---------------------------


def run_running(sched: Scheduler, ranked: list[Sequence]) -> tuple[SchedulerOutput, bool]:
    batch = SchedulerOutput()
    return batch, sched._schedule_running(ranked, batch)


@pytest.mark.assignment(*RUNNING)
def test_running_sequences_share_the_budget_in_rank_order():
    sched = scheduler(budget=16)
    a = running(sched, 5, computed=5, outputs=1)  # decodes: 1 token
    b = running(sched, 14, computed=4)  # a prompt in chunks: 10 left
    c = running(sched, 3, computed=4, outputs=2)
    d = running(sched, 12, computed=4)  # 8 left, 4 of budget
    e = running(sched, 6, computed=6, outputs=1)  # nothing left for it
    held = list(e.block_table)
    batch, preempted = run_running(sched, [a, b, c, d, e])
    assert not preempted and batch.preempted == []
    assert scheduled(batch) == [(a.seq_id, 1), (b.seq_id, 10), (c.seq_id, 1), (d.seq_id, 4)]
    assert batch.num_tokens == 16 and batch.is_decode == [True, False, True, False]
    assert sched.running == [a, b, c, d, e]  # e waits for budget, its blocks kept
    assert e.block_table == held and e.status is SequenceStatus.RUNNING
    assert [s.num_computed_tokens for s in (a, b, c, d, e)] == [5, 4, 4, 4, 6]


@pytest.mark.assignment(*RUNNING, "04.free")
def test_out_of_blocks_the_lowest_ranked_is_preempted_and_recomputed_later():
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
    assert len(a.block_table) == 3 and sched.block_manager.num_free_blocks == 2


@pytest.mark.assignment(*RUNNING, "04.free")
def test_victims_come_from_the_back_until_it_fits_and_never_rank_above():
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
    sched = scheduler(num_blocks=5)
    a = running(sched, 16, computed=4)  # 12 left: 3 more blocks
    b, c, d = (running(sched, 4, computed=3) for _ in range(3))
    free = sched.block_manager.num_free_blocks
    batch, preempted = run_running(sched, [a, b, c, d])
    assert free == 1 and batch.preempted == [d, c] and sched.waiting == [d, c]
    assert scheduled(batch) == [(a.seq_id, 12), (b.seq_id, 1)] and sched.running == [a, b]


@pytest.mark.assignment(*RUNNING, "04.free")
def test_with_nothing_ranked_below_a_sequence_preempts_itself():
    sched = scheduler(num_blocks=4)
    a = running(sched, 7, computed=7, outputs=1)  # 2 blocks, room for its token
    b = running(sched, 8, computed=8, outputs=1)  # 2 blocks, its token needs a third
    batch, preempted = run_running(sched, [a, b])
    assert preempted and batch.preempted == [b] and scheduled(batch) == [(a.seq_id, 1)]
    assert sched.running == [a] and sched.waiting == [b] and b.block_table == []
    batch, preempted = run_running(scheduler(num_blocks=2), [])
    assert not preempted and scheduled(batch) == [] and batch.preempted == []


def _reference_running(needs, computed, held, free, budget):
    """The running loop without the package: sequence ``i`` wants ``needs[i]`` tokens after
    its ``computed[i]``, and holds ``held[i]`` blocks. Returns the (index, tokens) scheduled
    and the preempted indices in order."""

    def blocks_after(i, n):
        return -(-(computed[i] + n) // BS)

    queue, out, victims = list(range(len(needs))), [], []
    while queue:
        i = queue.pop(0)
        n = min(needs[i], budget)
        if n == 0:
            continue
        while blocks_after(i, n) - held[i] > free:
            victim = queue.pop() if queue else i
            victims.append(victim)
            free += held[victim]
            if victim == i:
                break
        else:
            free -= blocks_after(i, n) - held[i]
            out.append((i, n))
            budget -= n
    return out, victims


@pytest.mark.assignment(*RUNNING, "04.free")
@pytest.mark.parametrize("seed", range(4))
def test_the_running_loop_matches_a_reference_on_random_engines(seed):
    rng = random.Random(seed)
    for _ in range(50):
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
        assert all(seqs[i].status is SequenceStatus.WAITING for i in victims)


# -- 11.placeholders: the placeholder protocol of async scheduling ---------------------------


def step_of(*pairs) -> SchedulerOutput:
    """A step scheduling ``n`` tokens of each ``(seq, n)``."""
    return SchedulerOutput([s for s, _ in pairs], [n for _, n in pairs])


def tokens(step: SchedulerOutput, *sampled) -> ModelRunnerOutput:
    return ModelRunnerOutput(step, list(sampled))


def launched_seq(sched: Scheduler, prompt_len: int, max_tokens=50) -> Sequence:
    seq = waiting(sched, prompt_len, max_tokens=max_tokens)
    seq.status = SequenceStatus.RUNNING
    sched.waiting.remove(seq)
    sched.running.append(seq)
    return seq


@pytest.mark.assignment("11.placeholders")
def test_a_launch_counts_the_tokens_and_holds_a_placeholder_for_each_sample():
    sched = scheduler()
    whole, chunk, decode = (launched_seq(sched, n) for n in (6, 10, 5))
    decode.num_computed_tokens = 5
    decode.token_ids.append(11)
    decode.num_delivered_tokens = 1
    prompt = list(chunk.token_ids)
    step = step_of((whole, 6), (chunk, 4), (decode, 1))
    assert step.samples == [True, False, True]
    assert sched._advance(step, None) == []
    assert [s.num_computed_tokens for s in (whole, chunk, decode)] == [6, 4, 6]
    assert whole.token_ids[6:] == [PLACEHOLDER] and chunk.token_ids == prompt
    assert decode.output_token_ids == [11, PLACEHOLDER] and decode.num_delivered_tokens == 1
    assert sched.running == [whole, chunk, decode]


@pytest.mark.assignment("11.placeholders")
def test_a_sequence_at_its_length_limit_retires_at_launch():
    sched = scheduler(max_model_len=8)
    one = launched_seq(sched, 4, max_tokens=1)
    two = launched_seq(sched, 4, max_tokens=2)
    long = launched_seq(sched, 7)  # its first output is its 8th token: the model's length
    first = step_of((one, 4), (two, 4), (long, 7))
    sched._advance(first, None)
    assert sched.running == [two]  # the others' last tokens are in flight
    assert set(sched.requests) == {one.request_id, two.request_id, long.request_id}
    assert not one.is_finished and one.token_ids[-1] == PLACEHOLDER
    placed = sched._advance(step_of((two, 1)), tokens(first, 5, 6, 7))  # async: one late
    assert placed == [0, 1, 2] and sched.running == [] and two.num_computed_tokens == 5
    assert two.output_token_ids == [6, PLACEHOLDER]


@pytest.mark.assignment("11.placeholders")
def test_without_async_the_token_replaces_the_placeholder_just_appended():
    sched = scheduler()
    a, b, c = (launched_seq(sched, n) for n in (3, 9, 5))
    step = step_of((a, 3), (b, 4), (c, 5))
    placed = sched._advance(step, tokens(step, 21, None, 23))
    assert placed == [0, 2]  # b's chunk sampled nothing
    assert a.output_token_ids == [21] and c.output_token_ids == [23]
    assert b.num_tokens == 9 and b.num_computed_tokens == 4
    assert [s.num_delivered_tokens for s in (a, b, c)] == [1, 0, 1]
    step = step_of((a, 1), (b, 5), (c, 1))
    assert sched._advance(step, tokens(step, 31, 32, 33)) == [0, 1, 2]
    assert a.output_token_ids == [21, 31] and b.output_token_ids == [32]
    assert PLACEHOLDER not in a.token_ids + b.token_ids + c.token_ids


@pytest.mark.assignment("11.placeholders")
def test_with_async_a_token_lands_before_the_next_placeholder():
    sched = scheduler()
    seq = launched_seq(sched, 6)
    first = step_of((seq, 6))
    assert sched._advance(first, None) == []
    second = step_of((seq, 1))
    assert sched._advance(second, tokens(first, 42)) == [0]
    assert seq.output_token_ids == [42, PLACEHOLDER] and seq.num_computed_tokens == 7
    assert seq.num_delivered_tokens == 1 and seq.token_ids[6] == 42
    third = step_of((seq, 1))
    sched._advance(third, tokens(second, 43))
    assert seq.output_token_ids == [42, 43, PLACEHOLDER] and seq.num_delivered_tokens == 2


@pytest.mark.assignment("11.placeholders", "04.free")
def test_a_finished_sequence_drops_its_late_token():
    sched = scheduler()
    a, b = launched_seq(sched, 4), launched_seq(sched, 5)
    first = step_of((a, 4), (b, 5))
    sched._advance(first, None)
    second = step_of((a, 1), (b, 1))
    sched._advance(second, tokens(first, 10, 20))
    sched.finish_requests(a.request_id)  # aborted (or stopped) while `second` ran
    assert a.output_token_ids == [10]
    placed = sched._advance(step_of((b, 1)), tokens(second, 11, 21))
    assert placed == [1] and a.output_token_ids == [10] and a.num_delivered_tokens == 1
    assert b.output_token_ids == [20, 21, PLACEHOLDER]


@pytest.mark.assignment("11.placeholders", "04.free")
@pytest.mark.parametrize("seed", range(3))
def test_async_and_sync_deliver_the_same_tokens_on_random_runs(seed):
    """A stand-in model samples random tokens (0 is EOS); each request's answer is its
    tokens up to EOS or max_tokens, whether they land at once or one step late."""
    rng = random.Random(seed)
    specs = [(rng.randint(1, 9), rng.randint(1, 8)) for _ in range(rng.randint(1, 6))]
    draws = [[rng.randrange(8) for _ in range(12)] for _ in specs]
    expected = []
    for (_, max_tokens), drawn in zip(specs, draws):
        answer = drawn[:max_tokens]
        expected.append(answer[: answer.index(0) + 1] if 0 in answer else answer)
    for async_scheduling in (False, True):
        sched = scheduler(eos={0})
        seqs = [launched_seq(sched, p, max_tokens=m) for p, m in specs]
        answers, in_flight = {s.request_id: [] for s in seqs}, None
        for _ in range(40):
            if not sched.requests:
                break
            step = step_of(*((s, s.num_tokens - s.num_computed_tokens) for s in sched.running))
            drawn = [draws[seqs.index(s)][s.num_output_tokens] for s in step.seqs]
            landed = tokens(step, *drawn)
            if async_scheduling:
                landed, in_flight = in_flight, landed
            for report in sched.update_from_output(step, landed):
                answers[report.request_id] += report.new_token_ids
        assert [answers[s.request_id] for s in seqs] == expected
        assert [s.output_token_ids for s in seqs] == expected
        assert all(s.is_finished for s in seqs) and sched.running == []

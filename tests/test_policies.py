"""Scheduling policies on a simulated engine: a scheduler and block manager driven by a
fake model that appends one token per finished prefill/decode, with a simulated clock of
one second per step. Fast and deterministic; no model weights involved. At the end, the own
tests of ``FairPolicy.order`` (assignment 06.fair_order) call it alone on hand-made
sequences, so that they reach no other assignment region."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
from course_ids import SCHEDULER

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.policies import (
    FCFS,
    FairPolicy,
    FunctionPolicy,
    MixedPolicy,
    PriorityPolicy,
    get_policy,
)
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import ModelRunnerOutput
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

UNFREED = tuple(a for a in SCHEDULER if a != "04.free")


class Sim:
    """A scheduler plus a fake model; ``admitted`` lists requests in admission order."""

    def __init__(self, policy, max_num_seqs=4, budget=256, num_blocks=10_000, block_size=4):
        config = SimpleNamespace(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=True,
            scheduler_policy=policy,
        )
        self.sched = Scheduler(config, BlockManager(num_blocks, block_size, False))
        self.now, self.steps = 0.0, 0
        self.admitted: list[str] = []
        self.finished_step: dict[str, int] = {}
        self._next_token = 1000

    def submit(self, name: str, prompt_len=4, max_tokens=2, priority=0, **params) -> Sequence:
        self._next_token += prompt_len  # distinct prompts
        tokens = list(range(self._next_token, self._next_token + prompt_len))
        params = SamplingParams(max_tokens=max_tokens, **params)
        seq = Sequence(tokens, params, request_id=name, priority=priority)
        seq.metrics.arrival_time = self.now
        self.sched.add(seq)
        return seq

    def step(self):
        before = {s.request_id for s in self.sched.running}
        batch = self.sched.schedule(now=self.now)
        for seq in batch.seqs:
            if seq.request_id not in before and seq.num_computed_tokens == 0:
                self.admitted.append(seq.request_id)
        self.sched.update_from_output(batch, ModelRunnerOutput.constant(batch, 7))
        for seq in batch.seqs:
            if seq.is_finished:
                self.finished_step[seq.request_id] = self.steps
        self.now += 1.0
        self.steps += 1
        return batch

    def run(self, max_steps=1000):
        while self.sched.has_unfinished() and self.steps < max_steps:
            self.step()

    def running(self) -> list[str]:
        return [s.request_id for s in self.sched.running]


@pytest.mark.assignment(*SCHEDULER)
def test_priority_admits_lower_numbers_first():
    sim = Sim(PriorityPolicy(), max_num_seqs=1)
    for p in [3, 1, 2, 0, 5, 4]:
        sim.submit(f"p{p}", priority=p)
    sim.run()
    assert sim.admitted == ["p0", "p1", "p2", "p3", "p4", "p5"]


@pytest.mark.assignment(*SCHEDULER)
def test_deadline_breaks_ties_between_equal_priorities():
    for policy in (PriorityPolicy(), PriorityPolicy(aging_rate=0)):
        sim = Sim(policy, max_num_seqs=1)
        sim.submit("none")
        sim.submit("loose", deadline=30.0)
        sim.submit("tight", deadline=0.5)
        sim.submit("medium", deadline=5)
        sim.run()
        assert sim.admitted == ["tight", "medium", "none", "loose"]


def _starvation_run(policy, max_steps=150):
    """Two high-priority arrivals per step against capacity for one: an ever-growing queue.
    A low-priority request arrives at step 10; returns the steps it took to finish."""
    sim = Sim(policy, max_num_seqs=2)
    for step in range(max_steps):
        sim.submit(f"hi{2 * step}", priority=0)
        sim.submit(f"hi{2 * step + 1}", priority=0)
        if step == 10:
            sim.submit("low", priority=5)
        sim.step()
        if "low" in sim.finished_step:
            return sim.finished_step["low"] - 10
    return math.inf


def test_aging_prevents_starvation():
    with_aging = _starvation_run(PriorityPolicy(aging_rate=1.0))
    slow_aging = _starvation_run(PriorityPolicy(aging_rate=0.2))
    without_aging = _starvation_run(PriorityPolicy(aging_rate=0.0))
    # After 5 levels / 1 level per second, the low request outranks every newer arrival,
    # so it waits only for the backlog ahead of it (about 20 requests, one per step).
    assert with_aging <= 30
    assert with_aging < slow_aging < 100  # slower aging: longer wait, but still bounded
    assert without_aging == math.inf  # strict priority: starved for all 140 steps


@pytest.mark.assignment(*SCHEDULER)
def test_priority_preemption_victim_is_least_important():
    # 6 blocks of 4 tokens: three 8-token prompts fill the cache; the first decode step
    # needs a new block, so someone is preempted: the lowest priority, not the newest.
    sim = Sim(PriorityPolicy(), max_num_seqs=3, num_blocks=6)
    seqs = {p: sim.submit(f"p{p}", prompt_len=8, max_tokens=3, priority=p) for p in (2, 0, 1)}
    sim.step()
    sim.step()
    assert [seqs[p].metrics.num_preemptions for p in (0, 1, 2)] == [0, 0, 1]
    sim.run()
    assert set(sim.finished_step) == {"p0", "p1", "p2"}


@pytest.mark.assignment(*SCHEDULER)
def test_priority_evicts_to_admit_an_urgent_request():
    sim = Sim(PriorityPolicy(), max_num_seqs=2)
    sim.submit("bg1", max_tokens=50, priority=5)
    sim.submit("bg2", max_tokens=50, priority=5)
    sim.step()
    sim.submit("urgent", priority=0)
    sim.step()
    assert sorted(sim.running()) == ["bg1", "urgent"]  # bg2 (last ranked) gave its slot
    assert sim.sched.num_preemptions == 1
    sim.run()
    assert len(sim.finished_step) == 3 and sim.finished_step["urgent"] < sim.finished_step["bg1"]


@pytest.mark.assignment(*SCHEDULER, "06.fair_order")
def test_fair_interleaves_tenants():
    fair, fcfs = Sim(FairPolicy(), max_num_seqs=4), Sim(FCFS(), max_num_seqs=4)
    for sim in (fair, fcfs):
        for i in range(20):
            sim.submit(f"A{i}", user="A")
        for i in range(2):
            sim.submit(f"B{i}", user="B")
        sim.run()
    assert {"B0", "B1"} <= set(fair.admitted[:4])  # both in the very first batch
    assert fcfs.admitted.index("B0") >= 20  # first come, first served: after all of A


@pytest.mark.assignment(*SCHEDULER, "06.fair_order")
def test_fair_rotates_turns_when_one_slot_frees_at_a_time():
    sim = Sim(FairPolicy(), max_num_seqs=1)
    for i in range(6):
        sim.submit(f"A{i}", user="A")
    for i in range(2):
        sim.submit(f"B{i}", user="B")
    sim.run()
    assert sim.admitted[:5] == ["A0", "B0", "A1", "B1", "A2"]


@pytest.mark.assignment(*UNFREED, "06.fair_order")  # nothing finishes
def test_fair_gives_equal_slots_whatever_the_demand():
    sim = Sim(FairPolicy(), max_num_seqs=6)
    for user, n in (("big", 30), ("mid", 10), ("small", 5)):
        for i in range(n):
            sim.submit(f"{user}{i}", user=user, max_tokens=20)
    sim.step()
    users = [rid.rstrip("0123456789") for rid in sim.running()]
    assert sorted(users) == ["big", "big", "mid", "mid", "small", "small"]


def _classes(sim):
    return sorted(rid.rstrip("0123456789") for rid in sim.running())


def test_mixed_respects_shares():
    sim = Sim(MixedPolicy({"interactive": 0.8, "batch": 0.2}), max_num_seqs=10)
    for i in range(40):  # the batch jobs arrive first
        sim.submit(f"batch{i}", request_class="batch", max_tokens=20)
    for i in range(40):
        sim.submit(f"inter{i}", request_class="interactive", max_tokens=20)
    sim.step()
    assert _classes(sim).count("inter") == 8 and _classes(sim).count("batch") == 2


@pytest.mark.assignment(*SCHEDULER)
def test_mixed_reservation_evicts_batch_work_and_idles_nothing():
    sim = Sim(MixedPolicy({"interactive": 0.8, "batch": 0.2}), max_num_seqs=10)
    for i in range(20):
        sim.submit(f"batch{i}", request_class="batch", max_tokens=50)
    sim.step()
    assert _classes(sim).count("batch") == 10  # alone, batch work may use every slot
    for i in range(20):
        sim.submit(f"inter{i}", max_tokens=5)  # no class: the default, "interactive"
    sim.step()
    assert _classes(sim).count("inter") == 8 and _classes(sim).count("batch") == 2
    assert sim.sched.num_preemptions == 8
    sim.run()
    assert len(sim.finished_step) == 40


def test_custom_policy_function_and_class():
    def shortest_prompt_first(seqs, now):
        return sorted(seqs, key=lambda s: (s.num_prompt_tokens, s.seq_id))

    sim = Sim(shortest_prompt_first, max_num_seqs=1)
    assert isinstance(sim.sched.policy, FunctionPolicy)
    for n in (9, 3, 6):
        sim.submit(f"len{n}", prompt_len=n)
    sim.run()
    assert sim.admitted == ["len3", "len6", "len9"]

    class NewestFirst:
        def __init__(self):
            self.admitted = []

        def order(self, seqs, now):
            return sorted(seqs, key=lambda s: -s.metrics.arrival_time)

        def on_admit(self, seq, now):
            self.admitted.append(seq.request_id)

    policy = NewestFirst()
    sim = Sim(policy, max_num_seqs=1)
    for i in range(3):
        sim.submit(f"r{i}")
        sim.now += 1
    sim.run()
    assert sim.admitted == policy.admitted == ["r2", "r1", "r0"]


def test_bad_policies_are_rejected():
    with pytest.raises(ValueError, match="unknown scheduler_policy"):
        get_policy("lottery")
    with pytest.raises(ValueError, match="order"):
        get_policy(42)
    with pytest.raises(ValueError, match="aging_rate"):
        PriorityPolicy(aging_rate=-1)
    with pytest.raises(ValueError, match="shares"):
        MixedPolicy({"a": 0})
    with pytest.raises(ValueError, match="default_class"):
        MixedPolicy({"a": 1}, default_class="b")
    sim = Sim(lambda seqs, now: seqs[:1])  # loses sequences: caught, not silently dropped
    sim.submit("a")
    sim.submit("b")
    with pytest.raises(RuntimeError, match="permutation"):
        sim.step()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"deadline": 0}, "deadline"),
        ({"deadline": -1.0}, "deadline"),
        ({"deadline": float("nan")}, "deadline"),
        ({"user": 5}, "user"),
        ({"request_class": ["batch"]}, "request_class"),
    ],
)
def test_scheduling_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_names_resolve_to_fresh_policies():
    assert isinstance(get_policy("priority"), PriorityPolicy)
    assert get_policy("fair") is not get_policy("fair")  # per-tenant state is per engine
    assert MixedPolicy().shares == {"interactive": 0.8, "batch": 0.2}


# -- 06.fair_order's own tests: FairPolicy.order on hand-made sequences (no scheduler) -------


def _seq(user, arrival, running=False) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=1, user=user))
    seq.metrics.arrival_time = arrival
    if running:
        seq.status = SequenceStatus.RUNNING
    return seq


@pytest.mark.assignment("06.fair_order")
def test_fair_order_own_one_tenant_is_running_first_then_by_arrival():
    w_early, r_late, w_mid, r_early = (
        _seq(None, 0.0), _seq(None, 3.0, running=True), _seq(None, 1.0), _seq(None, 2.0, True))
    order = FairPolicy().order([w_early, r_late, w_mid, r_early], now=10.0)
    assert order == [r_early, r_late, w_early, w_mid]


@pytest.mark.assignment("06.fair_order")
def test_fair_order_own_interleaves_tenants_round_robin():
    a = [_seq("A", t) for t in (0.0, 1.0, 2.0, 3.0)]
    b = [_seq("B", t) for t in (4.0, 5.0)]
    c = [_seq("C", 6.0)]
    shuffled = [b[1], a[3], c[0], a[0], b[0], a[2], a[1]]
    # every tenant's first, then every tenant's second...; nobody served yet: by arrival
    assert FairPolicy().order(shuffled, now=0.0) == [a[0], b[0], c[0], a[1], b[1], a[2], a[3]]


@pytest.mark.assignment("06.fair_order")
def test_fair_order_own_the_tenant_served_least_recently_goes_first():
    policy = FairPolicy()
    a = [_seq("A", t) for t in (0.0, 1.0)]
    b = [_seq("B", t) for t in (2.0, 3.0)]
    c = [_seq("C", 9.0)]
    policy.on_admit(_seq("B", 0.0), now=0.0)  # B's turn came first, A's after it
    policy.on_admit(_seq("A", 0.0), now=1.0)  # C never had one
    assert policy.order(a + b + c, now=2.0) == [c[0], b[0], a[0], b[1], a[1]]
    policy.on_admit(_seq("B", 0.0), now=3.0)  # now A waited longest of the two
    assert policy.order(a + b, now=4.0) == [a[0], b[0], a[1], b[1]]


@pytest.mark.assignment("06.fair_order")
def test_fair_order_own_a_tenants_running_sequences_come_before_its_waiting_ones():
    r = _seq("A", 5.0, running=True)  # A's running one arrived last...
    w = _seq("A", 0.0)
    b = _seq("B", 1.0)
    # ...but holds A's number 0; A's waiting one is number 1, after B's number 0
    assert FairPolicy().order([w, b, r], now=6.0) == [b, r, w]
    r2 = _seq("B", 7.0, running=True)
    assert FairPolicy().order([w, b, r, r2], now=8.0) == [r, r2, w, b]


@pytest.mark.assignment("06.fair_order")
def test_fair_order_own_ties_and_no_side_effects():
    policy = FairPolicy()
    policy.on_admit(_seq("x", 0.0), now=0.0)
    same = [_seq(user, 1.0) for user in ("x", None, "y", None, "x")]  # one arrival time
    seqs = list(reversed(same))
    before = (list(seqs), dict(policy._last_turn))
    order = policy.order(seqs, now=3.0)
    # None is one tenant of its own; equal arrivals go by seq_id (creation order)
    assert order == [same[1], same[2], same[0], same[3], same[4]]
    assert order is not seqs and (seqs, policy._last_turn) == before  # nothing changed
    assert policy.order(seqs, now=1e6) == order  # `now` plays no part
    assert policy.order([], now=0.0) == []


def _fair_reference(seqs, last_turn):
    """Round robin built round by round (no sort key): each tenant's queue is its running
    sequences then its waiting ones, each by arrival; round k takes every tenant's k-th,
    the tenant served least recently first, then by arrival."""
    def arrival(s):
        return (s.metrics.arrival_time, s.seq_id)

    queues: dict = {}
    for s in seqs:
        queues.setdefault(s.user, []).append(s)
    for user, q in queues.items():
        queues[user] = (sorted([s for s in q if s.status is SequenceStatus.RUNNING], key=arrival)
                        + sorted([s for s in q if s.status is SequenceStatus.WAITING], key=arrival))
    out, k = [], 0
    while len(out) < len(seqs):
        tier = [q[k] for q in queues.values() if len(q) > k]
        tier.sort(key=lambda s: (last_turn.get(s.user, -1), *arrival(s)))
        out += tier
        k += 1
    return out


@pytest.mark.assignment("06.fair_order")
@pytest.mark.parametrize("seed", range(4))
def test_fair_order_own_matches_a_reference_on_random_queues(seed):
    rng = random.Random(seed)
    for _ in range(40):
        policy = FairPolicy()
        users = ["u0", "u1", "u2", None][: rng.randint(1, 4)]
        for user in rng.sample(users, rng.randint(0, len(users))):
            policy.on_admit(_seq(user, 0.0), now=0.0)
        seqs = [_seq(rng.choice(users), float(rng.randint(0, 5)), running=rng.random() < 0.3)
                for _ in range(rng.randint(0, 12))]
        rng.shuffle(seqs)
        expected = _fair_reference(seqs, dict(policy._last_turn))
        assert policy.order(seqs, now=9.0) == expected

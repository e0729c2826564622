"""Continuous batching under a token budget (chapter 06; block accounting in chapter 04).

Every step the scheduler hands the model runner a list of (sequence, number of new tokens)
whose total stays within ``max_num_batched_tokens``. The policy (``policies.py``) first
ranks all unfinished sequences. Running sequences go first, in that order: a decoding
sequence needs one token, a sequence whose prompt was cut into chunks needs its next
chunk. Remaining budget admits waiting sequences in that order, each starting after its
cached prefix. Prefill chunks and decode tokens share one step. When the KV cache has no
block left for a running sequence, the lowest-ranked running sequence is preempted: its
blocks are freed and it will be recomputed later (recompute preemption; with prefix
caching its freed blocks often survive and make the recomputation cheap). Policies that
declare ``preempts_to_admit`` may also evict lower-ranked running sequences to admit a
higher-ranked waiting one, e.g. a high-priority request arriving at a full engine.
For a sliding-window model, each step first gives back the blocks of running sequences that
the window has passed (chapter 12, ``sliding_window.py``).

A policy that raises is tried on each sequence alone: the sequences it fails on are handed
back in ``ScheduledBatch.failed`` (the engine ends them with finish_reason "error") and the
step goes on without them. A policy that fails on no sequence alone, or on every one of
several, is broken as a whole, and its error propagates.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.policies import get_policy
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_tokens: int = field(init=False)  # sum of num_new_tokens, kept up to date
    # sequences the policy failed on, with the error: the engine ends them
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_tokens = sum(self.num_new_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.num_tokens += n

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` if it is in the batch (it was preempted after being scheduled)."""
        for i, s in enumerate(self.seqs):
            if s is seq:
                self.num_tokens -= self.num_new_tokens[i]
                del self.seqs[i], self.num_new_tokens[i]
                return

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.policy = get_policy(config.scheduler_policy)
        self._on_admit = getattr(self.policy, "on_admit", None)
        self._evicts = bool(getattr(self.policy, "preempts_to_admit", False))
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, remaining: int, budget: int) -> int:
        """How many of ``remaining`` tokens fit this step (0 = wait for a later step).

        Handout (chapter 06 §4, chunked prefill). ``remaining`` (an ``int`` >= 1) is what a
        sequence still has to compute, ``budget`` (an ``int`` >= 0) what is left of this
        step's ``max_num_batched_tokens``. Return an ``int`` in ``[0, min(remaining,
        budget)]``: everything when it all fits; otherwise, with ``self.chunked_prefill``,
        as much as the budget allows (a chunk, the rest comes next step); without it, 0
        (the sequence waits whole for a step with room). Change no state.

        Hint: three lines; a decode (``remaining == 1``) fits whenever ``budget >= 1``.
        """
        # >>> assignment 06.chunk (4 points)
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0
        # <<< assignment 06.chunk

    def _rank(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        ordered = list(self.policy.order(seqs, now))
        if len(ordered) != len(seqs) or {id(s) for s in ordered} != {id(s) for s in seqs}:
            raise RuntimeError(f"{self.policy!r}.order must return a permutation of its input")
        return ordered

    def _ordered(self, now: float, failed: list) -> list[Sequence]:
        """Every unfinished sequence, most important first, as the policy ranks them;
        sequences the policy fails on go to ``failed`` instead."""
        seqs = self.running + self.waiting
        try:
            return self._rank(seqs, now)
        except Exception:
            culprits = [(s, err) for s in seqs if (err := self._fails_alone(s, now))]
            if not culprits or len(culprits) == len(seqs) > 1:
                raise  # not one request's fault: the policy itself is broken
        failed += culprits
        bad = {id(s) for s, _ in culprits}
        self.running = [s for s in self.running if id(s) not in bad]
        self.waiting = [s for s in self.waiting if id(s) not in bad]
        return self._ordered(now, failed)

    def _fails_alone(self, seq: Sequence, now: float) -> Exception | None:
        try:
            self._rank([seq], now)
        except Exception as err:
            return err
        return None

    def schedule(self, now: float | None = None) -> ScheduledBatch:
        """Pick this step's sequences and token counts. ``now`` defaults to the clock;
        tests pass a simulated time."""
        now = time.perf_counter() if now is None else now
        # A sliding-window model's manager gives back the blocks the window has passed
        # (chapter 12, sliding_window.py), before allocating: they serve this step.
        if (release := getattr(self.block_manager, "release_outside_window", None)) is not None:
            for seq in self.running:
                release(seq)
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        ordered = self._ordered(now, batch.failed)
        rank = {s.seq_id: i for i, s in enumerate(ordered)}
        waiting = [s for s in ordered if s.status is SequenceStatus.WAITING]
        queue = deque(s for s in ordered if s.status is SequenceStatus.RUNNING)
        self.running = []
        preempted = False
        while queue:
            seq = queue.popleft()
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                self.running.append(seq)  # keeps its blocks, waits for budget
                continue
            while not self.block_manager.allocate(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.running.append(seq)
                batch.add(seq, n)
                budget -= n
        if not preempted:  # after a preemption, admitting more would only thrash
            self._admit(waiting, batch, rank, now)
        self.drop_orphans(batch)
        return batch

    def drop_orphans(self, batch: ScheduledBatch) -> None:
        """Preempt the sequences of ``batch`` that adopted a cached block whose computation
        left the step (``BlockManager.take_orphans``); they are recomputed later."""
        # Preempting one may orphan blocks that another adopted from it: repeat until none.
        while orphans := self.block_manager.take_orphans():
            for seq in [s for s in batch.seqs if not orphans.isdisjoint(s.block_table)]:
                batch.remove(seq)
                self.running.remove(seq)
                self._preempt(seq)

    def _admit(
        self, ordered: list[Sequence], batch: ScheduledBatch, rank: dict, now: float
    ) -> None:
        bs = self.block_manager.block_size
        for seq in ordered:
            budget = self.max_num_batched_tokens - batch.num_tokens
            cached = self.block_manager.cached_prefix(seq)
            n = self._chunk(seq.num_tokens - len(cached) * bs, budget)
            if n == 0 or not self._fit(seq, n, cached, rank, batch):
                break  # head-of-line blocking keeps the policy's order honest
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_prompt_tokens = len(cached) * bs
            if self._on_admit is not None:
                self._on_admit(seq, now)
            self.running.append(seq)
            batch.add(seq, n)
        self.waiting = [s for s in self.waiting if s.status is SequenceStatus.WAITING]

    def _fit(
        self, seq: Sequence, n: int, cached: list[int], rank: dict, batch: ScheduledBatch
    ) -> bool:
        """Give ``seq`` a slot and blocks, evicting lower-ranked running sequences if the
        policy allows it and that makes enough room; False if it does not fit."""
        bm = self.block_manager
        if len(self.running) < self.max_num_seqs and bm.allocate(seq, n, cached):
            return True
        if not self._evicts:
            return False
        lower = [s for s in self.running if rank[s.seq_id] > rank[seq.seq_id]]
        lower.sort(key=lambda s: rank[s.seq_id])
        freeable = sum(1 for s in lower for b in s.block_table
                       if bm.blocks[b].ref_count == 1 and b != bm.null_block)
        revived = sum(1 for b in cached if bm.blocks[b].ref_count == 0)
        needed = bm.blocks_needed(len(cached) * bm.block_size + n) - len(cached) + revived
        if not lower or needed > bm.num_free_blocks + freeable:
            return False  # evicting would not make room: leave the running ones alone
        while lower:
            victim = lower.pop()  # the least important first
            self.running.remove(victim)
            batch.remove(victim)
            self._preempt(victim)
            if len(self.running) < self.max_num_seqs and bm.allocate(seq, n, cached):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Preempt running ``seq`` by recomputation: it gives up its KV cache and waits again.

        Handout (chapter 06 §5, preemption). The caller has already taken ``seq`` out of
        ``self.running`` and of this step's batch. Release all its blocks with
        ``self.block_manager.free(seq)`` (chapter 04: this also resets
        ``seq.num_computed_tokens`` to 0, so its prompt *and* the tokens generated so far
        are recomputed when it is admitted again); set its status back to
        ``SequenceStatus.WAITING``; count the preemption twice, in the request's own
        ``seq.metrics.num_preemptions`` and in the engine-wide ``self.num_preemptions``;
        and put it in ``self.waiting``. Keep ``seq.token_ids``: the outputs so far are not
        lost, only their KV cache.

        Hint: five lines. Where in ``self.waiting`` it goes does not matter: every step the
        policy ranks running and waiting sequences afresh.
        """
        # >>> assignment 06.preempt (6 points)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)  # where in the queue does not matter: the policy ranks it
        # <<< assignment 06.preempt

    def retire(self, seq: Sequence) -> None:
        """Schedule running ``seq`` no more: its last token is in flight and it will
        ``finish`` when that token arrives (async scheduling, chapter 11). Keeps its blocks."""
        self.running.remove(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (whether running or waiting) and release its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.metrics.finished_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

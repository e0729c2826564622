"""Continuous batching under a token budget (chapter 06; block accounting in chapter 04).

Every step the scheduler hands the model runner a list of (sequence, number of new tokens)
whose total stays within ``max_num_batched_tokens``. Running sequences go first: a
decoding sequence needs one token, a sequence whose prompt was cut into chunks needs its
next chunk. Remaining budget admits waiting sequences, each starting after its cached
prefix. Prefill chunks and decode tokens share one step. When the KV cache has no block
left for a running sequence, the least important running sequence is preempted: its
blocks are freed and it will be recomputed from scratch later (recompute preemption).
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

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.policy = get_policy(config.scheduler_policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, remaining: int, budget: int) -> int:
        """How many of ``remaining`` tokens fit this step (0 = wait for a later step)."""
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0

    def schedule(self) -> ScheduledBatch:
        now = time.perf_counter()
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        queue = deque(self.policy.order(self.running, now))
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
            self._admit(batch, budget, now)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int, now: float) -> None:
        ordered = self.policy.order(list(self.waiting), now)
        for seq in ordered:
            if len(self.running) >= self.max_num_seqs or budget == 0:
                break
            cached = self.block_manager.cached_prefix(seq)
            n = self._chunk(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
            if n == 0 or not self.block_manager.allocate(seq, n, cached):
                break  # head-of-line blocking keeps the policy's order honest
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_prompt_tokens = len(cached) * self.block_manager.block_size
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (whether running or waiting) and release its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.metrics.finished_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

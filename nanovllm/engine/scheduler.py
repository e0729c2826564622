"""Continuous batching under a token budget, and the one owner of request state (chapter 06;
block accounting in chapter 04).

The scheduler owns every unfinished request (``requests``) and is the only writer of its
progress. A step reads as three calls (``LLMEngine.step``): ``schedule()`` returns a
``SchedulerOutput`` (``scheduler_output.py``), the model runner executes it, and
``update_from_output()`` advances ``num_computed_tokens`` by what ran, appends the sampled
tokens (a placeholder first while a token is in flight, async scheduling, chapter 11), checks
stop and length (``stop_checker.py``), registers full blocks for prefix caching and frees what
finished. The block manager answers questions (``can_allocate``, ``num_blocks_to_allocate``,
``num_freeable_blocks``) and keeps the block tables; it never moves a request's progress.

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

A policy that raises is tried on each sequence alone: the sequences it fails on end with
finish_reason "error" (reported by the next ``update_from_output``) and the step goes on
without them. A policy that fails on no sequence alone, or on every one of
several, is broken as a whole, and its error propagates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.policies import get_policy, rank_isolating_failures
from nanovllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.engine.stop_checker import StopChecker

logger = logging.getLogger("nanovllm")


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager,
        stop_checker: StopChecker | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.policy = get_policy(config.scheduler_policy)
        self._on_admit = getattr(self.policy, "on_admit", None)
        self._evicts = bool(getattr(self.policy, "preempts_to_admit", False))
        # (a stand-alone scheduler, as in tests and chapter 06, stops on max_tokens alone)
        self.stop_checker = stop_checker or StopChecker(None, set(), None)
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._finished_seq_ids: set[int] = set()  # for the next SchedulerOutput
        self._reports: list[EngineCoreOutput] = []  # endings not reported yet

    def add(self, seq: Sequence) -> None:
        """Take a new request (``LLMEngine.add_sequence`` claimed its id)."""
        if seq.request_id in self.requests:
            raise ValueError(f"sequence {seq.request_id!r} was added already")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

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

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's sequences and token counts. ``now`` defaults to the clock;
        tests pass a simulated time."""
        now = time.perf_counter() if now is None else now
        # A sliding-window model's manager gives back the blocks the window has passed
        # (chapter 12, sliding_window.py), before allocating: they serve this step.
        for seq in self.running:
            self.block_manager.release_outside_window(seq)
        batch, budget = SchedulerOutput(), self.max_num_batched_tokens
        batch.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, set()
        ordered, failed = rank_isolating_failures(self.policy, self.running + self.waiting, now)
        for seq, err in failed:  # (a policy error that is one request's: it ends alone)
            self._reports.append(self._finish(seq, "error", error=_describe(err)))
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
                batch.preempted.append(victim)
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

    def drop_orphans(self, batch: SchedulerOutput) -> None:
        """Preempt the sequences of ``batch`` that adopted a cached block whose computation
        left the step (``BlockManager.take_orphans``); they are recomputed later."""
        # Preempting one may orphan blocks that another adopted from it: repeat until none.
        while orphans := self.block_manager.take_orphans():
            for seq in [s for s in batch.seqs if not orphans.isdisjoint(s.block_table)]:
                batch.remove(seq)
                self.running.remove(seq)
                self._preempt(seq)
                batch.preempted.append(seq)

    def _admit(
        self, ordered: list[Sequence], batch: SchedulerOutput, rank: dict, now: float
    ) -> None:
        bs = self.block_manager.block_size
        for seq in ordered:
            budget = self.max_num_batched_tokens - batch.num_tokens
            cached = self.block_manager.cached_prefix(seq)
            n = self._chunk(seq.num_tokens - len(cached) * bs, budget)
            if n == 0 or not self._fit(seq, n, cached, rank, batch):
                break  # head-of-line blocking keeps the policy's order honest
            seq.num_computed_tokens = len(cached) * bs  # the cached prefix counts as computed
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
        self, seq: Sequence, n: int, cached: list[int], rank: dict, batch: SchedulerOutput
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
        needed = bm.num_blocks_to_allocate(seq, n, cached)
        if not lower or needed > bm.num_free_blocks + bm.num_freeable_blocks(lower):
            return False  # evicting would not make room: leave the running ones alone
        while lower:
            victim = lower.pop()  # the least important first
            self.running.remove(victim)
            batch.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if len(self.running) < self.max_num_seqs and bm.allocate(seq, n, cached):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Preempt running ``seq`` by recomputation: it gives up its KV cache and waits again.

        Handout (chapter 06 §5, preemption). The caller has already taken ``seq`` out of
        ``self.running`` and of this step's batch. Release all its blocks with
        ``self.block_manager.free(seq)`` (chapter 04), then reset
        ``seq.num_computed_tokens`` to 0, so its prompt *and* the tokens generated so far
        are recomputed when it is admitted again; set its status back to
        ``SequenceStatus.WAITING``; count the preemption twice, in the request's own
        ``seq.metrics.num_preemptions`` and in the engine-wide ``self.num_preemptions``;
        and put it in ``self.waiting``. Keep ``seq.token_ids``: the outputs so far are not
        lost, only their KV cache.

        Hint: six lines. Where in ``self.waiting`` it goes does not matter: every step the
        policy ranks running and waiting sequences afresh.
        """
        # >>> assignment 06.preempt (6 points)
        self.block_manager.free(seq)  # (reads num_computed_tokens: reset it after)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)  # where in the queue does not matter: the policy ranks it
        # <<< assignment 06.preempt

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput | None
    ) -> list[EngineCoreOutput]:
        """The one place a request progresses: ``scheduler_output``'s tokens count as computed
        and each sequence that sampled gets a placeholder; then ``model_output``'s tokens
        replace their placeholders, stop and length are checked, full blocks registered and
        finished requests freed. Returns a report per request that got tokens or ended.

        ``model_output`` is the step just run, or with async scheduling the one before it
        (whose tokens arrived while this one was queued on the device), or None."""
        outputs, self._reports = self._reports, []
        self._advance(scheduler_output)
        if model_output is not None:
            outputs += self._apply(model_output)
        return outputs

    def _advance(self, step: SchedulerOutput) -> None:
        for seq, n, samples in zip(step.seqs, step.num_new_tokens, step.samples):
            seq.num_computed_tokens += n
            if not samples:
                continue  # mid-prompt: nothing sampled
            seq.token_ids.append(PLACEHOLDER)  # filled in when the token reaches the host
            if self.stop_checker.reached_length(seq, seq.num_tokens):
                self.running.remove(seq)  # done whatever the token: never schedule it again

    def _apply(self, model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        step, in_flight = model_output.step, model_output.in_flight
        now = time.perf_counter()
        outputs = self._prompt_logprobs(in_flight) if in_flight is not None else []
        for i, (seq, token) in enumerate(zip(step.seqs, model_output.sampled_token_ids)):
            if seq.is_finished or token is None:
                continue  # ended while this step ran (its token is dropped), or mid-prompt
            try:
                outputs.append(self._append_token(seq, token, now))
                if (k := seq.params.logprobs) is not None:
                    row = in_flight.logit_rows[i]
                    outputs[-1].new_logprobs = [in_flight.token_logprobs(row, token, k)]
            except Exception as err:  # e.g. its stop check: this request's problem alone
                outputs.append(self._finish(seq, "error", error=_describe(err)))
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float) -> EngineCoreOutput:
        # This step's token follows the ones delivered so far; with async scheduling the
        # next step's placeholder may already stand after it.
        seq.num_delivered_tokens += 1
        length = seq.num_prompt_tokens + seq.num_delivered_tokens
        seq.token_ids[length - 1] = token
        # Blocks that waited for this token are registered now (see cache_full_blocks).
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_output_tokens += 1
        stop = self.stop_checker.check(seq, token, length)
        if stop is None:
            return EngineCoreOutput(seq.parent_id, [token], index=seq.index)
        del seq.token_ids[length:]
        return self._finish(seq, *stop, new_token_ids=[token])

    def _prompt_logprobs(self, in_flight) -> list[EngineCoreOutput]:
        """Reports of the prompt logprobs a step computed, each position once (a preempted
        request computes its prompt again)."""
        outputs = []
        for seq, first, tensors in in_flight.prompt_logprobs:
            logprob, rank, top_ids, top_logprobs = (t.tolist() for t in tensors)
            entries = []
            for i, position in enumerate(range(first, first + len(logprob))):
                if seq.is_finished or position + 1 < seq.num_prompt_logprobs_sent:
                    continue
                token = seq.token_ids[position + 1]
                entries.append((token, logprob[i], rank[i], top_ids[i], top_logprobs[i]))
                seq.num_prompt_logprobs_sent = position + 2
            if entries:
                out = EngineCoreOutput(seq.parent_id, [], index=seq.index)
                out.new_prompt_logprobs = entries
                outputs.append(out)
        return outputs

    # -- endings ---------------------------------------------------------------------------
    def finish_requests(
        self, request_ids: str | Iterable[str], reason: str = "abort"
    ) -> list[EngineCoreOutput]:
        """End every sample of these requests (unknown ids are ignored); their reports."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        doomed = [s for s in self.requests.values() if s.parent_id in ids]
        return [self._finish(s, reason) for s in doomed]

    def fail(self, step: SchedulerOutput, failures: list[tuple[Sequence, Exception]]) -> None:
        """Take sequences whose own inputs failed to prepare out of ``step`` (nothing ran
        yet) and end them with "error"; reported by the next ``update_from_output``."""
        for seq, err in failures:
            step.remove(seq)
            self._reports.append(self._finish(seq, "error", error=_describe(err)))
        self.drop_orphans(step)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        stop_reason: int | str | None = None,
        error: str | None = None,
        new_token_ids: list[int] = (),
    ) -> EngineCoreOutput:
        """The one way a request ends: blocks freed, state dropped, its final report."""
        if error is not None:
            logger.warning("request %r failed: %s", seq.request_id, error)
        self.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        self._finished_seq_ids.add(seq.seq_id)
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:  # an in-flight token
            seq.token_ids.pop()
        return EngineCoreOutput(
            seq.parent_id, list(new_token_ids), reason, stop_reason, error, index=seq.index
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (running, waiting, or retired with its last token in flight) and
        release its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.metrics.finished_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"

"""Continuous batching under a token budget, and the one owner of request state (chapter 06;
block accounting in chapter 04).

A step is ``schedule()`` (a ``SchedulerOutput``), the model runner, then
``update_from_output()``: the one place a request progresses (computed tokens, sampled
tokens with placeholders while in flight: chapter 11; stop; freeing). The block manager only
answers questions and keeps block tables; a sliding window's release runs first (chapter 12).
Running sequences are served in the policy's order, waiting ones admitted into what is left of
the token budget, and an exhausted KV cache preempts the lowest-ranked by recomputation
(chapter 06 §1 and §5). A policy error that is one request's ends that request alone.
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
from nanovllm.engine.spec_decode.scheduling import apply_verified, num_rejected
from nanovllm.engine.stop_checker import StopChecker

logger = logging.getLogger("nanovllm")


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 stop_checker: StopChecker | None = None) -> None:
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

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's sequences and token counts. ``now`` defaults to the clock;
        tests pass a simulated time."""
        now = time.perf_counter() if now is None else now
        # A sliding-window model's manager gives back the blocks the window has passed
        # (chapter 12, sliding_window.py), before allocating: they serve this step.
        for seq in self.running:
            self.block_manager.release_outside_window(seq)
        batch = SchedulerOutput()
        batch.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, set()
        ordered, failed = rank_isolating_failures(self.policy, self.running + self.waiting, now)
        for seq, err in failed:  # (a policy error that is one request's: it ends alone)
            self._reports.append(self._finish(seq, "error", error=_describe(err)))
        rank = {s.seq_id: i for i, s in enumerate(ordered)}
        running = [s for s in ordered if s.status is SequenceStatus.RUNNING]
        waiting = [s for s in ordered if s.status is SequenceStatus.WAITING]
        if not self._schedule_running(running, batch):  # after a preemption, admitting
            self._admit(waiting, batch, rank, now)  # more would only thrash
        self.drop_orphans(batch)
        return batch

    def _schedule_running(self, ranked: list[Sequence], batch: SchedulerOutput) -> bool:
        """Serve the running sequences in rank order, preempting when the KV cache runs out;
        returns whether it preempted anything.

        Handout (chapter 06 §1 and §5, recompute preemption). ``ranked``: every running
        sequence, most important first; ``batch``: this step's ``SchedulerOutput``, empty.
        Serve the sequences in that order, rebuilding ``self.running``. Each wants the
        tokens it has not computed (``num_tokens - num_computed_tokens``: 1 to decode, the
        rest of a prompt computed in chunks) and gets at most what those before it left of
        ``self.max_num_batched_tokens``. One that gets nothing stays running, keeping its
        blocks, out of the batch. One that gets ``n`` tokens needs
        ``self.block_manager.allocate(seq, n)`` (chapter 04; all or nothing), then joins
        ``self.running`` and ``batch`` (``batch.add``).

        While that allocation fails, preempt the least important sequence not served yet
        (the last of ``ranked`` still to come) with ``self._preempt`` (given: it frees the
        blocks and requeues), list it in ``batch.preempted``, and try again; with nobody
        left to come, the sequence preempts itself. Invariants: nobody is preempted for a
        sequence ranked below it; ``batch.num_tokens`` stays within the budget; each
        sequence of ``ranked`` ends up either in ``self.running`` (in rank order) or in
        ``batch.preempted`` (in preemption order), never both.
        """
        # >>> assignment 06.preempt (8 points)
        queue = deque(ranked)
        self.running = []
        preempted = False
        while queue:
            seq = queue.popleft()
            budget = self.max_num_batched_tokens - batch.num_tokens
            # (chunked prefill off: admitted whole, a running sequence only ever decodes)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
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
        return preempted
        # <<< assignment 06.preempt

    def _admit(self, ranked: list[Sequence], batch: SchedulerOutput, rank: dict[int, int],
               now: float) -> None:
        """Admit waiting sequences, most important first, into what is left of this step.

        Handout (chapter 06 §1 and §4, admission and chunked prefill). ``ranked``: the
        waiting sequences in the policy's order; ``batch``: this step so far (the running
        sequences'); ``rank``: every sequence's place in that order, for ``_fit``; ``now``:
        the step's time.

        Walk ``ranked`` and stop at the first sequence that cannot be admitted (head-of-line
        blocking: no request behind it overtakes it). A sequence's cached prefix
        (``self.block_manager.cached_prefix(seq)``: ids of full blocks of ``block_size``
        tokens) counts as computed and costs no budget; the rest must be computed. The
        budget is ``self.max_num_batched_tokens`` less ``batch.num_tokens`` at that moment
        (an eviction takes its victim's tokens out of the batch). The rest runs whole if it
        fits the budget; otherwise with ``self.chunked_prefill`` as much as the budget
        allows (later steps compute the remainder), and without it nothing. A sequence that
        can run nothing is not admitted; nor is one for which ``self._fit(seq, n, cached,
        rank, batch)`` says False. ``_fit`` (given) checks for a slot (``max_num_seqs``)
        and allocates the blocks, evicting lower-ranked running sequences for policies with
        ``preempts_to_admit``.

        An admitted sequence: ``num_computed_tokens`` = its cached tokens (set before
        ``batch.add``, which reads it); status RUNNING; appended to ``self.running`` and
        added to ``batch`` with its ``n`` tokens; on its first admission only
        (``metrics.first_scheduled_time`` is None; a preempted sequence comes back)
        ``metrics.first_scheduled_time = now`` and ``metrics.num_cached_prompt_tokens`` =
        its cached tokens; ``self._on_admit(seq, now)`` when the policy has one. At the end
        ``self.waiting`` holds exactly the sequences still waiting, in their earlier order
        (any that ``_fit`` evicted included).
        """
        # >>> assignment 06.admit (11 points)
        bs = self.block_manager.block_size
        for seq in ranked:
            budget = self.max_num_batched_tokens - batch.num_tokens
            cached = self.block_manager.cached_prefix(seq)
            remaining = seq.num_tokens - len(cached) * bs
            if remaining <= budget:
                n = remaining
            else:
                n = budget if self.chunked_prefill else 0
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
        # <<< assignment 06.admit

    def _fit(self, seq: Sequence, n: int, cached: list[int], rank: dict,
             batch: SchedulerOutput) -> bool:
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
            self._evict(lower.pop(), batch)  # the least important first
            if len(self.running) < self.max_num_seqs and bm.allocate(seq, n, cached):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        """Preempt ``seq`` by recomputation (chapter 06 §5): it gives up its KV cache and
        waits again. The caller has taken it out of ``self.running`` and of this step's batch.
        Its tokens stay: when admitted again it computes its prompt *and* its outputs so far.
        Where in ``self.waiting`` it goes does not matter: every step the policy ranks all."""
        self.block_manager.free(seq)  # (reads num_computed_tokens: reset it after)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def drop_orphans(self, batch: SchedulerOutput) -> None:
        """Preempt the sequences of ``batch`` that adopted a cached block whose computation
        left the step (``BlockManager.take_orphans``); they are recomputed later."""
        # Preempting one may orphan blocks that another adopted from it: repeat until none.
        while orphans := self.block_manager.take_orphans():
            for seq in [s for s in batch.seqs if not orphans.isdisjoint(s.block_table)]:
                self._evict(seq, batch)

    def _evict(self, seq: Sequence, batch: SchedulerOutput) -> None:
        """Take a scheduled ``seq`` out of ``self.running`` and this step, and preempt it."""
        self.running.remove(seq)
        batch.remove(seq)
        self._preempt(seq)
        batch.preempted.append(seq)

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput | None) -> list[EngineCoreOutput]:
        """The one place a request progresses: ``scheduler_output``'s tokens count as computed
        and each sequence that sampled gets a placeholder; then ``model_output``'s tokens
        replace their placeholders, stop and length are checked, full blocks registered and
        finished requests freed. Returns a report per request that got tokens or ended.
        ``model_output`` is the step just run, or with async scheduling the one before it
        (whose tokens arrived while this one was queued on the device), or None."""
        outputs, self._reports = self._reports, []
        if scheduler_output.draft_token_ids is not None:  # speculative (chapter 14): synchronous
            step = scheduler_output  # verified tokens count as computed, rejected proposals not
            for seq, n, emitted in zip(step.seqs, step.num_new_tokens,
                                       model_output.sampled_token_ids):
                seq.num_computed_tokens += n - num_rejected(step, seq, emitted)
            return outputs + apply_verified(self, model_output)
        placed = self._advance(scheduler_output, model_output)
        if model_output is not None:
            outputs += self._apply(model_output, placed)
        return outputs

    def _advance(self, launched: SchedulerOutput, landed: ModelRunnerOutput | None) -> list[int]:
        """Advance a launched step's sequences, and put a landed step's tokens in place;
        returns the indices (into ``landed.step.seqs``, ascending) of the tokens written.

        Handout (chapter 11 §4.2, async scheduling: the placeholder protocol). ``launched``
        is the step just queued on the device; ``landed`` the step whose tokens reached the
        host: the same step without async scheduling, the one before it with it (its
        ``step`` was launched by the previous call), or None. Do ``launched`` first.

        Launched: each sequence's ``num_computed_tokens`` grows by its
        ``num_new_tokens[i]``. One that samples (``samples[i]``; a prompt chunk that stops
        mid-prompt does not) gets ``PLACEHOLDER`` appended to ``token_ids``, standing for
        the token the device is sampling. If that token is its last for length
        (``self.stop_checker.reached_length(seq, seq.num_tokens)``) it leaves
        ``self.running`` now (it must never be scheduled again) but stays in
        ``self.requests`` until its token lands.

        Landed: ``sampled_token_ids[i]`` belongs to ``landed.step.seqs[i]``; None means its
        step sampled nothing. A sequence that finished meanwhile (a stop found one step
        late, an abort) drops its token. Any other counts it in ``num_delivered_tokens``
        and writes it over its output number ``num_delivered_tokens``, i.e. at index
        ``num_prompt_tokens + num_delivered_tokens - 1`` of ``token_ids``: not always the
        last index, since the next step's placeholder may already follow it. Stop checks,
        block registration and reports are the caller's (``_apply``).
        """
        # >>> assignment 11.placeholders (8 points)
        for seq, n, samples in zip(launched.seqs, launched.num_new_tokens, launched.samples):
            seq.num_computed_tokens += n
            if not samples:
                continue  # mid-prompt: nothing sampled
            seq.token_ids.append(PLACEHOLDER)  # filled in when the token reaches the host
            if self.stop_checker.reached_length(seq, seq.num_tokens):
                self.running.remove(seq)  # done whatever the token: never schedule it again
        placed = []
        if landed is not None:
            for i, (seq, token) in enumerate(zip(landed.step.seqs, landed.sampled_token_ids)):
                if seq.is_finished or token is None:
                    continue  # ended while this step ran (its token is dropped), or mid-prompt
                seq.num_delivered_tokens += 1
                seq.token_ids[seq.num_prompt_tokens + seq.num_delivered_tokens - 1] = token
                placed.append(i)
        return placed
        # <<< assignment 11.placeholders

    def _apply(self, model_output: ModelRunnerOutput, placed: list[int]) -> list[EngineCoreOutput]:
        """Reports for the tokens ``_advance`` put in place (indices into the step), and for
        the prompt logprobs the step computed."""
        step, in_flight = model_output.step, model_output.in_flight
        now = time.perf_counter()
        outputs = self._prompt_logprobs(in_flight) if in_flight is not None else []
        for i in placed:
            seq, token = step.seqs[i], model_output.sampled_token_ids[i]
            try:
                outputs.append(self._took_token(seq, token, now))
                if (k := seq.params.logprobs) is not None:
                    row = in_flight.logit_rows[i]
                    outputs[-1].new_logprobs = [in_flight.token_logprobs(row, token, k)]
            except Exception as err:  # e.g. its stop check: this request's problem alone
                outputs.append(self._finish(seq, "error", error=_describe(err)))
        return outputs

    def _took_token(self, seq: Sequence, token: int, now: float) -> EngineCoreOutput:
        """``seq``'s newest delivered ``token`` is in place: register the blocks that waited
        for it, count it, check stop; its report."""
        length = seq.num_prompt_tokens + seq.num_delivered_tokens
        # Blocks that waited for this token are registered now (see cache_full_blocks).
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_output_tokens += 1
        if seq.grammar is not None:  # its constraint's matcher follows every token (ch. 15)
            seq.grammar.accept(token)
        stop = self.stop_checker.check(seq, token, length)
        if stop is None and seq.grammar is not None and seq.grammar.is_terminated:
            stop = "stop", None  # the constraint is complete
        if stop is None:
            return EngineCoreOutput(seq.parent_id, [token], index=seq.index)
        return self._finish(seq, *stop, new_token_ids=[token])  # (drops a placeholder after it)

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
    def finish_requests(self, request_ids: str | Iterable[str],
                        reason: str = "abort") -> list[EngineCoreOutput]:
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

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
                error: str | None = None, new_token_ids: list[int] = ()) -> EngineCoreOutput:
        """The one way a request ends: blocks freed, state dropped, its final report."""
        if error is not None:
            logger.warning("request %r failed: %s", seq.request_id, error)
        self.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        self._finished_seq_ids.add(seq.seq_id)
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:  # an in-flight token
            seq.token_ids.pop()
        return EngineCoreOutput(seq.parent_id, list(new_token_ids), reason, stop_reason, error,
                                index=seq.index)

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

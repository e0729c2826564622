"""The step loop: schedule -> run the model -> apply the new tokens (chapters 00, 06, 11).

``add_request`` validates a request completely before it enters the engine, so bad input
raises ``ValueError`` and never disturbs the requests already inside. ``make_sequence``
(validation) reads only settings fixed at start-up, so other threads may call it; every
other method changes engine state and belongs to one thread at a time (see
``async_engine.py``, chapter 10). ``step()`` returns one ``EngineCoreOutput`` per request
that progressed (``output_processor.py``). Each step is measured into ``stats``; set
``timeline = TimelineRecorder()`` to also record who ran what (``metrics.py``).

Which errors end one request and which end the engine
-----------------------------------------------------
An error that belongs to one request ends that request alone, with finish_reason "error"
and the message in ``EngineCoreOutput.error``; its blocks are freed and every other
request goes on. Such errors are those raised while the scheduling policy ranks it, while
its inputs or sampling settings are prepared (both happen before the device runs anything,
so the step is re-launched without it), and while its new token is applied (stop checks,
detokenization). Everything else propagates out of ``step()``: the forward pass, the
sampling kernels, CUDA errors and out-of-memory. Those are not one request's fault and may
leave the device unusable; ``AsyncEngine`` then ends every stream with ``EngineError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from nanovllm.config import EngineConfig
from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.distributed import check_divisible
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.metrics import EngineStats, StepMetrics, TimelineRecorder
from nanovllm.engine.model_runner import InFlight, ModelRunner
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.sliding_window import make_block_manager
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenizer import load_tokenizer

MAX_DEFAULT_MODEL_LEN = 8192
logger = logging.getLogger("nanovllm")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        get_model_class(self.model_config.architecture)  # fail early on unsupported models
        if config.tensor_parallel_size > 1:  # before any worker starts (chapter 09)
            mc = self.model_config
            check_divisible(mc.num_heads, mc.num_kv_heads, mc.intermediate_size,
                            config.tensor_parallel_size)
        if config.max_model_len is None:
            config.max_model_len = min(
                self.model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN
            )
        if config.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner = ModelRunner(config, self.model_config)
        self.runner.sampling_inputs.eos_token_ids = self.eos_token_ids  # for min_tokens
        self.block_manager = make_block_manager(  # frees out-of-window blocks (chapter 12)
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            self.model_config.sliding_window,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.input_processor = InputProcessor(
            config, self.model_config, self.tokenizer, self.eos_token_ids,
            self.block_manager.num_blocks * config.block_size,
        )
        self.requests: dict[str, Sequence] = {}
        self._in_flight: tuple[ScheduledBatch, InFlight] | None = None  # async scheduling
        self.stats = EngineStats()
        self.timeline: TimelineRecorder | None = None  # off by default: costs nothing

    # -- requests ------------------------------------------------------------------------
    def make_sequence(
        self,
        prompt: object,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate one request and wrap it in a Sequence (nothing enters the engine yet;
        any thread may call this: ``input_processor.py``)."""
        return self.input_processor.make_sequence(prompt, params, request_id, priority)

    def make_sequences(
        self,
        prompt: object,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[Sequence]:
        """``make_sequence`` for each of the request's ``params.n`` samples."""
        return self.input_processor.make_sequences(prompt, params, request_id, priority)

    def add_sequence(self, seq: Sequence) -> None:
        """Put a validated sequence into the scheduler's waiting queue. A generated request
        id never collides: one in use is replaced by a fresh one."""
        if seq.request_id in self.requests:
            if seq.has_user_request_id:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            seq.rename(self.requests)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(
        self,
        request_id: str | None,
        prompt: object,
        params: SamplingParams,
        priority: int = 0,
    ) -> str:
        """Validate and queue one request (vLLM's signature); returns its id, generated
        when ``request_id`` is None. Its reports carry that id (and the sample's index)."""
        seqs = self.make_sequences(prompt, params, request_id, priority)
        for seq in seqs:
            self.add_sequence(seq)
        return seqs[0].parent_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Finish requests with reason "abort", freeing their KV blocks now; returns the
        final report of each one that was still unfinished (unknown ids are ignored)."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        doomed = [s for s in self.requests.values() if s.parent_id in ids]  # all n samples
        return [self._finish(s, "abort") for s in doomed]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``BlockManager.reset_prefix_cache``); False, changing
        nothing, while requests are unfinished."""
        return not self.requests and self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Give the GPU memory back and stop the tensor-parallel workers (chapter 09)."""
        self.runner.shutdown()

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns a report for each request that got tokens or ended.

        With ``async_scheduling`` a step's tokens arrive one call later: this call queues
        step n on the GPU, then reads step n-1's tokens while the GPU computes, and the
        next call schedules step n+1 meanwhile. Step n's sequences hold a placeholder for
        their newest token until then (never reported); the GPU feeds the real one to step
        n+1 directly.
        """
        start = time.perf_counter()
        batch = self.scheduler.schedule(start)
        outputs = [self._finish(seq, "error", error=_describe(err)) for seq, err in batch.failed]
        launched = self._launch(batch, outputs) if batch.seqs else None
        # A decode is one new token after the whole prompt; anything else is prefill work
        # (a prompt chunk, or recomputation after a preemption). Read before _apply, which
        # resets the counts of sequences that finish.
        decodes = [
            n == 1 and s.num_computed_tokens > s.num_prompt_tokens
            for s, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            outputs += self._apply(*previous)
        if launched is not None and not self.config.async_scheduling:
            outputs += self._apply(*launched)
            self._in_flight = None
        if launched is not None:
            self._record_step(batch, decodes, start)
        return outputs

    def _launch(
        self, batch: ScheduledBatch, outputs: list[EngineCoreOutput]
    ) -> tuple[ScheduledBatch, InFlight] | None:
        while True:
            try:
                in_flight = self.runner.launch(batch)
                break
            except Exception:
                failed = self.runner.request_errors(batch)
                if not failed:
                    raise  # not one request's fault (see the module docstring)
            for seq, err in failed:  # nothing ran yet: launch again without them
                batch.remove(seq)
                outputs.append(self._finish(seq, "error", error=_describe(err)))
            self.scheduler.drop_orphans(batch)
            if not batch.seqs:
                return None
        limit = self.config.max_model_len
        for seq, n, row in zip(batch.seqs, batch.num_new_tokens, in_flight.logit_rows):
            seq.num_computed_tokens += n
            if row < 0:
                continue  # mid-prompt: nothing sampled
            seq.token_ids.append(PLACEHOLDER)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= limit:
                self.scheduler.retire(seq)  # done whatever the token: never reschedule
        return batch, in_flight

    def _apply(self, batch: ScheduledBatch, in_flight: InFlight) -> list[EngineCoreOutput]:
        """Write a step's sampled tokens into their sequences and finish those that stop."""
        tokens = self.runner.collect(in_flight)
        now = time.perf_counter()
        outputs = self._prompt_logprobs(in_flight)
        for seq, token, row in zip(batch.seqs, tokens, in_flight.logit_rows):
            if seq.is_finished or token is None:
                continue  # ended while this step ran (its token is dropped), or mid-prompt
            try:
                outputs.append(self._apply_token(seq, token, now))
                if (k := seq.params.logprobs) is not None:
                    outputs[-1].new_logprobs = [in_flight.token_logprobs(row, token, k)]
            except Exception as err:  # e.g. its stop check: this request's problem alone
                outputs.append(self._finish(seq, "error", error=_describe(err)))
        return outputs

    def _prompt_logprobs(self, in_flight: InFlight) -> list[EngineCoreOutput]:
        """Reports of the prompt logprobs this step computed, each position once (a
        preempted request computes its prompt again)."""
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

    def _apply_token(self, seq: Sequence, token: int, now: float) -> EngineCoreOutput:
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
        stop = self._check_stop(seq, token, length)
        if stop is None:
            return EngineCoreOutput(seq.parent_id, [token], index=seq.index)
        del seq.token_ids[length:]
        return self._finish(seq, *stop, new_token_ids=[token])

    def _check_stop(self, seq: Sequence, token: int, length: int) -> tuple | None:
        """``(finish_reason, stop_reason)`` if ``seq`` ends at ``token``, its ``length``-th
        token; else None. EOS and stop tokens first, then stop strings, then length."""
        params = seq.params
        # Before min_tokens nothing stops it (EOS and stop ids are banned from sampling then).
        may_stop = length - seq.num_prompt_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if may_stop and token in params.stop_token_ids:
            return "stop", token
        if params.stop and self.tokenizer is not None:
            if seq.detokenizer is None:  # only requests with stop strings need text here
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.include_stop_str_in_output,
                    params.skip_special_tokens, params.min_tokens,
                )
            seq.detokenizer.push([token])
            if seq.detokenizer.stop_reason is not None:
                return "stop", seq.detokenizer.stop_reason
        if (
            length - seq.num_prompt_tokens >= params.max_tokens
            or length >= self.config.max_model_len
        ):
            return "length", None
        return None

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        stop_reason: int | str | None = None,
        error: str | None = None,
        new_token_ids: list[int] = (),
    ) -> EngineCoreOutput:
        """The one way a request ends: blocks freed, engine state dropped, final report."""
        if error is not None:
            logger.warning("request %r failed: %s", seq.request_id, error)
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        self.requests.pop(seq.request_id, None)
        while seq.token_ids[-1] == PLACEHOLDER:  # an in-flight token is dropped
            seq.token_ids.pop()
        return EngineCoreOutput(
            seq.parent_id, list(new_token_ids), reason, stop_reason, error, index=seq.index
        )

    def _record_step(self, batch: ScheduledBatch, decodes: list[bool], start: float) -> None:
        num_decodes, end = sum(decodes), time.perf_counter()
        sched, bm = self.scheduler, self.block_manager
        step = StepMetrics(
            self.stats.num_steps, start, end, len(batch), batch.num_tokens - num_decodes,
            num_decodes, len(sched.running), len(sched.waiting), bm.usage,
            sched.num_preemptions, bm.prefix_hit_rate,
        )
        self.stats.record(step)
        if self.timeline is not None:
            self.timeline.record(step.step, batch, decodes, start, end)

    # -- debugging -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The leak check (chapter 13): raise ``InvariantError`` naming the requests and
        blocks if the KV bookkeeping is inconsistent (``engine/invariants.py``)."""
        from nanovllm.engine.invariants import check_invariants

        check_invariants(self)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"

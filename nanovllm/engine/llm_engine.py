"""The step loop: schedule -> run the model -> apply the new tokens (chapters 00, 06, 11).

``add_request`` validates a request completely before it enters the engine, so bad input
raises ``ValueError`` and never disturbs the requests already inside. ``make_sequence``
(validation) reads only settings fixed at start-up, so other threads may call it; every
other method changes engine state and belongs to one thread at a time (see
``async_engine.py``, chapter 10). Each step is measured into ``stats``; set
``timeline = TimelineRecorder()`` to also record who ran what (``metrics.py``).
"""

from __future__ import annotations

import os
import time

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.metrics import EngineStats, TimelineRecorder
from nanovllm.engine.model_runner import InFlight, ModelRunner
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

MAX_DEFAULT_MODEL_LEN = 8192


def load_tokenizer(path: str):
    """The model folder's tokenizer, or None for a config-only folder (dummy weights)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        get_model_class(self.model_config.architecture)  # fail early on unsupported models
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
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Sequence] = {}
        self._in_flight: tuple[ScheduledBatch, InFlight] | None = None  # async scheduling
        self.stats = EngineStats()
        self.timeline: TimelineRecorder | None = None  # off by default: costs nothing

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, token_ids

    def make_sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate one request and wrap it in a Sequence (nothing enters the engine yet)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize(prompt)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {limit}; "
                "it must leave room for at least one new token"
            )
        longest = min(len(token_ids) + params.max_tokens, limit)
        capacity = self.block_manager.num_blocks * self.config.block_size
        if longest > capacity:
            raise ValueError(
                f"a request of up to {longest} tokens cannot fit in the KV cache "
                f"({capacity} tokens); raise the KV budget or lower max_tokens"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and longest > budget:
            # unchunked, a (re)computed prefill must fit one step, or it would wait forever
            raise ValueError(
                f"a request of up to {longest} tokens exceeds max_num_batched_tokens "
                f"({budget}) and chunked prefill is off; enable it or raise the budget"
            )
        return Sequence(token_ids, params, request_id, text)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request with reason "abort", freeing its KV blocks now; returns its
        sequence, or None if no such request is unfinished."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        self.runner.release(seq)
        while seq.token_ids[-1] == PLACEHOLDER:  # its in-flight token is dropped
            seq.token_ids.pop()
        return seq

    def has_unfinished(self) -> bool:
        if self.scheduler.has_unfinished():
            return True
        # A step in flight matters only if a sequence in it still waits for its token.
        return self._in_flight is not None and not all(
            s.is_finished for s in self._in_flight[0].seqs
        )

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that received tokens in it.

        With ``async_scheduling`` a step's tokens arrive one call later: this call queues
        step n on the GPU, then reads step n-1's tokens while the GPU computes, and the
        next call schedules step n+1 meanwhile. Step n's sequences hold a placeholder for
        their newest token until then; the GPU feeds the real one to step n+1 directly.
        """
        start = time.perf_counter()
        batch = self.scheduler.schedule(start)
        # A decode is one new token after the whole prompt; anything else is prefill work
        # (a prompt chunk, or recomputation after a preemption).
        decodes = [
            n == 1 and s.num_computed_tokens >= s.num_prompt_tokens
            for s, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        launched = self._launch(batch) if batch.seqs else None
        previous, self._in_flight = self._in_flight, launched
        updated = self._apply(*previous) if previous is not None else []
        if launched is not None and not self.config.async_scheduling:
            updated, self._in_flight = self._apply(*launched), None
        if batch.seqs:
            self._record_step(batch, decodes, start)
        return updated

    def _launch(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, InFlight]:
        in_flight = self.runner.launch(batch)
        limit = self.config.max_model_len
        for seq, n, row in zip(batch.seqs, batch.num_new_tokens, in_flight.logit_rows):
            seq.num_computed_tokens += n
            if row < 0:
                continue  # mid-prompt: nothing sampled
            seq.token_ids.append(PLACEHOLDER)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= limit:
                self.scheduler.retire(seq)  # done whatever the token: never reschedule
        return batch, in_flight

    def _apply(self, batch: ScheduledBatch, in_flight: InFlight) -> list[Sequence]:
        """Write a step's sampled tokens into their sequences and finish those that stop."""
        tokens = self.runner.collect(in_flight)
        now = time.perf_counter()
        updated = []
        for seq, token in zip(batch.seqs, tokens):
            if seq.is_finished:
                continue  # stopped (or aborted) while this step ran: its token is dropped
            if token is not None:
                # This step's token follows the ones delivered so far; with async
                # scheduling the next step's placeholder may already stand after it.
                length = seq.num_prompt_tokens + seq.metrics.num_output_tokens + 1
                seq.token_ids[length - 1] = token
            self.block_manager.cache_full_blocks(seq)
            if token is None:
                continue  # mid-prompt
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_output_tokens += 1
            reason = self._finish_reason(seq, token, length)
            if reason is not None:
                del seq.token_ids[length:]
                self.scheduler.finish(seq, reason)
                self.runner.release(seq)
                self.requests.pop(seq.request_id, None)
            updated.append(seq)
        return updated

    def _record_step(self, batch: ScheduledBatch, decodes: list[bool], start: float) -> None:
        end = time.perf_counter()
        num_decodes = sum(decodes)
        self.stats.record(self, len(batch), batch.num_tokens - num_decodes, num_decodes, start, end)
        if self.timeline is not None:
            self.timeline.record(self.stats.num_steps - 1, batch, decodes, start, end)

    def _finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Why ``seq`` stops at ``token``, its ``length``-th token, or None."""
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self.tokenizer is not None and self._hits_stop_string(seq, length):
            return "stop"
        if (
            length - seq.num_prompt_tokens >= params.max_tokens
            or length >= self.config.max_model_len
        ):
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence, length: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        # A stop string spans at most `longest` tokens; decode a little more for safety.
        start = max(seq.num_prompt_tokens, length - longest - 4)
        tail = self.tokenizer.decode(seq.token_ids[start:length])
        return any(s in tail for s in seq.params.stop)

    def output(self, seq: Sequence) -> RequestOutput:
        token_ids = seq.output_token_ids
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
        if seq.params.stop and seq.finish_reason == "stop":
            # like vLLM, the text ends before the first stop string (which is not returned)
            cuts = [text.index(s) for s in seq.params.stop if s in text]
            text = text[: min(cuts)] if cuts else text
        completion = CompletionOutput(0, text, token_ids, seq.finish_reason)
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            seq.token_ids[: seq.num_prompt_tokens],
            [completion],
            seq.is_finished,
            seq.metrics,
        )

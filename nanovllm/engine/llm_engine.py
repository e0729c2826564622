"""The step loop: schedule -> execute -> update (chapters 00, 06, 11).

``step()`` asks the scheduler for a ``SchedulerOutput``, has the model runner execute it and
hands the tokens to ``Scheduler.update_from_output``, the one function that advances a request;
it returns one ``EngineCoreOutput`` per request that progressed and measures itself into
``stats`` (and ``timeline``, if set: ``metrics.py``). ``make_sequence`` validates and may run
in any thread; every other method belongs to one thread at a time (chapter 10).

An error that is one request's (its ranking, its inputs or sampling settings, applying its
token) ends that request alone with finish_reason "error"; the step is re-launched without it,
as nothing ran yet. Anything else (forward pass, sampling kernels, CUDA, out of memory) may
leave the device unusable and propagates out of ``step()``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from nanovllm.config import EngineConfig
from nanovllm.distributed import check_divisible
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.invariants import check_invariants
from nanovllm.engine.metrics import EngineLoad, EngineStats, StepMetrics, TimelineRecorder
from nanovllm.engine.model_runner import InFlight, ModelRunner
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sliding_window import make_block_manager
from nanovllm.engine.spec_decode.speculator import Speculator
from nanovllm.engine.step import Unsampled
from nanovllm.engine.stop_checker import StopChecker
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenizer import load_tokenizer

MAX_DEFAULT_MODEL_LEN = 8192


def eos_token_ids(model_config: ModelConfig, tokenizer) -> set[int]:
    """The tokens that end a sequence: the model config's and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        get_model_class(self.model_config.architecture)  # fail early on unsupported models
        if config.tensor_parallel_size > 1:  # before any worker starts (chapter 09)
            mc = self.model_config
            check_divisible(mc.num_heads, mc.num_kv_heads, mc.intermediate_size,
                            config.tensor_parallel_size)
            spec = config.speculative_config
            if spec is not None and spec.method == "draft_model":  # sharded too (chapter 14)
                dc = ModelConfig.from_pretrained(spec.model)
                check_divisible(dc.num_heads, dc.num_kv_heads, dc.intermediate_size,
                                config.tensor_parallel_size, f"the draft model {spec.model}")
        if config.max_model_len is None:
            config.max_model_len = min(self.model_config.max_position_embeddings,
                                       MAX_DEFAULT_MODEL_LEN)
        if config.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.model_config.max_position_embeddings}")
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.runner = ModelRunner(config, self.model_config)
        self.runner.sampling_inputs.eos_token_ids = self.eos_token_ids  # for min_tokens
        self.block_manager = make_block_manager(  # frees out-of-window blocks (chapter 12)
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            self.model_config.sliding_window)
        stop_checker = StopChecker(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, stop_checker)
        self.input_processor = InputProcessor(config, self.model_config, self.tokenizer,
                                              self.eos_token_ids,
                                              self.block_manager.num_blocks * config.block_size)
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None  # async scheduling
        self.speculator: Speculator | None = None  # speculative decoding (chapter 14)
        if config.speculative_config is not None:
            try:
                config.speculative_config.check_model(self.model_config.num_layers)
                self.speculator = Speculator(config.speculative_config, self.runner,
                                             self.scheduler)
            except BaseException:  # a refused draft: stop the workers the runner started
                self.runner.shutdown()
                raise
        self.stats = EngineStats()
        self.timeline: TimelineRecorder | None = None  # off by default: costs nothing

    # -- requests ------------------------------------------------------------------------
    def make_sequence(self, prompt: object, params: SamplingParams, request_id: str | None = None,
                      priority: int = 0) -> Sequence:
        """Validate one request and wrap it in a Sequence (nothing enters the engine yet;
        any thread may call this: ``input_processor.py``)."""
        if self.speculator is not None:
            self.speculator.check_params(params)
        return self.input_processor.make_sequence(prompt, params, request_id, priority)

    def make_sequences(self, prompt: object, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> list[Sequence]:
        """``make_sequence`` for each of the request's ``params.n`` samples."""
        if self.speculator is not None:
            self.speculator.check_params(params)
        return self.input_processor.make_sequences(prompt, params, request_id, priority)

    @property
    def requests(self) -> dict[str, Sequence]:
        """Every unfinished sequence by request id (the scheduler's; read, don't write)."""
        return self.scheduler.requests

    def add_sequence(self, seq: Sequence) -> None:
        """Put a validated sequence into the scheduler's waiting queue. Its request id is
        claimed here (``RequestIds``: a user's id in use raises ``ValueError``, a generated
        one is given now) unless its request's id was claimed whole already."""
        self.input_processor.request_ids.claim([seq])
        self.scheduler.add(seq)

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """``add_sequence`` for every sample of one request, claimed together."""
        self.input_processor.request_ids.claim(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str | None, prompt: object, params: SamplingParams,
                    priority: int = 0) -> str:
        """Validate and queue one request (vLLM's signature); returns its id, generated
        when ``request_id`` is None. Its reports carry that id (and the sample's index)."""
        seqs = self.make_sequences(prompt, params, request_id, priority)
        self.add_sequences(seqs)
        return seqs[0].parent_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Finish requests with reason "abort", freeing their KV blocks now; returns the
        final report of each one that was still unfinished (unknown ids are ignored)."""
        return self.scheduler.finish_requests(request_ids, "abort")  # all n samples

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        """Raise if the engine cannot step: a tensor-parallel worker has exited (chapter 09)."""
        if self.runner.executor is not None:
            self.runner.executor.check_workers()

    def load(self) -> EngineLoad:
        """How busy the engine is now (the server's gauges read this)."""
        bm = self.block_manager
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage,
                          bm.prefix_hit_rate)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``BlockManager.reset_prefix_cache``); False, changing
        nothing, while requests are unfinished."""
        return not self.requests and self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Give the GPU memory back and stop the tensor-parallel workers (chapter 09)."""
        if self.speculator is not None:  # a draft model's weights and cache (chapter 14)
            self.speculator.release()
        self.runner.shutdown()

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step: schedule, execute, update; a report for each request that got
        tokens or ended. With ``async_scheduling`` a step's tokens arrive one call later: this
        call queues step n, then reads step n-1's tokens while the GPU computes. Until then step
        n's sequences hold a placeholder (never reported); the GPU feeds the real token to step
        n+1 directly.

        A step with a constrained request (chapter 15) stays in the pipeline, but its mask needs
        the step in flight's tokens on the host: its sampling waits until they land
        (``_execute_constrained``); a step with none takes the path above unchanged. With
        speculative decoding (chapter 14) a step in which a request decodes proposes, verifies
        and accepts at once; only steps of prompts alone stay in flight."""
        start = time.perf_counter()
        landed = self._land_before_speculating()
        scheduler_output = self.scheduler.schedule(start)
        if self._in_flight is not None and _constrained(scheduler_output):
            outputs = self._execute_constrained(scheduler_output)
        else:
            model_output = self._execute(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if scheduler_output.seqs:
            self._record_step(scheduler_output, start)
        return landed + outputs

    def _land_before_speculating(self) -> list[EngineCoreOutput]:
        """With speculation and async scheduling: land the step in flight before scheduling,
        since the next step's proposals continue the tokens it sampled (chapter 14 §5). Only
        steps in which no request decodes (prompts alone) are left in flight by ``_execute``."""
        if self.speculator is None or self._in_flight is None:
            return []
        return self.scheduler.update_from_output(SchedulerOutput([], []), self._land())

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch the step; return the tokens of the step that is done: this one, or with
        async scheduling the previous one (None if there is none)."""
        self.runner.forget(scheduler_output.finished_seq_ids)
        if self.speculator is not None and self._speculates(scheduler_output):
            return self.speculator.execute(scheduler_output)  # synchronous (chapter 14)
        launched = self._launch(scheduler_output)
        previous = self._in_flight
        self._in_flight = (scheduler_output, launched) if launched is not None else None
        if not self.config.async_scheduling:
            return self._land()
        return None if previous is None else self._collect(*previous)

    def _speculates(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the speculator runs this step: one in which a request decodes, or any step
        without async scheduling or with a draft model, whose cache follows every step."""
        return bool(scheduler_output.seqs) and (
            scheduler_output.num_decodes > 0 or not self.config.async_scheduling
            or self.speculator.follows_target)

    def _execute_constrained(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Async scheduling with a constrained request (``structured_output/masks.py`` says
        why): queue the step's forward pass, land the step in flight and advance the matchers
        with its tokens while the device computes, then fill the masks and queue sampling."""
        self.runner.forget(scheduler_output.finished_seq_ids)
        launched = self._launch(scheduler_output, defer_sampling=True)
        outputs = self.scheduler.update_from_output(scheduler_output, self._land())
        if launched is not None:
            self._in_flight = (scheduler_output, self.runner.sample(launched))
        return outputs

    def _land(self) -> ModelRunnerOutput | None:
        """Wait for the step in flight and take its tokens (None if there is none)."""
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else self._collect(*previous)

    def _collect(self, step: SchedulerOutput, in_flight: InFlight) -> ModelRunnerOutput:
        return ModelRunnerOutput(step, self.runner.collect(in_flight), in_flight)

    def _launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False
                ) -> InFlight | Unsampled | None:
        """Queue the step on the device. A request whose own inputs fail to prepare ends
        alone (nothing ran yet) and the step is launched again without it."""
        deferred = {"defer_sampling": True} if defer_sampling else {}  # (else the plain call)
        while scheduler_output.seqs:
            try:
                return self.runner.launch(scheduler_output, **deferred)
            except Exception:
                failed = self.runner.request_errors(scheduler_output)
                if not failed:
                    raise  # not one request's fault (see the module docstring)
            self.scheduler.fail(scheduler_output, failed)
        return None

    def _record_step(self, batch: SchedulerOutput, start: float) -> None:
        num_decodes, end = batch.num_decodes, time.perf_counter()
        sched, bm = self.scheduler, self.block_manager
        spec = {} if self.speculator is None else self.speculator.last_step.step_fields()
        step = StepMetrics(
            self.stats.num_steps, start, end, len(batch), batch.num_tokens - num_decodes,
            num_decodes, len(sched.running), len(sched.waiting), bm.usage,
            sched.num_preemptions, bm.prefix_hit_rate, **spec)
        self.stats.record(step)
        if self.timeline is not None:
            self.timeline.record(step.step, batch, start, end)

    # -- debugging -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The leak check (chapter 13): raise ``InvariantError`` naming the requests and
        blocks if the KV bookkeeping is inconsistent (``engine/invariants.py``)."""
        check_invariants(self)


def _constrained(step: SchedulerOutput) -> bool:
    """Whether a sequence of ``step`` has a structured-output matcher (chapter 15)."""
    return any(seq.grammar is not None for seq in step.seqs)

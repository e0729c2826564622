"""The front end's handle on an engine core in another process (chapter 10 §8; vLLM v1's
``EngineCoreClient``).

``EngineCoreClient(config)`` starts ``core_proc.py``'s loop in a child process and then
stands in for the ``LLMEngine`` that ``AsyncEngine`` drives: the same ``make_sequences``
(validation runs here, in the caller's thread, with the core's KV capacity), ``add_sequences``,
``abort_request``, ``step``, ``has_unfinished_requests``, ``stats``, ``load``, ``check_health``
and ``shutdown``.
Only ``step`` differs in spirit: it does not run a step, it collects what the core's free-running
loop has finished since the last call (waiting at most ``poll_interval`` seconds), so
the front end's thread never holds the core back.

    engine = AsyncEngine(EngineCoreClient(EngineConfig.from_kwargs(path)))
    # or: AsyncEngine.from_model(path, engine_process=True)

If the core process dies (killed, out of memory) or its engine fails, ``step`` raises
``EngineCoreDied`` and ``AsyncEngine`` ends every open stream with an ``EngineError``.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import multiprocessing

import torch

from nanovllm.config import EngineConfig
from nanovllm.engine.core_proc import CoreInfo, decode, run_engine_core
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.llm_engine import eos_token_ids
from nanovllm.engine.metrics import EngineLoad, EngineStats
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.models import ModelConfig
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenizer import load_tokenizer

SHUTDOWN_TIMEOUT_S = 30.0


class EngineCoreDied(RuntimeError):
    """The engine-core process has exited, or its engine failed."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, poll_interval: float = 0.002) -> None:
        self.config, self.poll_interval = config, poll_interval
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.tokenizer = load_tokenizer(config.model)
        context = multiprocessing.get_context("spawn")  # CUDA cannot live through a fork
        core_commands, self._commands = context.Pipe(duplex=False)
        self._results, core_results = context.Pipe(duplex=False)
        # not a daemon: the core starts tensor-parallel workers of its own (chapter 09)
        # the core computes with as many CPU threads as torch has here (tests set one)
        self.process = context.Process(target=run_engine_core, name="nanovllm-engine-core",
                                       args=(config, core_commands, core_results,
                                             torch.get_num_threads()))
        self.process.start()
        core_commands.close(), core_results.close()
        atexit.register(self.shutdown)  # (before multiprocessing waits for its children)
        self._closed = False
        message = self._recv()
        if message[0] == "failed":  # e.g. max_model_len beyond the model's: a ValueError
            self.shutdown()
            kind, detail = message[1], message[2]
            raise (ValueError if kind == "ValueError" else EngineCoreDied)(detail)
        info: CoreInfo = message[1]
        config.max_model_len = info.max_model_len
        self.input_processor = InputProcessor(
            config, self.model_config, self.tokenizer,
            eos_token_ids(self.model_config, self.tokenizer), info.kv_capacity)
        self.stats = EngineStats()  # the core's steps, as they are reported
        self._pending: list[list[Sequence]] = []  # requests not yet sent
        self._samples_left: dict[str, int] = {}  # unfinished samples per request id
        self._metrics: dict = {}  # each unfinished request's RequestMetrics, by id
        self._early: list[EngineCoreOutput] = []  # read while waiting for an abort's answer
        self._tokens = itertools.count()
        self._load = EngineLoad(0, 0, 0.0, 0.0)  # as of the core's latest message

    # -- what AsyncEngine calls ----------------------------------------------------------
    def make_sequences(self, prompt: object, params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> list[Sequence]:
        """Validate here, against the core's limits (``InputProcessor``)."""
        return self.input_processor.make_sequences(prompt, params, request_id, priority)

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue one request's samples; they travel with the next ``step`` (one message)."""
        for seq in seqs:  # (a structured-output matcher does not travel: the core makes its own)
            seq.grammar = None
        self._pending.append(seqs)
        self._samples_left[seqs[0].parent_id] = len(seqs)
        self._metrics[seqs[0].parent_id] = seqs[0].metrics

    def has_unfinished_requests(self) -> bool:
        return bool(self._samples_left)

    def step(self) -> list[EngineCoreOutput]:
        """Send the queued requests; return every output the core has reported since the
        last call, waiting up to ``poll_interval`` seconds for the first."""
        self._flush()
        outputs, self._early = self._early, []
        if self._results.poll(0 if outputs else self.poll_interval):
            while True:
                self._handle(self._recv(), outputs)
                if not self._results.poll(0):
                    break
        return outputs

    def abort_request(self, request_ids: str | list[str]) -> list[EngineCoreOutput]:
        """Abort at the core's next step boundary and wait for its answer. Returns the
        outputs read meanwhile too (in order), so that no report is lost or reordered."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._flush()
        token = next(self._tokens)
        self._send(("abort", request_ids, token))
        outputs, self._early = self._early, []
        while self._handle(self._recv(), outputs) != token:
            pass
        return outputs

    def check_health(self) -> None:
        """Raise ``EngineCoreDied`` if the core process has exited."""
        if not self.process.is_alive():
            raise self._died()

    def load(self) -> EngineLoad:
        """The core's load as of its latest message (a step, or an abort's answer)."""
        return self._load

    def shutdown(self) -> None:
        """Stop the core process (its engine gives the GPU back); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.process.is_alive():
            try:
                self._commands.send(("shutdown",))
            except OSError:
                pass
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._commands.close(), self._results.close()

    # -- the wire ------------------------------------------------------------------------
    def _flush(self) -> None:
        if self._pending:
            self._send(("add", self._pending))
            self._pending = []

    def _send(self, message: tuple) -> None:
        try:
            self._commands.send(message)
        except OSError:
            raise self._died() from None

    def _recv(self) -> tuple:
        try:
            return self._results.recv()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> EngineCoreDied:
        self.process.join(5)
        return EngineCoreDied(f"the engine-core process exited (status {self.process.exitcode})")

    def _handle(self, message: tuple, outputs: list[EngineCoreOutput]) -> int | None:
        """Apply one message from the core; returns an abort's token once it is answered."""
        kind = message[0]
        if kind == "failed":
            raise EngineCoreDied(f"the engine core failed: {message[2]}")
        for wire in message[2] if kind == "aborted" else message[1]:
            out, metrics = decode(wire)
            if out.finished:
                self._finish_sample(out.request_id, metrics)
            outputs.append(out)
        self._load = message[3]
        if kind == "step":
            for step in message[2]:
                self.stats.record(step)
            return None
        return message[1]

    def _finish_sample(self, request_id: str, metrics) -> None:
        mine = self._metrics.get(request_id)
        if metrics is not None and mine is not None:  # the core's clock readings
            for f in dataclasses.fields(metrics):
                setattr(mine, f.name, getattr(metrics, f.name))
        left = self._samples_left.get(request_id, 1) - 1
        if left > 0:
            self._samples_left[request_id] = left
        else:
            self._samples_left.pop(request_id, None)
            self._metrics.pop(request_id, None)

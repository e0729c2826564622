"""The engine core in its own process: a loop that steps the engine without waiting for
the front end (chapter 10 §8; vLLM v1's ``EngineCoreProc``).

In one process, the engine's step loop and the server's event loop take turns on one GIL: at
a high request rate, HTTP parsing, JSON and server-sent events delay every step. Here the
``LLMEngine`` runs alone in a child process (``spawn``: CUDA cannot be forked). It reads
commands from one pipe and writes one message per step to another; the front end
(``core_client.py``) validates, tokenizes, detokenizes and streams in the parent.

The wire (pickled tuples, one message per step or command, never one per token):

    parent -> core   ("add", [[Sequence, ...] per request])   the samples of new requests
                     ("abort", [request ids], token)          answered by "aborted"
                     ("shutdown",)                            the core exits with status 0
    core -> parent   ("ready", CoreInfo)                      once the engine is built
                     ("step", outs, [StepMetrics], load)      after every step
                     ("aborted", token, outs, load)           the aborted requests' last reports
                     ("failed", kind, message)                the engine broke; exits with 1

``outs`` is a list of ``encode``d ``EngineCoreOutput``s: plain tuples, with the request's
``RequestMetrics`` attached to a finished one (the parent's copy never sees the core's clock
readings otherwise); ``load`` is the engine's ``EngineLoad`` as the message leaves. The core
exits when its parent dies (it checks while idle), and ignores Ctrl-C: the front end drains.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

from nanovllm.config import EngineConfig
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.outputs import RequestMetrics

IDLE_POLL_S = 0.5  # how often an idle core checks that its parent still lives


class CoreInfo(NamedTuple):
    """What the front end needs from the built engine to validate requests itself."""

    max_model_len: int
    kv_capacity: int  # tokens the KV cache holds
    num_kv_blocks: int


def encode(out: EngineCoreOutput, metrics: RequestMetrics | None = None) -> tuple:
    return (out.request_id, out.new_token_ids, out.finish_reason, out.stop_reason, out.error,
            out.index, out.new_logprobs, out.new_prompt_logprobs, metrics)


def decode(wire: tuple) -> tuple[EngineCoreOutput, RequestMetrics | None]:
    return EngineCoreOutput(*wire[:8]), wire[8]


class EngineCoreProc:
    """The child's side: owns the ``LLMEngine`` and the two pipe ends."""

    def __init__(self, config: EngineConfig, commands: Connection, results: Connection) -> None:
        from nanovllm.engine.llm_engine import LLMEngine  # (imported in the child only)

        self.commands, self.results = commands, results
        self.parent = os.getppid()
        self.engine = LLMEngine(config)
        # the unfinished requests' metrics, and how many of their samples still run, by id
        self.metrics: dict[str, RequestMetrics] = {}
        self.samples_left: dict[str, int] = {}
        self.reported_steps = 0  # StepMetrics sent so far

    def run(self) -> None:
        engine = self.engine
        info = CoreInfo(engine.config.max_model_len, engine.input_processor.kv_capacity,
                        engine.block_manager.num_blocks)
        self.results.send(("ready", info))
        while True:
            busy = engine.has_unfinished_requests()
            if self.commands.poll(0 if busy else IDLE_POLL_S):
                while True:  # every command waiting, before the next step
                    if not self.apply(self.commands.recv()):
                        return
                    if not self.commands.poll(0):
                        break
            elif not busy and os.getppid() != self.parent:
                return  # the front end is gone: nobody will read what we make
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self.results.send(("step", self.encode_all(outputs), self.new_steps(),
                                   engine.load()))

    def apply(self, command: tuple) -> bool:
        """One command from the front end; False to stop."""
        kind = command[0]
        if kind == "add":
            for seqs in command[1]:
                for seq in seqs:  # matchers (chapter 15) are made here, not pickled
                    seq.grammar = self.engine.input_processor.grammar_state(seq.params)
                self.metrics[seqs[0].parent_id] = seqs[0].metrics
                self.samples_left[seqs[0].parent_id] = len(seqs)
                self.engine.add_sequences(seqs)
        elif kind == "abort":
            outputs = self.engine.abort_request(command[1])
            self.results.send(("aborted", command[2], self.encode_all(outputs),
                               self.engine.load()))
        else:  # "shutdown"
            return False
        return True

    def encode_all(self, outputs: list[EngineCoreOutput]) -> list[tuple]:
        wire = []
        for out in outputs:
            metrics = None
            if out.finished:  # the request's metrics travel with each sample's last report
                rid = out.request_id
                metrics = self.metrics.get(rid)
                self.samples_left[rid] = self.samples_left.get(rid, 1) - 1
                if self.samples_left[rid] <= 0:
                    self.metrics.pop(rid, None)
                    del self.samples_left[rid]
            wire.append(encode(out, metrics))
        return wire

    def new_steps(self) -> list:
        stats = self.engine.stats
        count = min(stats.num_steps - self.reported_steps, len(stats.steps))
        self.reported_steps = stats.num_steps
        return list(stats.steps)[-count:] if count else []


def run_engine_core(config: EngineConfig, commands: Connection, results: Connection,
                    num_threads: int) -> None:
    """The child process's entry point (``multiprocessing`` target); ``num_threads`` is the
    parent's torch CPU thread count, kept here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's: it drains first
    core = None
    try:
        import torch

        torch.set_num_threads(num_threads)
        core = EngineCoreProc(config, commands, results)
        core.run()
    except BaseException as exc:  # the parent turns this into an error for every request
        detail = "".join(traceback.format_exception(exc))
        if core is None and isinstance(exc, ValueError):  # a bad option: its message says it
            detail = ""
        try:
            kind = "ValueError" if isinstance(exc, ValueError) else type(exc).__name__
            results.send(("failed", kind, f"{type(exc).__name__}: {exc}\n{detail}".rstrip()))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if core is not None:
            core.engine.shutdown()

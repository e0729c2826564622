"""Producer/consumer serving core: requests in through a queue, tokens out through
per-request streams (chapter 10; the scheduling it relies on is chapter 06).

    engine = AsyncEngine.from_model(path)
    stream = engine.submit("Hello", SamplingParams(max_tokens=16))   # from any thread
    for chunk in stream:                                              # blocking iteration
        print(chunk.text, end="")
    out = engine.submit("Hi").result(timeout=30)                      # or just the result
    async for chunk in engine.stream("Hello"): ...                    # asyncio
    out = await engine.generate("Hello")
    engine.shutdown()

One *engine thread* owns the ``LLMEngine`` (chapter 10 §1) -- or an ``EngineCoreClient``,
whose ``step()`` collects what an engine core in its own process has computed
(``core_client.py``, chapter 10 §8): it applies the commands in the
inbox (add, abort), runs ``step()`` while there is work, hands each request's deltas to its
stream, and sleeps on a condition variable otherwise. Producers (any thread) call ``submit``,
which validates in the caller's thread (``ValueError`` raises there) and claims the request
id; ``abort`` and ``shutdown`` wait until the engine thread has done them, at a step boundary.
One consumer reads each ``RequestStream`` (``stream.py``), detokenizing in its own thread
(the shared ``Tokenizer`` serializes its calls); a request's n samples share one stream.
Every stream ends: "stop"/"length", "abort", "error" (that request alone), or ``EngineError``
when a step fails for everyone (the engine is then dead: ``llm_engine.py``). While this runs
an ``LLMEngine``, nothing else may call that engine; reading its ``stats`` is fine.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import TYPE_CHECKING, Any

from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.output_processor import EngineCoreOutput, OutputProcessor
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stream import AsyncRequestStream, LoopBridge, RequestStream
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.engine.core_client import EngineCoreClient


HEALTH_CHECK_S = 1.0  # how often an idle engine thread checks the engine (check_health)


class EngineError(RuntimeError):
    """The engine cannot serve the request: a step failed (see ``__cause__``) or it is shut down."""


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine | EngineCoreClient) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        # guarded by _lock: commands for the engine thread, and the streams not yet ended
        self._inbox: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._refusal: EngineError | None = None  # set once no more requests are taken
        self._stop: str | None = None  # None, "drain" (finish all) or "abort"
        self._closed = False  # the engine thread has stopped reading the inbox
        self._request_ids = engine.input_processor.request_ids  # thread-safe
        self._bridges: dict[asyncio.AbstractEventLoop, LoopBridge] = {}  # (under _lock)
        # the engine thread's: the requests it has added, and what they have produced
        self._outputs = OutputProcessor(engine.tokenizer, self._request_ids)
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, engine_process: bool = False, **options: Any) -> AsyncEngine:
        """Build the engine for a model folder; ``options`` are ``EngineConfig`` fields. With
        ``engine_process`` the engine core runs in a process of its own (``core_client.py``)."""
        config = EngineConfig.from_kwargs(str(model), **options)
        if engine_process:
            from nanovllm.engine.core_client import EngineCoreClient

            return cls(EngineCoreClient(config))
        return cls(LLMEngine(config))

    # -- producers -----------------------------------------------------------------------
    def submit(self, prompt: Any, params: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; returns its stream at once. Raises ``ValueError`` (bad input)
        or ``EngineError`` (shut down or failed) in the calling thread."""
        return self._submit(prompt, params, request_id, priority, None)

    def _submit(self, prompt, params, request_id, priority, sink) -> RequestStream:
        params = SamplingParams() if params is None else params
        # one sequence per sample (SamplingParams.n); they report under the request's id
        seqs: list[Sequence] = self.engine.make_sequences(prompt, params, request_id, priority)
        with self._lock:
            if self._refusal is not None:
                raise self._refusal
            # held until the stream's last item (OutputProcessor); raises if a user's id is in use
            request_id = self._request_ids.claim(seqs, held=True)
            stream = RequestStream(request_id, self.engine.tokenizer, params)
            if sink is not None:
                stream.sink = sink
            self._streams[request_id] = stream
            self._inbox.append(("add", seqs, stream))
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str, wait: bool = True) -> bool:
        """Abort a request: its stream ends with finish_reason "abort" and its KV blocks are
        freed at the next step boundary. With ``wait`` this returns after that has happened,
        True if the request was aborted (False: unknown, or it finished first)."""
        done, aborted = threading.Event(), []
        with self._lock:
            if request_id not in self._streams or self._closed:
                return False
            self._inbox.append(("abort", request_id, done, aborted))
            self._wakeup.notify()
        if not wait or threading.current_thread() is self._thread:
            return True
        done.wait()
        return bool(aborted)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests and stop the engine thread. ``wait=True`` lets every pending
        request finish first; ``wait=False`` aborts them (finish_reason "abort") at the next
        step boundary. Either way every stream has ended when this returns (unless
        ``timeout`` seconds pass first), and once the engine thread has stopped, the
        ``LLMEngine`` gives its GPU memory back (``LLMEngine.shutdown``)."""
        with self._lock:
            self._refusal = self._refusal or EngineError("the engine is shut down")
            self._stop = "abort" if not wait or self._stop == "abort" else "drain"
            self._wakeup.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.engine.shutdown()

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.shutdown(wait=exc_type is None)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # -- asyncio -------------------------------------------------------------------------
    def stream(self, prompt: Any, params: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0) -> AsyncRequestStream:
        """Submit now (errors raise here) and return an async iterable of chunks; call it
        from a coroutine: ``async for chunk in engine.stream(prompt, params): ...``."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        with self._lock:
            bridge = self._bridges.get(loop)
            if bridge is None:
                bridge = self._bridges[loop] = LoopBridge(loop)
                self._bridges = {k: b for k, b in self._bridges.items() if not k.is_closed()}
        sink = functools.partial(bridge.put, items)  # flushed by the engine thread
        stream = self._submit(prompt, params, request_id, priority, sink)
        return AsyncRequestStream(stream, items, lambda rid: self.abort(rid, wait=False))

    async def generate(self, prompt: Any, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> RequestOutput:
        """The final output of one request, awaited without blocking the event loop."""
        async for chunk in self.stream(prompt, params, request_id, priority):
            if chunk.finished:
                return chunk.output
        raise AssertionError("a stream always ends with a finished chunk")

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        busy = self.engine.has_unfinished_requests
        try:
            idle = False
            while True:
                with self._lock:
                    while not (self._inbox or self._stop or busy()):
                        if not self._wakeup.wait(HEALTH_CHECK_S):
                            self.engine.check_health()  # idle: is it still able to step?
                    if idle and not self._inbox and not self._stop:
                        self._wakeup.wait(0.01)  # nothing could be scheduled: don't spin
                    commands, self._inbox = self._inbox, []
                    stop = self._stop
                for command in commands:
                    self._apply(command)
                if stop == "abort" or (stop == "drain" and not busy()):
                    self._publish(self.engine.abort_request(list(self._outputs.states)))
                    break
                if busy():
                    steps = self.engine.stats.num_steps
                    outputs = self.engine.step()
                    self._publish(outputs)
                    # idle: the step neither ran anything nor delivered anything
                    idle = not outputs and self.engine.stats.num_steps == steps
        except BaseException as exc:  # a failed step must not leave any stream hanging
            self._fail_all(exc)
        finally:
            self._close_inbox()

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, seqs, stream = command
            self._outputs.add_request(seqs, stream)  # (its id was claimed in submit)
            self.engine.add_sequences(seqs)
        else:
            _, request_id, done, aborted = command
            outputs = self.engine.abort_request(request_id)
            self._publish(outputs)
            aborted.append(any(o.finish_reason == "abort" and o.request_id == request_id
                               for o in outputs))
            done.set()

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand each request's new tokens to its stream; a finished request ends it."""
        for state, out, finished in self._outputs.process_outputs(outputs):
            stream, index, logprobs = state.stream, out.index, out.new_logprobs
            ids = out.new_token_ids
            if finished:
                with self._lock:  # (its id is free: a new request may have taken it already)
                    if self._streams.get(state.request_id) is stream:
                        del self._streams[state.request_id]
                stream.end(ids, state.output(), index=index, logprobs=logprobs)
            elif out.finished:  # one sample has ended, others go on
                stream.push(ids, index, logprobs, state.output().outputs[index])
            else:
                stream.push(ids, index, logprobs)
        self._flush()

    def _flush(self) -> None:
        """Wake each event loop once for everything this step delivered to it."""
        with self._lock:
            bridges = list(self._bridges.values())
        for bridge in bridges:
            bridge.flush()

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineError(f"engine step failed: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._refusal = error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._request_ids.release(stream.request_id)
            stream.end(error=error)
        self._flush()

    def _close_inbox(self) -> None:
        """Release whoever still waits on a command the loop will never read."""
        with self._lock:
            self._closed = True
            self._refusal = self._refusal or EngineError("the engine is shut down")
            commands, self._inbox = self._inbox, []
        for command in commands:
            if command[0] == "abort":
                command[2].set()


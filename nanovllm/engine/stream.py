"""The stream transport: how a request's tokens travel from the engine thread to the
thread (or asyncio task) that reads them (chapter 10).

The engine thread sends ``Item``s through a queue; the reader turns them into ``StreamChunk``s,
detokenizing in its own thread so that the step loop stays lean.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, NamedTuple

from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.outputs import (
    CompletionOutput,
    RequestOutput,
    StreamChunk,
    TokenLogprobs,
    position_logprobs,
)
from nanovllm.sampling_params import SamplingParams


class Item(NamedTuple):
    """What the engine thread sends a stream: one sample's new tokens, and how it ended."""

    token_ids: list[int]
    index: int = 0  # which sample
    logprobs: list[TokenLogprobs] | None = None  # one per token, with SamplingParams.logprobs
    completion: CompletionOutput | None = None  # the sample's final output, once it ended
    output: RequestOutput | None = None  # the request's final output: the last item
    error: BaseException | None = None  # the engine failed: the last item


class RequestStream:
    """One request's output: iterate it for ``StreamChunk``s, or call ``result()``. The engine
    thread calls ``push``/``end``; one consumer reads, in order, through a ``SimpleQueue`` (or,
    via ``sink``, an asyncio queue)."""

    def __init__(self, request_id: str, tokenizer: Any, params: SamplingParams) -> None:
        self.request_id = request_id
        self._items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self.sink: Callable[[Item], None] = self._items.put  # the asyncio bridge replaces it
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._tokenizer = tokenizer
        # one per sample
        self._detokenizers = [IncrementalDetokenizer.for_params(tokenizer, params)
                              for _ in range(params.n)]
        self._read_to_end = False  # a second iteration then ends at once instead of blocking

    # -- engine-thread side ------------------------------------------------------------
    def push(self, token_ids: list[int], index: int = 0,
             logprobs: list[TokenLogprobs] | None = None,
             completion: CompletionOutput | None = None) -> None:
        """New tokens of sample ``index``; with ``completion``, that sample has ended."""
        self.sink(Item(token_ids, index, logprobs, completion))

    def end(self, token_ids: Iterable[int] = (), output: RequestOutput | None = None,
            error: BaseException | None = None, index: int = 0,
            logprobs: list[TokenLogprobs] | None = None) -> None:
        """The request has ended: the last tokens (of sample ``index``) and its ``output``,
        or the ``error`` that stopped the engine."""
        self._output, self._error = output, error  # set before waking anyone up
        self._done.set()
        self.sink(Item(list(token_ids), index, logprobs, None, output, error))

    # -- consumer side -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (finish_reason "stop", "length", "abort", or "error" with the
        reason in ``error``); raises ``EngineError`` if the engine failed, ``TimeoutError``
        after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} unfinished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._output

    def to_chunk(self, item: Item) -> StreamChunk:
        self._read_to_end = item.output is not None or item.error is not None
        if item.error is not None:
            raise item.error
        token_ids, index = item.token_ids, item.index
        logprobs = None
        if item.logprobs is not None:
            logprobs = [position_logprobs(e, self._tokenizer) for e in item.logprobs]
        detokenizer = self._detokenizers[index]
        completion = item.completion
        if completion is None and item.output is not None:
            completion = item.output.outputs[index]
        if completion is None:
            text = detokenizer.push(token_ids)
            return StreamChunk(self.request_id, token_ids, text, index=index, logprobs=logprobs)
        text = detokenizer.finish(completion.text)  # the final text is cut at a stop string
        return StreamChunk(self.request_id, token_ids, text, item.output is not None,
                           completion.finish_reason, item.output, index, logprobs,
                           completion.stop_reason)

    def __iter__(self) -> Iterator[StreamChunk]:
        while not self._read_to_end:
            yield self.to_chunk(self._items.get())


class LoopBridge:
    """Hands items from the engine thread to the asyncio queues of one event loop: ``put``
    collects, ``flush`` delivers them all with one wake-up of the loop -- one per engine step,
    not one per token of every request (a thread-safe call costs a write to the loop's
    self-pipe and a pass of the loop). Only the engine thread calls ``put`` and ``flush``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, Item]] = []

    def put(self, items: asyncio.Queue, item: Item) -> None:
        self._pending.append((items, item))

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            self.loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


def _deliver(batch: list[tuple[asyncio.Queue, Item]]) -> None:
    for items, item in batch:
        items.put_nowait(item)


def coalesce(items: list[Item]) -> list[Item]:
    """Merge runs of plain items (tokens only) of the same sample: a reader that fell behind
    by several steps catches up with one chunk -- one detokenization, one event -- instead of
    one per token. Items that end a sample or the request stay as they are."""
    merged: list[Item] = []
    for item in items:
        last = merged[-1] if merged else None
        plain = item.completion is None and item.output is None and item.error is None
        if (plain and last is not None and last.index == item.index and last.completion is None
                and last.output is None and last.error is None):
            logprobs = None if last.logprobs is None else last.logprobs + (item.logprobs or [])
            merged[-1] = last._replace(token_ids=last.token_ids + item.token_ids,
                                       logprobs=logprobs)
        else:
            merged.append(item)
    return merged


class AsyncRequestStream:
    """A ``RequestStream`` read through asyncio (``async for``); leaving the loop early
    (a ``break``, a cancelled task) calls ``abort`` with the request's id. Whatever has
    arrived by the time the reader asks is read at once (``coalesce``)."""

    def __init__(self, stream: RequestStream, items: asyncio.Queue,
                 abort: Callable[[str], Any]) -> None:
        self.stream, self._items, self._abort = stream, items, abort
        self.request_id = stream.request_id

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        finished = False
        try:
            while not finished:
                batch = [await self._items.get()]
                while not self._items.empty():
                    batch.append(self._items.get_nowait())
                for item in coalesce(batch):
                    chunk = self.stream.to_chunk(item)
                    finished = chunk.finished
                    yield chunk
        finally:
            if not finished and not self.stream.done:
                self._abort(self.request_id)  # nobody is listening any more

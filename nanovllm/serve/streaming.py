"""Server-sent events: how tokens leave the server while they are generated (chapter 10).

SSE is plain HTTP: a response with ``Content-Type: text/event-stream`` whose body is a
sequence of events, each ``data: <json>`` and a blank line, ending with ``data: [DONE]``
(OpenAI's convention). ``merge`` interleaves the streams of a request's prompts (a
completions request may carry several) in the order their chunks arrive; ``sse_events``
turns chunks into events through a ``Formatter`` (completions or chat, ``formats.py``).

Leaving early -- the client disconnected and Starlette cancelled the response, or the
server gave up -- closes every engine stream, and a stream closed before its end aborts its
request, so the engine frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from starlette.responses import StreamingResponse

from nanovllm.engine.async_engine import AsyncRequestStream
from nanovllm.outputs import RequestOutput, StreamChunk
from nanovllm.serve.errors import APIError

logger = logging.getLogger("nanovllm.serve")
DONE = "data: [DONE]\n\n"
_END = object()


def failure(output: RequestOutput | None) -> str:
    """What to tell a client whose request ended with finish_reason "error"."""
    return (output.error if output is not None else None) or "the request failed"


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def merge(streams: list[AsyncRequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """``(which stream, chunk)`` pairs from all ``streams`` as they arrive."""
    if len(streams) == 1:  # the usual case: no tasks needed
        async with aclosing(streams[0].__aiter__()) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncRequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        except Exception as err:  # handed to the consumer (cancellation is not)
            queue.put_nowait((i, err))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:  # a stream cancelled before its end aborts its request
            task.cancel()


class Formatter(Protocol):
    """Turns a request's chunks into events carrying OpenAI's chunk objects (``formats.py``)."""

    def prelude(self) -> list[str]: ...
    def chunk(self, choice: int, chunk: StreamChunk, usage: dict | None) -> str | None: ...
    def usage_chunk(self, usage: dict) -> str: ...


class StreamTally:
    """What a request's stream has produced so far: tokens per choice, final outputs."""

    def __init__(self, num_prompts: int, n: int, prompt_tokens: int) -> None:
        self.n, self.prompt_tokens = n, prompt_tokens
        self.closed = False  # the request's resources are released
        self.generated = [0] * (num_prompts * n)
        self.outputs: list[RequestOutput | None] = [None] * num_prompts

    def add(self, prompt: int, chunk: StreamChunk) -> int:
        """Count ``chunk``; return its choice index (prompt-major, as OpenAI numbers them)."""
        choice = prompt * self.n + chunk.index
        self.generated[choice] += len(chunk.token_ids)
        if chunk.finished:
            self.outputs[prompt] = chunk.output
        return choice

    def usage(self) -> dict:
        completion = sum(self.generated)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


async def sse_events(
    streams: list[AsyncRequestStream],
    formatter: Formatter,
    tally: StreamTally,
    include_usage: bool,
    continuous_usage: bool,
    on_end: Callable[[], None],
) -> AsyncIterator[str]:
    """The whole event stream of one request. Errors after the response has begun are
    sent as an error event (the status line is long gone), then ``[DONE]``."""
    try:
        for event in formatter.prelude():
            yield event
        async with aclosing(merge(streams)) as chunks:
            async for prompt, chunk in chunks:
                choice = tally.add(prompt, chunk)
                if chunk.finish_reason == "error":
                    raise APIError(500, failure(chunk.output), "request_failed")
                usage = tally.usage() if continuous_usage else None
                event = formatter.chunk(choice, chunk, usage)
                if event is not None:
                    yield event
        if include_usage:
            yield formatter.usage_chunk(tally.usage())
    except APIError as err:
        yield sse(err.body())
    except Exception as err:  # e.g. EngineError: the engine died under this request
        logger.exception("stream failed")
        yield sse(APIError(500, f"{type(err).__name__}: {err}", "engine_error").body())
    finally:
        on_end()
    yield DONE


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends, even when the client left
    before the first event (then the event generator never ran, nor its ``finally``)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()

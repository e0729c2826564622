"""``/v1/completions`` and ``/v1/chat/completions``: from an HTTP request to engine requests
and back (chapter 10).

Every request takes the same path, and each step can turn it away with its own status;
the cheap checks come first, so a client that will be refused costs the server little:

1. enter: authenticate (401), refuse while draining (503 with ``Retry-After``), take the
   request from its key's bucket (429) -- before reading the body, so rejected work counts;
2. read the body: at most ``max_body_bytes`` (413), JSON (415); parse it strictly, check
   its caps (400, ``caps.py``) and model name (404);
3. admission: a place among the server's sequences (429 with ``Retry-After``);
4. tokenize the prompts on worker threads, build ``SamplingParams`` (400: too long for the
   context, bad values); charge their tokens to the key (429) -- off the event loop
   (``prompts.py``), so nothing else waits for the tokenizer;
5. submit one engine request per prompt (``n`` samples each) to the ``AsyncEngine``
   (503 if it is shutting down or has failed);
6. answer: all at once, or as server-sent events (``streaming.py``).

The key's tenant becomes the fair policy's ``user`` and its class the mixed policy's
``request_class``; the key class's priority plus the request's ``priority`` is the priority
policy's, never better (lower) than the class's own: a request may only step back. Without
API keys the request's own ``user`` field names the tenant and its ``priority`` stands.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import AsyncEngine, AsyncRequestStream, EngineError
from nanovllm.engine.core_client import EngineCoreDied
from nanovllm.outputs import RequestOutput
from nanovllm.serve.body import Model, parse_body
from nanovllm.serve.caps import check_fields
from nanovllm.serve.errors import APIError, bad_request, from_value_error
from nanovllm.serve.formats import ChatFormat, CompletionFormat
from nanovllm.serve.prompts import PromptEncoder
from nanovllm.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from nanovllm.serve.streaming import EventStream, StreamTally, failure, merge, sse_events

if TYPE_CHECKING:
    from nanovllm.serve.admission import Admission, Tenant, Ticket
    from nanovllm.serve.config import ServeConfig
    from nanovllm.serve.metrics import ServerMetrics

CLIENT_CLOSED = 499  # nginx's status for "the client went away"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServeConfig, admission: Admission,
                 metrics: ServerMetrics) -> None:
        self.engine, self.model_name = engine, config.served_model_name
        self.admission, self.metrics = admission, metrics
        self.max_body_bytes, self.grace_period = config.max_body_bytes, config.grace_period
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len = core.config.max_model_len
        self.kv_capacity = core.input_processor.kv_capacity  # tokens the KV cache holds
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len)
        self.draining = False  # set on SIGTERM: no new requests

    # -- the steps every request takes ---------------------------------------------------
    def authenticate(self, request: Request) -> Tenant:
        return self.admission.authenticate(request.headers.get("authorization"))

    def enter(self, request: Request) -> Tenant:
        """A generation request arrives: who sent it, and may it come in at all."""
        tenant = self.authenticate(request)
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another replica.",
                           "unavailable", retry_after=self.grace_period)
        if not self.engine.is_running:
            raise APIError(503, "The engine has stopped.", "unavailable")
        self.admission.enter(tenant)
        return tenant

    async def parse(self, request: Request, model: type[Model]) -> Model:
        body = await parse_body(request, model, self.max_body_bytes)
        self.check_model(getattr(body, "model", None))
        return body

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                           f"`{self.model_name}`).", "model_not_found", "model")

    def max_tokens(self, requested: int | None, ids: list[int]) -> int:
        """The request's limit (a 400 if prompt and completion overflow the context, as
        vLLM answers), or by default as many as the context (and KV cache) holds."""
        if requested is None:
            return max(1, min(self.max_model_len, self.kv_capacity) - len(ids))
        if len(ids) + requested > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {len(ids) + requested} ({len(ids)} in the prompt, {requested} "
                "for the completion).", "max_tokens", "context_length_exceeded")
        return requested

    def submit(self, prompts: list[list[int]], params: list, body: SamplingFields,
               tenant: Tenant, request_id: str) -> list[AsyncRequestStream]:
        priority = tenant.limits.priority + body.priority
        if self.admission.requires_key:  # a request may step back, never ahead of its class
            priority = max(priority, tenant.limits.priority)
        streams = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.stream(ids, sp, rid, priority))
        except (ValueError, EngineError) as err:
            for stream in streams:  # all or nothing
                self.engine.abort(stream.request_id, wait=False)
            if isinstance(err, ValueError):
                raise from_value_error(err) from None
            raise APIError(503, f"The engine cannot take requests: {err}", "unavailable") from None
        return streams

    def sampling_params(self, body: SamplingFields, tenant: Tenant, max_tokens: int,
                        logprobs: int | None):
        keyed = self.admission.requires_key
        user = tenant.name if keyed else body.user
        try:
            return body.sampling_params(max_tokens, logprobs, user,
                                        tenant.key_class if keyed else None)
        except ValueError as err:
            raise from_value_error(err) from None

    # -- the two endpoints ---------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        tenant = self.enter(request)
        body = await self.parse(request, CompletionRequest)
        for name, unsupported in (("echo", body.echo), ("suffix", body.suffix is not None),
                                  ("best_of", body.best_of not in (None, body.n))):
            if unsupported:
                raise bad_request(f"'{name}' is not supported by this server.", name)
        try:
            texts = body.prompts()
        except ValueError as err:
            raise bad_request(str(err), "prompt") from None
        check_fields(body, self.max_model_len, body.max_tokens)

        async def encode() -> list[list[int]]:
            return [self.prompts.fits(await self.prompts.encode(p), "prompt") for p in texts]

        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name,
                               body.logprobs is not None, body.return_token_ids)
        return await self.run(request, body, tenant, len(texts), encode, body.max_tokens,
                              body.logprobs, fmt)

    async def chat(self, request: Request) -> Response:
        tenant = self.enter(request)
        body = await self.parse(request, ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        limit = body.max_completion_tokens  # OpenAI's newer name wins
        limit = body.max_tokens if limit is None else limit
        check_fields(body, self.max_model_len, limit)
        conversation = body.conversation()

        async def encode() -> list[list[int]]:
            return [self.prompts.fits(await self.prompts.encode_chat(conversation), "messages")]

        k = (body.top_logprobs or 0) if body.logprobs else None
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, body.n, k,
                         body.return_token_ids)
        return await self.run(request, body, tenant, 1, encode, limit, k, fmt)

    async def run(self, request: Request, body: SamplingFields, tenant: Tenant,
                  num_prompts: int, encode: Callable[[], Awaitable[list[list[int]]]],
                  limit: int | None, logprobs: int | None, fmt) -> Response:
        """Admit, tokenize, submit and answer; the request's place is held from before
        tokenizing (so the queue's depth bounds the tokenizing too) until it ends."""
        ticket = self.admission.admit(tenant, body.n * num_prompts)
        try:
            prompts = await encode()
            params = [self.sampling_params(body, tenant, self.max_tokens(limit, ids), logprobs)
                      for ids in prompts]
            prompt_tokens = sum(map(len, prompts))
            self.admission.charge(ticket, prompt_tokens)
            streams = self.submit(prompts, params, body, tenant, fmt.request_id)
        except BaseException:
            self.admission.release(ticket)
            raise
        tally = StreamTally(len(prompts), body.n, prompt_tokens)
        if body.stream:
            options = body.stream_options
            close = lambda: self.finish(ticket, tally, streams)
            events = sse_events(
                streams, fmt, tally, bool(options and options.include_usage),
                bool(options and options.continuous_usage_stats), close,
            )
            return EventStream(events, close)
        try:
            outputs = await until_disconnected(request, self.collect(streams, tally))
        except EngineError as err:  # the engine has stopped
            if isinstance(err.__cause__, EngineCoreDied):  # (its process: try another replica)
                raise APIError(503, f"The engine has stopped: {err}", "unavailable") from None
            raise APIError(500, f"The engine failed: {err}", "engine_error") from None
        finally:
            self.finish(ticket, tally, streams)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        errors = [failure(o) for o in outputs if any(c.finish_reason == "error" for c in o.outputs)]
        if errors:
            raise APIError(500, errors[0], "request_failed")
        return JSONResponse(fmt.response(outputs, body.n))

    async def collect(self, streams: list[AsyncRequestStream],
                      tally: StreamTally) -> list[RequestOutput]:
        async for prompt, chunk in merge(streams):
            tally.add(prompt, chunk)
        return tally.outputs

    def finish(self, ticket: Ticket, tally: StreamTally,
               streams: list[AsyncRequestStream]) -> None:
        """A request has ended, or its client has left (then abort what still runs): free
        its place, record its metrics. Runs once, whoever calls it first."""
        if tally.closed:
            return
        tally.closed = True
        for stream in streams:
            if not stream.stream.done:
                self.engine.abort(stream.request_id, wait=False)
        self.admission.release(ticket, sum(tally.generated))
        for output in tally.outputs:
            if output is not None:
                self.metrics.observe(output)
            else:  # its client left before it finished: aborted
                self.metrics.aborted(tally.n)


async def until_disconnected(request: Request, work):
    """Await ``work`` unless the client disconnects first; then cancel it (its engine
    requests are aborted) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when this handler itself is cancelled)
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None

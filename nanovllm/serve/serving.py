"""``/v1/completions`` and ``/v1/chat/completions``: from an HTTP request to engine requests
and back (chapter 10).

Every request takes the same path, and each step can turn it away with its own status:

1. authenticate (401) -- before reading the body, so strangers cost nothing;
2. parse the body strictly (400), check the model name (404);
3. tokenize the prompt(s) and build ``SamplingParams`` (400: bad values, prompt too long);
4. admission: per-key token buckets and the queue depth (429 with ``Retry-After``);
5. submit one engine request per prompt (``n`` samples each) to the ``AsyncEngine``
   (503 if it is shutting down or has failed);
6. answer: all at once, or as server-sent events (``streaming.py``).

The key's tenant becomes the fair policy's ``user`` and its class the mixed policy's
``request_class``; the key class's priority plus the request's ``priority`` is the priority
policy's. Without API keys the request's own ``user`` field names the tenant.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from nanovllm.engine.async_engine import AsyncEngine, AsyncRequestStream, EngineError
from nanovllm.outputs import RequestOutput
from nanovllm.serve.errors import APIError, bad_request, from_validation_error, from_value_error
from nanovllm.serve.formats import ChatFormat, CompletionFormat
from nanovllm.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from nanovllm.serve.streaming import EventStream, StreamTally, failure, merge, sse_events

if TYPE_CHECKING:
    from nanovllm.serve.admission import Admission, Tenant, Ticket
    from nanovllm.serve.metrics import ServerMetrics

CLIENT_CLOSED = 499  # nginx's status for "the client went away"
MAX_N = 128  # completions per prompt, as OpenAI allows


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, admission: Admission,
                 metrics: ServerMetrics) -> None:
        self.engine, self.model_name = engine, model_name
        self.admission, self.metrics = admission, metrics
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len = core.config.max_model_len
        self.kv_capacity = core.input_processor.kv_capacity  # tokens the KV cache holds
        self.draining = False  # set on SIGTERM: no new requests

    # -- the steps every request takes ---------------------------------------------------
    def authenticate(self, request: Request) -> Tenant:
        try:
            return self.admission.authenticate(request.headers.get("authorization"))
        except APIError as err:
            self.metrics.reject(err.code)
            raise

    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as err:
            raise from_validation_error(err) from None
        self.check_model(getattr(body, "model", None))
        return body

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                           f"`{self.model_name}`).", "model_not_found", "model")

    def encode(self, prompt: str | list[int], special: bool = True) -> list[int]:
        """A prompt's token ids (token ids pass through: the engine checks their range)."""
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise bad_request("This model has no tokenizer: send token ids as the prompt.",
                              "prompt")
        if not prompt:
            raise bad_request("The prompt is empty.", "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=special)

    def check_length(self, ids: list[int], param: str) -> None:
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens, which leaves no room for a completion.",
                param, "context_length_exceeded",
            )

    def max_tokens(self, requested: int | None, ids: list[int]) -> int:
        """The request's limit, or by default as many as the context (and KV cache) holds."""
        if requested is not None:
            return requested
        return max(1, min(self.max_model_len, self.kv_capacity) - len(ids))

    def admit(self, tenant: Tenant, size: int, prompt_tokens: int) -> Ticket:
        if self.draining or not self.engine.is_running:
            self.metrics.reject("unavailable")
            raise APIError(503, "The server is shutting down." if self.draining else
                           "The engine has stopped.", "unavailable")
        try:
            return self.admission.admit(tenant, size, prompt_tokens)
        except APIError as err:
            self.metrics.reject(err.code)
            raise

    def submit(self, prompts: list[list[int]], params: list, body: SamplingFields,
               tenant: Tenant, request_id: str) -> list[AsyncRequestStream]:
        priority = tenant.limits.priority + body.priority
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
        tenant = self.authenticate(request)
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        for name, unsupported in (("echo", body.echo), ("suffix", body.suffix is not None),
                                  ("best_of", body.best_of not in (None, body.n))):
            if unsupported:
                raise bad_request(f"'{name}' is not supported by this server.", name)
        try:
            prompts = [self.encode(p) for p in body.prompts()]
        except ValueError as err:
            raise bad_request(str(err), "prompt") from None
        for ids in prompts:
            self.check_length(ids, "prompt")
        params = [
            self.sampling_params(body, tenant, self.max_tokens(body.max_tokens, ids),
                                 body.logprobs)
            for ids in prompts
        ]
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name,
                               body.logprobs is not None, body.return_token_ids)
        return await self.run(request, body, tenant, prompts, params, fmt)

    async def chat(self, request: Request) -> Response:
        tenant = self.authenticate(request)
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        ids = self.encode_chat(body.conversation())
        self.check_length(ids, "messages")
        limit = body.max_completion_tokens  # OpenAI's newer name wins
        limit = body.max_tokens if limit is None else limit
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = [self.sampling_params(body, tenant, self.max_tokens(limit, ids), k)]
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, body.n, k,
                         body.return_token_ids)
        return await self.run(request, body, tenant, [ids], params, fmt)

    def encode_chat(self, conversation: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions.")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # e.g. a template that insists roles alternate
            raise bad_request(f"The chat template refused the messages: {err}",
                              "messages") from None
        # the template holds any start-of-text token already (as LLM.chat)
        return self.encode(text, special=False)

    async def run(self, request: Request, body: SamplingFields, tenant: Tenant,
                  prompts: list[list[int]], params: list, fmt) -> Response:
        if body.n > MAX_N:
            raise bad_request(f"n must be at most {MAX_N}.", "n")
        prompt_tokens = sum(map(len, prompts))
        ticket = self.admit(tenant, body.n * len(prompts), prompt_tokens)
        try:
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
        except EngineError as err:  # a step failed: the engine has stopped
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

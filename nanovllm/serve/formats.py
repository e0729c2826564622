"""From the engine's outputs to OpenAI's response objects, streamed or whole (chapter 10).

A completions request numbers its choices prompt-major (``prompt * n + sample``); chat has
one prompt. Streamed chunks carry the text and tokens new since the last one; a chunk with
tokens but no text yet (a character still incomplete, or text held back because it may
begin a stop string) is sent anyway, so clients see every token arrive (vLLM does the same).

Streaming formats each chunk as a server-sent event string (``streaming.sse``). The common
chunk -- text and tokens, no logprobs, no running usage -- is written straight into a
template preformatted once per request (``EventTemplate``), not built as a pydantic model
and dumped: that per-token work runs on the API process's event loop, once per token of
every stream (chapter 10 §8 measures where that process's time goes). A test holds the two
paths to the same bytes.
"""

from __future__ import annotations

import json
import time

from nanovllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput, StreamChunk
from nanovllm.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    dump,
)
from nanovllm.serve.streaming import sse


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


class EventTemplate:
    """A request's streamed chunk event with its constant fields preformatted: ``head``
    holds ``data: {"id":...,"object":...,"created":...,"model":...,"choices":[`` and an
    event is ``head + choice + ],"usage":null}`` (the field order of the pydantic models)."""

    def __init__(self, request_id: str, kind: str, model: str, created: int) -> None:
        self.head = (f'data: {{"id":{_json(request_id)},"object":"{kind}",'
                     f'"created":{created},"model":{_json(model)},"choices":[')

    def event(self, choice: str) -> str:
        return f'{self.head}{choice}],"usage":null}}\n\n'


def _tail(chunk: StreamChunk, token_ids: bool) -> str:
    """A plain chunk's fields after the text: no logprobs, its finish and stop reasons, its
    token ids if the request asked for them."""
    ids = _json(chunk.token_ids) if token_ids else "null"
    return (f'"logprobs":null,"finish_reason":{_json(chunk.finish_reason)},'
            f'"stop_reason":{_json(chunk.stop_reason)},"token_ids":{ids}}}')


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def _ranked(position: PositionLogprobs) -> list:
    return sorted(position.values(), key=lambda lp: lp.rank or 0)


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], offset: int = 0
) -> CompletionLogprobs:
    """The legacy shape: each token's text, logprob, the top k (and the chosen token) as
    ``{text: logprob}``, and where the token's text starts (from ``offset``)."""
    out = CompletionLogprobs()
    for token, position in zip(token_ids, positions):
        chosen = position[token]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in _ranked(position)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> ChatLogprobs:
    """Chat's shape: per token its text, logprob, UTF-8 bytes and the k most likely."""

    def entry(lp, cls):
        text = lp.decoded_token or ""
        return cls(token=text, logprob=lp.logprob, bytes=list(text.encode()))

    content = []
    for token, position in zip(token_ids, positions):
        item = entry(position[token], TokenLogprob)
        top = [lp for lp in _ranked(position) if lp.rank is not None and lp.rank <= k][:k]
        item.top_logprobs = [entry(lp, TopLogprob) for lp in top]
        content.append(item)
    return ChatLogprobs(content=content)


class CompletionFormat:
    """``/v1/completions``: ``text_completion`` objects."""

    def __init__(self, request_id: str, model: str, logprobs: bool, token_ids: bool) -> None:
        self.request_id, self.model = request_id, model
        self.logprobs, self.token_ids = logprobs, token_ids
        self.offsets: dict[int, int] = {}  # text offset of each choice's next token
        self.created = int(time.time())
        self.template = EventTemplate(request_id, "text_completion", model, self.created)

    def _choice(self, index: int, text: str, ids: list[int], positions, finish, stop):
        logprobs = None
        if self.logprobs and positions is not None:
            logprobs = completion_logprobs(ids, positions, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + sum(map(len, logprobs.tokens))
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish,
                                stop_reason=stop, token_ids=ids if self.token_ids else None)

    def prelude(self) -> list[str]:
        return []

    def chunk(self, choice: int, chunk: StreamChunk, usage: dict | None) -> str | None:
        """The event for ``chunk`` (None when it carries nothing)."""
        if not (chunk.token_ids or chunk.text or chunk.finish_reason):
            return None
        if usage is None and not (self.logprobs and chunk.logprobs is not None):
            return self.template.event(f'{{"index":{choice},"text":{_json(chunk.text)},'
                                       + _tail(chunk, self.token_ids))
        return self.model_chunk(choice, chunk, usage)

    def model_chunk(self, choice: int, chunk: StreamChunk, usage: dict | None) -> str:
        """``chunk``'s event built as a pydantic model: every field, the slow way."""
        c = self._choice(choice, chunk.text, chunk.token_ids, chunk.logprobs,
                         chunk.finish_reason, chunk.stop_reason)
        return sse(dump(CompletionResponse(id=self.request_id, created=self.created,
                                           model=self.model, choices=[c], usage=usage)))

    def usage_chunk(self, usage: dict) -> str:
        return sse(dump(CompletionResponse(id=self.request_id, created=self.created,
                                           model=self.model, choices=[], usage=usage)))

    def response(self, outputs: list[RequestOutput], n: int) -> dict:
        choices = [
            self._choice(p * n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason,
                         c.stop_reason)
            for p, out in enumerate(outputs)
            for c in out.outputs
        ]
        return dump(CompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                       usage=usage_of(outputs)))


class ChatFormat:
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None,
                 token_ids: bool) -> None:
        self.request_id, self.model, self.n = request_id, model, n
        self.top_logprobs, self.token_ids = top_logprobs, token_ids
        self.created = int(time.time())
        self.template = EventTemplate(request_id, "chat.completion.chunk", model, self.created)

    def _logprobs(self, ids: list[int], positions) -> ChatLogprobs | None:
        if self.top_logprobs is None or positions is None:
            return None
        return chat_logprobs(ids, positions, self.top_logprobs)

    def _chunk(self, choices: list[ChatStreamChoice], usage: dict | None = None) -> str:
        return sse(dump(ChatCompletionChunk(id=self.request_id, created=self.created,
                                            model=self.model, choices=choices, usage=usage)))

    def prelude(self) -> list[str]:
        """First the role, for every choice (as OpenAI streams it)."""
        delta = ChatDelta(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(index=i, delta=delta)]) for i in range(self.n)]

    def chunk(self, choice: int, chunk: StreamChunk, usage: dict | None) -> str | None:
        """The event for ``chunk`` (None when it carries nothing)."""
        if not (chunk.token_ids or chunk.text or chunk.finish_reason):
            return None
        if usage is None and (self.top_logprobs is None or chunk.logprobs is None):
            return self.template.event(
                f'{{"index":{choice},"delta":{{"role":null,"content":{_json(chunk.text)}}},'
                + _tail(chunk, self.token_ids))
        return self.model_chunk(choice, chunk, usage)

    def model_chunk(self, choice: int, chunk: StreamChunk, usage: dict | None) -> str:
        """``chunk``'s event built as a pydantic model: every field, the slow way."""
        c = ChatStreamChoice(
            index=choice, delta=ChatDelta(content=chunk.text),
            logprobs=self._logprobs(chunk.token_ids, chunk.logprobs),
            finish_reason=chunk.finish_reason, stop_reason=chunk.stop_reason,
            token_ids=chunk.token_ids if self.token_ids else None,
        )
        return self._chunk([c], usage)

    def usage_chunk(self, usage: dict) -> str:
        return self._chunk([], usage)

    def response(self, outputs: list[RequestOutput], n: int) -> dict:
        (out,) = outputs
        choices = [self._choice(c) for c in out.outputs]
        return dump(ChatCompletionResponse(id=self.request_id, model=self.model,
                                           choices=choices, usage=usage_of(outputs)))

    def _choice(self, c: CompletionOutput) -> ChatChoice:
        return ChatChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=self._logprobs(c.token_ids, c.logprobs), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=c.token_ids if self.token_ids else None,
        )

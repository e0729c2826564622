"""The OpenAI API's request and response bodies as pydantic models (chapter 10).

Requests are parsed strictly: a field of the wrong type, an unknown field (OpenAI answers
"Unrecognized request argument") or malformed JSON is a 400, never a silent default. Next
to OpenAI's fields a request takes vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...) and
``priority``, which the official client sends through ``extra_body``. ``sampling_params``
turns a request into the engine's ``SamplingParams``, whose own checks (ranges) then apply.

Structured output (chapter 15): OpenAI's ``response_format`` and vLLM's ``structured_outputs``
are parsed by ``response_format.py`` and become ``SamplingParams.structured_outputs``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.response_format import (
    ResponseFormat,
    StructuredOutputsFields,
    constraint,
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class SamplingFields(Strict):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None  # None: the one model served
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields, sent in the body (``extra_body`` in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0  # lower first (scheduler_policy "priority"), added to the key class's
    deadline: float | None = None  # seconds after arrival ("priority" policy)
    return_token_ids: bool = False  # vLLM's: each choice also lists its token ids
    response_format: ResponseFormat | None = None  # OpenAI's structured output (chapter 15)
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's

    def sampling_params(self, max_tokens: int, logprobs: int | None, user: str | None,
                        request_class: str | None) -> SamplingParams:
        """The engine's settings; raises ``ValueError`` (a 400) for values out of range."""
        bias = None
        if self.logit_bias is not None:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers)") from None
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=-1 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or ()),
            stop=[] if self.stop is None else self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            deadline=self.deadline,
            user=user,
            request_class=request_class,
            structured_outputs=constraint(self.response_format, self.structured_outputs),
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False  # not supported: a 400 when true
    best_of: int | None = None  # only best_of == n
    suffix: str | None = None  # not supported

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch of them (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as a chat template reads them: ``{"role", "content"}`` with plain text
    (OpenAI's newer "developer" role is the "system" role templates know)."""
    role = lambda m: "system" if m.role == "developer" else m.role
    return [{"role": role(m), "content": m.text()} for m in messages]


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# -- responses (dumped as they are; OpenAI's clients read every field) --------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions API's logprobs: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanovllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")

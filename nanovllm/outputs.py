"""What the engine hands back (chapter 00; streaming in chapter 10).

``LLM.generate`` returns vLLM-shaped ``RequestOutput`` objects, each with its
``RequestMetrics``. The async engine (``engine/async_engine.py``) streams ``StreamChunk``s;
the transport that carries them from the engine thread to a reader is ``engine/stream.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) and counters of one request's life.

    The latency figures of chapters 06 and 10 are derived from them: queue time, time to
    first token (TTFT), time per output token (TPOT, the mean gap between tokens after
    the first) and end-to-end latency. A derived figure is None until its inputs exist.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # speculative decoding (chapter 14): tokens proposed for it, and of those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival -> first scheduled (admitted into a batch)."""
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _since(self.arrival_time, self.first_token_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean inter-token latency after the first token (None with fewer than 2 tokens)."""
        if self.num_output_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival -> finished (including an abort)."""
        return _since(self.arrival_time, self.finished_time)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


@dataclass
class Logprob:
    """A token's log-probability, its rank among all tokens (1 = most likely) and its text,
    as vLLM reports them (``SamplingParams.logprobs`` / ``prompt_logprobs``, chapter 01)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: {token id: Logprob} for the chosen token and the top k.
PositionLogprobs = dict[int, Logprob]
# What the engine reports per position: (token id, its logprob, its rank, the top k token
# ids, their logprobs)
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


def position_logprobs(entry: TokenLogprobs | None, tokenizer: Any) -> PositionLogprobs | None:
    """``{token id: Logprob}`` for the chosen token and the top k, with their texts."""
    if entry is None:
        return None
    token, logprob, rank, top_ids, top_logprobs = entry
    ids = [token, *top_ids]
    logprobs = [logprob, *top_logprobs]
    ranks = [rank, *range(1, len(top_ids) + 1)]
    decode = (lambda t: None) if tokenizer is None else (lambda t: tokenizer.decode([t]))
    return {t: Logprob(lp, r, decode(t)) for t, lp, r in zip(ids, logprobs, ranks)}


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them), in vLLM's shape."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (see RequestOutput.error), or None while running
    finish_reason: str | None
    # with "stop": the stop string or stop token id that ended it (None for EOS), as in vLLM
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the tokens' logprobs, with logprobs=k
    logprobs: list[PositionLogprobs] | None = None  # one dict per token, with logprobs=k

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its samples. ``text``, ``token_ids`` and ``finish_reason``
    are shortcuts for ``outputs[0]`` (most requests have one sample; the chapters use them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Ours, not vLLM's: with finish_reason "error", what went wrong (the engine goes on).
    error: str | None = None
    # with prompt_logprobs=k: None for the first prompt token, then one dict per token
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        """Shortcut for ``outputs[0].text``."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class StreamChunk:
    """What a request's stream yields: the tokens (and text) new since the last chunk.

    ``index`` says which of the request's ``SamplingParams.n`` samples the tokens belong
    to (always 0 for n = 1), and ``logprobs`` holds one ``{token id: Logprob}`` per token
    when the request asked for ``logprobs``. A sample's last chunk carries its
    ``finish_reason``; its text is whatever the sample's final output adds to the text
    streamed so far (e.g. characters held back while they might have begun a stop string).
    The request's last chunk (the last sample to end) also has ``finished=True`` and the
    complete ``output``.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = field(default=None, repr=False)
    index: int = 0
    logprobs: list[PositionLogprobs] | None = field(default=None, repr=False)
    stop_reason: int | str | None = None  # with finish_reason "stop": the string or token id

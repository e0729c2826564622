"""What a step reports, and what turns those reports into ``RequestOutput``s (chapters 00, 10).

``LLMEngine.step()`` returns one ``EngineCoreOutput`` per request that progressed: the
token ids new since its last report and, once it has ended, why (vLLM's v1 engine core
speaks the same way). Everything else about a request — its text, its accumulated tokens —
is the consumer's business: ``LLM.generate`` and ``AsyncEngine`` each keep a
``RequestState`` per request, feed it the deltas and ask it for the ``RequestOutput``.
So the engine never hands out a token that is still in flight (async scheduling) and never
decodes text that nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestOutput,
    TokenLogprobs,
    position_logprobs,
)


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string, with "stop"
    error: str | None = None  # with "error": what went wrong
    index: int = 0  # which of the request's SamplingParams.n samples
    # with SamplingParams.logprobs / prompt_logprobs: one entry per new (prompt) token
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Sample:
    """What a consumer has heard so far of one of a request's samples."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.last: EngineCoreOutput | None = None  # the latest report


class RequestState:
    """A consumer's view of one request: the tokens of its ``n`` samples so far and, once
    all have finished, its ``RequestOutput``. ``seq`` is the request's (first) sequence."""

    def __init__(self, seq: Sequence, tokenizer, n: int = 1) -> None:
        self.request_id = seq.parent_id
        self.prompt = seq.prompt
        self.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
        self.params = seq.params
        self.metrics = seq.metrics  # filled in by the engine as the request runs
        self.tokenizer = tokenizer
        self.samples = [_Sample() for _ in range(n)]
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]  # none for the first token

    @property
    def finished(self) -> bool:
        return all(s.last is not None and s.last.finished for s in self.samples)

    def update(self, out: EngineCoreOutput) -> None:
        sample = self.samples[out.index]
        sample.token_ids += out.new_token_ids
        sample.logprobs += out.new_logprobs or ()
        self.prompt_logprobs += out.new_prompt_logprobs or ()
        sample.last = out

    def output(self) -> RequestOutput:
        """The ``RequestOutput`` so far (complete once ``finished``). Texts come from the same
        detokenizer, settings and stop strings as the engine's stop check, so each is cut
        where the engine stopped."""
        errors = [s.last.error for s in self.samples if s.last is not None and s.last.error]
        with_prompt_logprobs = self.params.prompt_logprobs is not None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [self._completion(i, s) for i, s in enumerate(self.samples)],
            self.finished,
            self.metrics,
            errors[0] if errors else None,
            [self._logprobs(p) for p in self.prompt_logprobs] if with_prompt_logprobs else None,
        )

    def _completion(self, index: int, sample: _Sample) -> CompletionOutput:
        params, last = self.params, sample.last
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens, params.min_tokens,
        )
        detokenizer.push(sample.token_ids)
        with_logprobs = params.logprobs is not None
        return CompletionOutput(
            index,
            detokenizer.text,
            list(sample.token_ids),
            last.finish_reason if last else None,
            last.stop_reason if last else None,
            sum(lp[1] for lp in sample.logprobs) if with_logprobs else None,
            [self._logprobs(lp) for lp in sample.logprobs] if with_logprobs else None,
        )

    def _logprobs(self, entry: TokenLogprobs | None) -> PositionLogprobs | None:
        """``{token id: Logprob}`` for the chosen token and the top k, with their texts."""
        return position_logprobs(entry, self.tokenizer)

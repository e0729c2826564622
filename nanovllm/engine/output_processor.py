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
from nanovllm.outputs import CompletionOutput, RequestOutput


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string, with "stop"
    error: str | None = None  # with "error": what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """A consumer's view of one request: its tokens so far and, once finished, its output."""

    def __init__(self, seq: Sequence, tokenizer) -> None:
        self.request_id = seq.request_id
        self.prompt = seq.prompt
        self.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]
        self.params = seq.params
        self.metrics = seq.metrics  # filled in by the engine as the request runs
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.last: EngineCoreOutput | None = None  # the latest report

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def update(self, out: EngineCoreOutput) -> None:
        self.token_ids += out.new_token_ids
        self.last = out

    def output(self) -> RequestOutput:
        """The ``RequestOutput`` so far (complete once ``finished``). Its text comes from
        the same detokenizer, settings and stop strings as the engine's stop check, so it
        is cut where the engine stopped."""
        params, last = self.params, self.last
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        detokenizer.push(self.token_ids)
        finish_reason = last.finish_reason if last else None
        stop_reason = last.stop_reason if last else None
        completion = CompletionOutput(
            0, detokenizer.text, list(self.token_ids), finish_reason, stop_reason
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            self.finished,
            self.metrics,
            last.error if last else None,
        )

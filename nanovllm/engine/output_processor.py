"""What a step reports, and what turns those reports into ``RequestOutput``s (chapters 00, 10).

``LLMEngine.step()`` returns one ``EngineCoreOutput`` per request that progressed: its new
token ids and, once ended, why (as vLLM's v1 engine core does). Text and accumulated tokens are
the front end's: its ``OutputProcessor`` keeps a ``RequestState`` per request, so the engine
never hands out a token still in flight nor decodes text that nobody reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from nanovllm.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import (
    CompletionOutput,
    RequestOutput,
    TokenLogprobs,
    position_logprobs,
)

if TYPE_CHECKING:
    from nanovllm.engine.input_processor import RequestIds
    from nanovllm.engine.stream import RequestStream


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


@dataclass
class _Sample:
    """What a consumer has heard so far of one of a request's samples."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: EngineCoreOutput | None = None  # the latest report


class RequestState:
    """A consumer's view of one request: the tokens of its ``n`` samples so far and, once
    all have finished, its ``RequestOutput``. ``seq`` is the request's (first) sequence."""

    def __init__(self, seq: Sequence, tokenizer, n: int = 1,
                 stream: RequestStream | None = None) -> None:
        self.request_id = seq.parent_id
        self.stream = stream  # where AsyncEngine delivers the request; None for LLM.generate
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
            [position_logprobs(p, self.tokenizer) for p in self.prompt_logprobs]
            if with_prompt_logprobs else None,
        )

    def _completion(self, index: int, sample: _Sample) -> CompletionOutput:
        params, last = self.params, sample.last
        detokenizer = IncrementalDetokenizer.for_params(self.tokenizer, params)
        detokenizer.push(sample.token_ids)
        with_logprobs = params.logprobs is not None
        return CompletionOutput(
            index,
            detokenizer.text,
            list(sample.token_ids),
            last.finish_reason if last else None,
            last.stop_reason if last else None,
            sum(lp[1] for lp in sample.logprobs) if with_logprobs else None,
            [position_logprobs(lp, self.tokenizer) for lp in sample.logprobs]
            if with_logprobs else None,
        )


class RequestUpdate(NamedTuple):
    """One report applied to its request; ``finished`` with the request's last report (its
    last sample ended): ``state.output()`` is then final. Building it (detokenizing every
    sample) is the caller's choice of moment: ``LLM.generate`` waits until no step is left
    to launch, so no detokenization stands between two steps."""

    state: RequestState
    delta: EngineCoreOutput
    finished: bool = False


class OutputProcessor:
    """A front end's requests, from the claim of their ids to their final outputs (vLLM's
    ``OutputProcessor``; ``LLM`` and ``AsyncEngine`` each have one). One thread uses it:
    the one that steps the engine."""

    def __init__(self, tokenizer, request_ids: RequestIds) -> None:
        self.tokenizer = tokenizer
        self.request_ids = request_ids  # the engine's allocator (input_processor.py)
        self.states: dict[str, RequestState] = {}  # the unfinished requests, by id

    def add_request(self, seqs: list[Sequence],
                    stream: RequestStream | None = None) -> RequestState:
        """Track the request whose samples are ``seqs``, claiming its id (held until its
        final output) unless the front end claimed it already; ``ValueError`` if a user's
        id is in use. Add ``seqs`` to the engine after this."""
        request_id = self.request_ids.claim(seqs, held=True)
        state = RequestState(seqs[0], self.tokenizer, len(seqs), stream)
        self.states[request_id] = state
        return state

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> list[RequestUpdate]:
        """Apply a step's reports to their requests (others' reports are skipped). A
        request that finished is dropped and its id released."""
        updates = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # another caller's request: not ours to report
            state.update(out)
            finished = out.finished and state.finished
            if finished:
                del self.states[out.request_id]
                self.request_ids.release(out.request_id)
            updates.append(RequestUpdate(state, out, finished))
        return updates

    def abort(self, request_ids: Iterable[str]) -> None:
        """Forget requests that will get no more reports (aborted in the engine, or never
        added to it), releasing their ids."""
        for request_id in request_ids:
            if self.states.pop(request_id, None) is not None:
                self.request_ids.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

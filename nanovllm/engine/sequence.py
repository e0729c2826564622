"""A ``Sequence``: one request's tokens and its place in the engine (chapters 04 and 06)."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import TYPE_CHECKING

from nanovllm.outputs import RequestMetrics
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.detokenizer import IncrementalDetokenizer
    from nanovllm.structured_output.backend_xgrammar import GrammarState

# Stands for a sampled token that has not reached the host yet (async scheduling, chapter 11).
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Prompt plus generated tokens, the KV blocks that hold them, and bookkeeping.
    ``num_computed_tokens`` counts tokens whose keys and values are in the cache."""

    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, prompt: str | None = None,
                 priority: int = 0) -> None:
        self.seq_id = next(Sequence._ids)
        self.has_user_request_id = request_id is not None
        # Without a user's id, a placeholder until the engine gives one (RequestIds.claim)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        # The request this sequence is sample `index` of (SamplingParams.n; itself when n = 1)
        self.parent_id, self.index = self.request_id, 0
        self.prompt = prompt
        self.priority = priority  # lower = more important, as in vLLM (chapter 06)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_computed_tokens = 0
        # Sliding window (chapter 12, engine/sliding_window.py): the first
        # `num_released_blocks` slots of the table hold the null block, their blocks given
        # back; `released_serial` is the prefix-cache serial of the last one's chain.
        self.num_released_blocks = 0
        self.released_serial: int | None = None
        # Output tokens whose values have reached the host; with async scheduling the newest
        # one may still be a PLACEHOLDER after them (chapter 11).
        self.num_delivered_tokens = 0
        self.num_prompt_logprobs_sent = 1  # prompt positions reported (none for the first)
        self.bad_word_ids: list[list[int]] = []  # SamplingParams.bad_words, tokenized
        self.finish_reason: str | None = None
        # Text so far, kept only for requests with stop strings (the engine's stop check).
        self.detokenizer: IncrementalDetokenizer | None = None
        # SamplingParams.structured_outputs' matcher (chapter 15); the scheduler advances it
        self.grammar: GrammarState | None = None
        self.user = params.user  # tenant, for fair scheduling
        self.request_class = params.request_class  # for the "mixed" policy
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")

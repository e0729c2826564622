"""What crosses between the scheduler and the model runner each step (chapters 06, 11).

``Scheduler.schedule()`` returns a ``SchedulerOutput``; the runner's sampled tokens come back
as a ``ModelRunnerOutput`` (vLLM v1's shape: ``vllm/v1/core/sched/output.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.engine.step import InFlight


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # during this schedule()
    finished_seq_ids: set[int] = field(default_factory=set)  # since the previous step
    # A speculative step (chapter 14): each proposing sequence's proposals by seq_id; they
    # sit after its last token and count in num_new_tokens. None: not speculative.
    draft_token_ids: dict[int, list[int]] | None = None

    def __post_init__(self) -> None:
        seqs, counts = self.seqs, self.num_new_tokens
        self.seqs, self.num_new_tokens, self.num_tokens = [], [], 0  # sum of num_new_tokens
        # per sequence: its step is one token after the whole prompt (a decode), and its step
        # reaches its last token (so the runner samples the next one); read when scheduled
        self.is_decode: list[bool] = []
        self.samples: list[bool] = []
        for seq, n in zip(seqs, counts):
            self.add(seq, n)

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule ``n`` new tokens of ``seq``, after its ``num_computed_tokens``."""
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.num_tokens += n
        self.is_decode.append(n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.samples.append(seq.num_computed_tokens + n == seq.num_tokens)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` if it is in the step (preempted after being scheduled, or failed)."""
        for i, s in enumerate(self.seqs):
            if s is seq:
                self.num_tokens -= self.num_new_tokens[i]
                del self.seqs[i], self.num_new_tokens[i], self.is_decode[i], self.samples[i]
                return

    @property
    def num_decodes(self) -> int:
        return sum(self.is_decode)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class ModelRunnerOutput:
    """The sampled tokens of one executed step: one per sequence of ``step``, None where the
    step ended mid-prompt. ``in_flight`` (the runner's launched step) carries logprobs and
    prompt logprobs when requests asked for them; a stand-in model may leave it None."""

    step: SchedulerOutput
    # a speculative step (step.draft_token_ids): a list per sequence, its accepted proposals
    # then the target's token (chapter 14)
    sampled_token_ids: list[int | None] | list[list[int] | None]
    in_flight: InFlight | None = None

    @classmethod
    def constant(cls, step: SchedulerOutput, token: int) -> ModelRunnerOutput:
        """Every sampled sequence of ``step`` gets ``token`` (a stand-in model for tests
        and chapter 06's simulations)."""
        return cls(step, [token if s else None for s in step.samples])

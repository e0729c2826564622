"""What one engine step carries between the scheduler, the model runner and its workers.

``StepPlan`` is a step's model inputs as host arrays (what a tensor-parallel worker receives,
chapter 09); ``PreparedBatch`` is the same step on the device, with what rank 0 needs to
sample; ``InFlight`` is a launched step whose tokens may still be on their way to the host
(async scheduling, chapter 11). ``ModelRunner`` (``model_runner.py``) makes and consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nanovllm.context import AttentionMetadata
from nanovllm.engine.sequence import Sequence


@dataclass
class StepPlan:
    """One step's model inputs as host arrays: all that a tensor-parallel worker needs."""

    longs: np.ndarray  # token ids, positions, slots, sampled rows, patch targets and sources
    ints: np.ndarray  # cu_seqlens_q, seq_lens_k, then the block tables row by row
    num_tokens: int
    num_seqs: int
    num_samples: int
    width: int  # block-table columns
    max_seqlen_q: int
    num_decodes: int
    has_patches: bool  # placeholder tokens that rank 0 fills from its last sampled tokens
    # per prompt_logprobs entry: (first row, positions scored), for the LM-head calls
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    use_graphs: bool = False


@dataclass
class PreparedBatch:
    plan: StepPlan
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sample_seqs: list[Sequence]  # the sequences those rows belong to, in the same order
    logit_rows: list[int]  # per sequence in batch order: its sample row, or -1 mid-prompt
    # with prompt_logprobs: (sequence, its first row, the prompt positions there, k)
    prompt_logprobs: list[tuple[Sequence, int, list[int], int]] = field(default_factory=list)


@dataclass
class InFlight:
    """A launched step whose sampled tokens may still be on their way to the host."""

    tokens: torch.Tensor | None  # [num sampled] on the host (pinned on a GPU); None: none
    done: torch.cuda.Event | None  # recorded after the copies to the host (GPU only)
    logit_rows: list[int]  # as in PreparedBatch
    # with logprobs: compute_logprobs' four tensors for the sampled rows (else empty)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    # with prompt_logprobs: (sequence, first prompt position, compute_logprobs' tensors)
    prompt_logprobs: list[tuple] = field(default_factory=list)
    _logprob_lists: list | None = field(default=None, repr=False)

    def token_logprobs(self, row: int, token: int, k: int) -> tuple:
        """``(token, logprob, rank, top-k ids, their logprobs)`` of sampled row ``row``
        (the step computed the largest k its requests asked for; this one asked for k)."""
        if self._logprob_lists is None:  # once per step: a tensor op per row costs ~us each
            self._logprob_lists = [t.tolist() for t in self.logprobs]
        logprob, rank, top_ids, top_logprobs = self._logprob_lists
        return token, logprob[row], rank[row], top_ids[row][:k], top_logprobs[row][:k]

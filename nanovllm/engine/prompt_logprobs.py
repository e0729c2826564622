"""Logprobs of a request's prompt tokens (``SamplingParams.prompt_logprobs``, chapter 01):
the raw distribution at each prompt position, scored against the prompt's next token."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import compute_logprobs

PROMPT_LOGPROB_ROWS = 512  # prompt positions scored at once: bounds the [rows, vocab] logits


def logit_chunks(first_row: int, count: int) -> Iterator[slice]:
    """The hidden-state rows ``first_row ..`` of ``count`` prompt positions, in LM-head calls
    of at most ``PROMPT_LOGPROB_ROWS`` rows (a tensor-parallel worker makes the same calls)."""
    for start in range(0, count, PROMPT_LOGPROB_ROWS):
        yield slice(first_row + start, first_row + min(start + PROMPT_LOGPROB_ROWS, count))


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, seq: Sequence,
                    first_row: int, positions: list[int], k: int,
                    to_device: Callable[..., torch.Tensor]) -> tuple:
    """Logprobs of ``seq``'s prompt tokens after ``positions`` (the rows of ``hidden`` from
    ``first_row``), with the top ``k``: ``(seq, first position, compute_logprobs' four
    tensors)``, as ``PreparedBatch.prompt_logprobs`` lists them."""
    targets = to_device([seq.token_ids[p + 1] for p in positions], torch.int64)
    pieces = []
    for rows in logit_chunks(first_row, len(positions)):
        logits = model.compute_logits(hidden[rows]).float()
        part = slice(rows.start - first_row, rows.stop - first_row)
        pieces.append(compute_logprobs(logits.log_softmax(dim=-1), targets[part], k))
    return seq, positions[0], [torch.cat(column) for column in zip(*pieces)]

"""Token embedding and the LM head, split over the vocabulary (chapters 01 and 09).

Each rank holds a contiguous slice of the vocabulary. The embedding looks up the tokens it
owns and zeroes the rest before an all-reduce; the head computes its slice of the logits,
which every rank gathers (the workers only take part; rank 0 samples from them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start : self.start + self.shard_size]
        param.data.zero_()  # the last shard may be shorter than the others
        param.data[: part.shape[0]].copy_(part)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[..., hidden]`` of ``token_ids`` (any shape), on every rank.

        Handout (chapter 09 §4, assignment ``09.vocab_embed``): with ``N > 1`` ranks this
        rank's ``self.weight`` ``[shard_size, hidden]`` holds the rows of the vocabulary ids
        ``self.start .. self.start + shard_size - 1`` (the last shard is padded with zero
        rows). Look up the tokens this rank owns at their local row, give every other token
        a vector of zeros, and return ``all_reduce`` of the result: each token is owned by
        exactly one rank, so the sum over ranks is its embedding. The lookup must not index
        out of range for tokens it does not own (clamp their local ids into range first,
        then zero their rows); keep the dtype of ``self.weight``. Hint: ``F.embedding``; a
        boolean mask ``[..., 1]`` multiplies like 0/1.
        """
        if tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        # >>> assignment 09.vocab_embed (4 points)
        local = token_ids - self.start
        owned = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(y * owned.unsqueeze(-1))
        # <<< assignment 09.vocab_embed


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]

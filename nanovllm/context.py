"""The per-step forward context: attention metadata the model runner sets (chapter 04).

The model's ``forward(input_ids, positions)`` stays free of paging details; each attention
layer reads the current step's slot mapping and block tables from here instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one packed batch: sequences' new tokens laid end to end.

    Sequences with a single new token (decodes) come first, ``num_decodes`` of them.
    ``seq_lens_k[b]`` counts all of sequence b's keys: cached prefix plus new tokens.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token (-1: skip)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int
    # Host copies, so the PyTorch backend can loop without device syncs.
    cu_seqlens_q_host: list[int]
    seq_lens_k_host: list[int]


class _ThreadContext(threading.local):
    meta: AttentionMetadata | None = None


# One per thread: two engines in one process (replicas, each on its own AsyncEngine thread)
# step at the same time, and each layer must read its own engine's step. The context
# manager restores it after every step, so an engine leaves nothing here behind.
_context = _ThreadContext()


def get_attention_metadata() -> AttentionMetadata | None:
    return _context.meta


@contextmanager
def attention_metadata(meta: AttentionMetadata | None) -> Iterator[None]:
    previous, _context.meta = _context.meta, meta
    try:
        yield
    finally:
        _context.meta = previous

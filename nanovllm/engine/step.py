"""What one engine step carries between the scheduler, the model runner and its workers.

``StepPlan`` is a step's model inputs as host arrays (what a tensor-parallel worker receives,
chapter 09), packed by ``PackedArrays`` into one named buffer per dtype; ``PreparedBatch`` is
the same step on the device, with what rank 0 needs to sample; ``InFlight`` is a launched step
whose tokens may still be on their way to the host (async scheduling, chapter 11).
``ModelRunner`` (``model_runner.py``) makes and consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import TypeVar

import numpy as np
import torch

from nanovllm.context import AttentionMetadata
from nanovllm.engine.sequence import Sequence

Buffer = TypeVar("Buffer", np.ndarray, torch.Tensor)


@dataclass(frozen=True, eq=False)
class PackedArrays:
    """Named arrays of one dtype laid end to end in one flat buffer.

    One buffer means one host-to-device copy for all of them; the names and shapes travel
    with it, so whoever unpacks it (rank 0 after its copy to the device, or a worker that
    received the pickled plan) finds each array by name rather than by offset arithmetic that
    must agree with the packer's."""

    buffer: np.ndarray  # 1-D: the arrays' values, in the order of ``shapes``
    shapes: dict[str, tuple[int, ...]]  # name -> shape, in buffer order

    @classmethod
    def pack(cls, dtype: type | np.dtype, **arrays) -> PackedArrays:
        """Lay ``arrays`` (lists or NumPy arrays, 1-D or 2-D) end to end, in argument order."""
        parts = {name: np.asarray(values, dtype=dtype) for name, values in arrays.items()}
        for name, part in parts.items():
            if part.ndim not in (1, 2):
                raise ValueError(f"field {name!r} has {part.ndim} dimensions, not 1 or 2")
        flat = [part.ravel() for part in parts.values()]
        buffer = np.concatenate(flat) if flat else np.empty(0, dtype)
        return cls(buffer, {name: part.shape for name, part in parts.items()})

    def unpack(self, buffer: Buffer | None = None) -> dict[str, Buffer]:
        """Each field as a view of ``buffer``: this one's, or a copy of it (e.g. on the
        device). A buffer whose length the fields do not add up to is refused."""
        buffer = self.buffer if buffer is None else buffer
        sizes = [prod(shape) for shape in self.shapes.values()]
        if buffer.ndim != 1 or buffer.shape[0] != sum(sizes):
            fields = ", ".join(f"{n} {list(s)}" for n, s in self.shapes.items())
            raise ValueError(f"a buffer of shape {list(buffer.shape)} does not hold the "
                             f"fields {fields} ({sum(sizes)} values)")
        views, start = {}, 0
        for (name, shape), size in zip(self.shapes.items(), sizes):
            view = buffer[start : start + size]
            views[name] = view if len(shape) == 1 else view.reshape(shape)
            start += size
        return views


@dataclass
class StepPlan:
    """One step's model inputs as host arrays: all that a tensor-parallel worker needs."""

    # input_ids, positions, slot_mapping, sample_indices (the rows whose logits are sampled),
    # patch_targets and patch_sources (placeholder tokens that rank 0 fills from its last
    # sampled tokens: where, and from which sampled row)
    longs: PackedArrays
    ints: PackedArrays  # cu_seqlens_q, seq_lens_k, block_tables [num_seqs, width]
    max_seqlen_q: int
    num_decodes: int
    # per prompt_logprobs entry: (first row, positions scored), for the LM-head calls
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    use_graphs: bool = False

    @property
    def num_tokens(self) -> int:
        return self.longs.shapes["input_ids"][0]

    @property
    def num_seqs(self) -> int:
        return self.ints.shapes["seq_lens_k"][0]

    @property
    def num_samples(self) -> int:
        return self.longs.shapes["sample_indices"][0]

    @property
    def has_patches(self) -> bool:
        return self.longs.shapes["patch_targets"][0] > 0


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

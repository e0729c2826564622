"""What one engine step carries between the scheduler, the model runner and its workers.

``pack_step`` lays a step's new tokens end to end with their cache slots (chapter 04);
``StepPlan`` holds them as host arrays, one ``PackedArrays`` buffer per dtype (what a
tensor-parallel worker receives, chapter 09); ``PreparedBatch`` is the step on the device,
``InFlight`` a launched step whose tokens may still be on their way (chapter 11), and
``Unsampled`` one whose sampling waits for its masks (chapter 15).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import TypeVar

import numpy as np
import torch

from nanovllm.context import AttentionMetadata
from nanovllm.engine.sequence import PLACEHOLDER, Sequence

Buffer = TypeVar("Buffer", np.ndarray, torch.Tensor)


@dataclass(frozen=True, eq=False)
class PackedArrays:
    """Named arrays of one dtype laid end to end in one flat buffer: one host-to-device copy
    for all of them. The names and shapes travel with it, so whoever unpacks it (rank 0 on the
    device, or a worker that received the plan) finds each array by name, not by offsets."""

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


# The fields of ``StepPlan.longs`` and ``StepPlan.ints``, in buffer order (``pack_step``'s keys).
LONG_FIELDS = ("input_ids", "positions", "slot_mapping", "sample_indices", "patch_targets",
               "patch_sources")
INT_FIELDS = ("cu_seqlens_q", "seq_lens_k", "block_tables")


def pack_step(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
              in_flight_rows: dict[int, int]) -> dict[str, list]:
    """Lay one step's new tokens end to end, decodes first: the model's inputs, on the host.

    Handout (chapter 04 §1.3, assignment ``04.prepare``). Sequence ``seqs[i]`` computes
    ``n = num_new_tokens[i]`` new tokens this step: positions ``start = num_computed_tokens``
    to ``end - 1 = start + n - 1`` of its ``token_ids``, whose keys and values go to the slots
    of its ``block_table`` (``block_size`` slots per block). ``in_flight_rows`` maps a
    ``seq_id`` to its row among the tokens that the step still in flight samples (async
    scheduling, chapter 11).

    The sequences with ``n == 1`` come first, then the others, each group in batch order;
    "row r" is the r-th sequence of that order. Return a dict with these keys (lists of
    ints unless said otherwise):

    - ``input_ids``, ``positions``, ``slot_mapping`` (one entry per new token, the rows' tokens
      end to end): ``token_ids[p]`` (a ``PLACEHOLDER`` stays as it is), the position ``p``, and
      the slot ``block_table[p // block_size] * block_size + p % block_size``;
    - ``cu_seqlens_q`` [rows + 1]: 0, then the running total of the rows' ``n``;
    - ``seq_lens_k`` [rows]: the tokens each row's attention reads, its own included (``end``);
    - ``block_tables`` [rows, width]: the rows' block tables, each padded with -1 to the
      longest one's length (a NumPy int32 array or a list of equal-length lists);
    - ``sample_indices``: for each row whose new tokens reach its sequence's last token
      (``end == seq.num_tokens``; a chunk that ends mid-prompt is not sampled), in row order,
      the index in ``input_ids`` of that last token: its logits give the next token;
    - ``sample_seqs``: the sequences of those rows, in the same order (a list of ``Sequence``);
    - ``logit_rows`` [len(seqs)], in *batch* order: sequence i's index in ``sample_indices``,
      or -1 when it is not sampled;
    - ``patch_targets``, ``patch_sources``: for each row whose last new token is
      ``PLACEHOLDER`` (sampled by the step in flight, not yet on the host), in row order, that
      token's index in ``input_ids`` and ``in_flight_rows[seq.seq_id]``;
    - ``prompt_logprobs``: for each row whose ``seq.params.prompt_logprobs`` (k) is not None
      and whose new tokens include positions ``p < seq.num_prompt_tokens - 1`` (whose logits
      score the prompt's next token), in row order, a tuple ``(seq, the index in input_ids of
      the row's first token, [those positions p, ascending], k)``.

    ``seqs`` is never empty and ``n >= 1``. This runs every step on the critical path (a
    microsecond or two per sequence at batch 256): plain Python lists and integers, and no
    slices or ranges for the ``n == 1`` rows, which are most rows of most steps.
    """
    # >>> assignment 04.prepare (10 points)
    order = sorted(range(len(seqs)), key=lambda i: num_new_tokens[i] != 1)
    input_ids, positions, slots, cu_q, lens_k, tables = [], [], [], [0], [], []
    logit_rows, sample_from, sample_seqs = [-1] * len(seqs), [], []
    patch_at, patch_from = [], []  # placeholder tokens: where, and which sampled row
    prompt_logprobs = []
    bs = block_size
    for i in order:
        seq, n = seqs[i], num_new_tokens[i]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if seq.token_ids[end - 1] == PLACEHOLDER:  # sampled by the step still in flight
            patch_at.append(len(input_ids) + n - 1)
            patch_from.append(in_flight_rows[seq.seq_id])
        table = seq.block_table
        if n == 1:  # a decode (most rows of most steps): no slices, no ranges
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            scored = list(range(start, min(end, seq.num_prompt_tokens - 1)))
            prompt_logprobs.append((seq, cu_q[-1], scored, seq.params.prompt_logprobs))
        cu_q.append(cu_q[-1] + n)
        lens_k.append(end)
        tables.append(table)
        if end == seq.num_tokens:
            logit_rows[i] = len(sample_from)
            sample_from.append(cu_q[-1] - 1)
            sample_seqs.append(seq)
    padded = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return {
        "input_ids": input_ids, "positions": positions, "slot_mapping": slots,
        "cu_seqlens_q": cu_q, "seq_lens_k": lens_k, "block_tables": padded,
        "sample_indices": sample_from, "sample_seqs": sample_seqs, "logit_rows": logit_rows,
        "patch_targets": patch_at, "patch_sources": patch_from,
        "prompt_logprobs": prompt_logprobs,
    }
    # <<< assignment 04.prepare


@dataclass
class StepPlan:
    """One step's model inputs as host arrays: all that a tensor-parallel worker needs (also
    for a speculative draft pass: one decode token per request, chapter 14)."""

    # LONG_FIELDS: input_ids, positions, slot_mapping, sample_indices (the rows whose logits
    # are sampled), patch_targets and patch_sources (placeholder tokens that rank 0 fills
    # from its last sampled tokens: where, and from which sampled row)
    longs: PackedArrays
    ints: PackedArrays  # INT_FIELDS: cu_seqlens_q, seq_lens_k, block_tables [num_seqs, width]
    max_seqlen_q: int
    num_decodes: int
    # per prompt_logprobs entry: (first row, positions scored), for the LM-head calls
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    use_graphs: bool = False
    # A speculative verify step's LM-head rows (k + 1 per request), used in place of
    # sample_indices (chapter 14): every rank must call the LM head on the same rows.
    verify_rows: list[int] | None = None

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


@dataclass
class Unsampled:
    """A launched step whose forward pass is queued and whose sampling is not yet: under
    async scheduling a constrained request's mask waits for the step before it to land
    (chapter 15, ``structured_output/masks.py``)."""

    step: PreparedBatch
    logits: torch.Tensor  # [num sampled, V] float32 on the device
    sampling: tuple  # SamplingInputs.build's (sampling tensors, logits-processing tensors)
    prompt_logprobs: list[tuple] = field(default_factory=list)  # as prompt_logprobs.py's

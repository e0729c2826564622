"""CUDA graphs for decode steps (chapter 07) and speculative verify steps (chapter 14).

A graph replays a whole decode forward pass with one launch, at fixed addresses and a fixed
batch size: inputs are copied into static buffers, and a batch is padded up to its bucket's
size with rows that write nowhere (slot -1) and attend to nothing (length 0).

A verify step (each request's last token and its k proposals) replays the same graphs, one
row per token (``as_decode_rows``): vLLM v0's "batch expansion". Each layer writes every
token's key and value before any row attends, so the row of position p sees keys 0..p of its
own sequence, the proposals before it included -- what the packed causal pass computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm.config import EngineConfig
from nanovllm.context import AttentionMetadata, attention_metadata

# Verify steps are replayed up to this many rows (tokens): speculation pays at small batches,
# where a step is launch-bound; a larger step runs eagerly, as prompt chunks do.
MAX_VERIFY_ROWS = 1024


def graph_rows(config: EngineConfig) -> int:
    """The rows of the largest captured graph: ``max_num_seqs`` decodes, or with speculation
    ``max_num_seqs`` verify steps of k + 1 tokens (at most ``MAX_VERIFY_ROWS``), within the
    step's token budget."""
    rows = config.max_num_seqs
    spec = config.speculative_config
    if spec is not None:
        rows = max(rows, min(rows * (spec.num_speculative_tokens + 1), MAX_VERIFY_ROWS))
    return min(rows, config.max_num_batched_tokens)


def as_decode_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """The metadata of a step whose sequences each bring consecutive new tokens (decodes,
    verify steps), with every token as a sequence of its own: the token at position p attends
    to its sequence's keys 0..p, through its sequence's block table. No device sync: the host
    lengths come from the host copies."""
    starts, lens = meta.cu_seqlens_q_host, meta.seq_lens_k_host
    counts = [b - a for a, b in zip(starts, starts[1:])]
    rows = torch.as_tensor(counts, device=meta.block_tables.device)
    lens_host = [n - q + 1 + i for n, q in zip(lens, counts) for i in range(q)]
    num_rows = len(lens_host)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        cu_seqlens_q=torch.arange(num_rows + 1, dtype=torch.int32, device=positions.device),
        seq_lens_k=(positions + 1).to(torch.int32),
        block_tables=meta.block_tables.repeat_interleave(rows, dim=0, output_size=num_rows),
        max_seqlen_q=1,
        max_seqlen_k=meta.max_seqlen_k,
        num_decodes=num_rows,
        cu_seqlens_q_host=list(range(num_rows + 1)),
        seq_lens_k_host=lens_host,
    )


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes to capture a graph for, ascending, for at most ``max_batch`` >= 1
    sequences: 1, 2, 4, 8 (those below ``max_batch``), then 16, 32, 48, ... up to the first
    multiple of 16 that holds ``max_batch`` (padding wastes at most ~15 rows); for ``max_batch
    <= 8``, the powers of two below it, then ``max_batch``. So the largest holds ``max_batch``:
    ``batch_buckets(6) == [1, 2, 4, 6]``, ``batch_buckets(40) == [1, 2, 4, 8, 16, 32, 48]``."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch + 16, 16)) if max_batch > 8 else small + [max_batch]


class StaticInputs:
    """The buffers a captured decode graph reads (fixed addresses, sized for the largest
    bucket), and the padding contract that fills them. On a CPU it shows (and tests) the padding."""

    def __init__(self, buckets: list[int], max_blocks: int, device: torch.device) -> None:
        self.buckets = buckets
        top = buckets[-1]
        zeros = lambda *shape, dt=torch.int32: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids = zeros(top, dt=torch.int64)
        self.positions = zeros(top, dt=torch.int64)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = zeros(top)
        self.block_tables = torch.full((top, max_blocks), -1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> int:
        """Copy one decode batch into the buffers, pad it to its bucket; return the bucket.

        Handout (chapter 07 §3-§3.1, assignment ``07.graphs``): the replay side of a captured
        decode step. The graph of bucket ``bs`` was recorded reading rows ``:bs`` of every
        buffer here (``DecodeGraphs._metadata``), and ``DecodeGraphs.run`` replays the graph of
        the bucket this returns. The batch has ``n = len(input_ids)`` decode rows, one token
        each: ``input_ids``, ``positions`` (int64 ``[n]``) and ``meta`` (``slot_mapping``
        ``[n]``, ``seq_lens_k`` int32 ``[n]``, ``block_tables`` int32 ``[n, width]`` with
        ``width <= max_blocks``, padded with -1).

        - Return the smallest bucket ``bs >= n`` of ``self.buckets`` (ascending). ``n`` above
          the largest bucket raises ``ValueError`` (callers ask ``DecodeGraphs.can_run``).
        - Rows ``:n``: ``self.input_ids``, ``self.positions``, ``self.slot_mapping`` and
          ``self.seq_lens`` hold the batch's values; ``self.block_tables[:n, :width]`` holds
          ``meta.block_tables`` (the columns past ``width`` may keep stale values: a kernel
          reads only the ``ceil(seq_len / block_size)`` columns a sequence needs).
        - Padding rows ``n:bs`` must be harmless whatever an earlier, larger batch left in
          them: they write no key (slot -1) and attend to no key (sequence length 0). Their
          token ids, positions and block tables may stay stale: nothing reads them then.
        - Rows past ``bs`` are left as they are (the graph of ``bs`` never reads them); copy
          in place, never rebind a buffer (the graphs hold their addresses).
        """
        # >>> assignment 07.graphs (8 points)
        n = input_ids.shape[0]
        if n > self.buckets[-1]:
            raise ValueError(f"a batch of {n} exceeds the largest graph bucket, {self.buckets[-1]}")
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.seq_lens[:n] = meta.seq_lens_k
        self.seq_lens[n:bs] = 0
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width] = meta.block_tables
        return bs
        # <<< assignment 07.graphs


class DecodeGraphs:
    """Captured decode forward passes, one per batch-size bucket, sharing one memory pool."""

    def __init__(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 max_batch: int, max_blocks: int, block_size: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        """``model(input_ids, positions)`` -> hidden states: the model, or a part of it (a
        self-speculative draft's first layers, chapter 14)."""
        self.model = model
        self.max_len = max_blocks * block_size
        self.buckets = batch_buckets(max_batch)
        self.inputs = StaticInputs(self.buckets, max_blocks, device)
        self.hidden = torch.zeros(self.buckets[-1], hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _metadata(self, bs: int) -> AttentionMetadata:
        inputs = self.inputs
        return AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:bs],
            cu_seqlens_q=inputs.cu_seqlens_q[: bs + 1],
            seq_lens_k=inputs.seq_lens[:bs],
            block_tables=inputs.block_tables[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_len,  # a bound: the real lengths change at every replay
            num_decodes=bs,
            cu_seqlens_q_host=list(range(bs + 1)),
            seq_lens_k_host=[self.max_len] * bs,  # likewise; graph backends read the device copy
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool, ids, positions = None, self.inputs.input_ids, self.inputs.positions
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            graph = torch.cuda.CUDAGraph()
            with attention_metadata(self._metadata(bs)):
                self.model(ids[:bs], positions[:bs])  # warm-up outside capture
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:bs] = self.model(ids[:bs], positions[:bs])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Copy one decode batch (or verify step, a row per token) into the static buffers,
        replay, return its hidden states."""
        if meta.max_seqlen_q > 1:
            meta = as_decode_rows(meta, positions)
        bs = self.inputs.fill(input_ids, positions, meta)
        self.graphs[bs].replay()
        return self.hidden[: input_ids.shape[0]]

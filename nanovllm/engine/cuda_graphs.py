"""CUDA graphs for decode steps (chapter 07).

A decode step of a small model launches hundreds of short kernels; on a fast GPU the CPU
cannot issue them as fast as the GPU runs them. A CUDA graph records the whole forward
pass once and replays it with a single launch. A graph replays exactly what it recorded,
so (1) its inputs live in *static buffers* that each step copies into, and (2) it has a
fixed batch size: we capture one graph per *bucket* (1, 2, 4, 8, 16, 24, 32, ...) and pad a
batch up to the next bucket. Padded rows write their keys nowhere (slot -1) and attend to
nothing (length 0); their outputs are ignored.
"""

from __future__ import annotations

import torch

from nanovllm.context import AttentionMetadata, attention_metadata


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two up to 8, then multiples of 16: padding wastes at most ~15 rows."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch + 16, 16)) if max_batch > 8 else small + [max_batch]


class DecodeGraphs:
    """Captured decode forward passes, one per batch-size bucket, sharing one memory pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.max_len = max_blocks * block_size
        self.buckets = batch_buckets(max_batch)
        top = self.buckets[-1]
        zeros = lambda *shape, dt=torch.int32: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids = zeros(top, dt=torch.int64)
        self.positions = zeros(top, dt=torch.int64)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seq_lens = zeros(top)
        self.block_tables = torch.full((top, max_blocks), -1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens_k=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_len,  # a bound: the real lengths change at every replay
            num_decodes=bs,
            cu_seqlens_q_host=list(range(bs + 1)),
            seq_lens_k_host=[self.max_len] * bs,  # likewise; graph backends read the device copy
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            graph = torch.cuda.CUDAGraph()
            with attention_metadata(self._metadata(bs)):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up outside capture
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Copy one decode batch into the static buffers, replay, return its hidden states."""
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.seq_lens[:n] = meta.seq_lens_k
        self.seq_lens[n:bs] = 0
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width] = meta.block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]

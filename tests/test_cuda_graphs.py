"""The CPU-testable half of CUDA graphs (nanovllm/engine/cuda_graphs.py, chapter 07): which
batch sizes get a graph, and how a batch is copied and padded into the static buffers.
Capture and replay themselves need a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from nanovllm.context import AttentionMetadata
from nanovllm.engine.cuda_graphs import StaticInputs, batch_buckets


@pytest.mark.assignment("07.buckets")
def test_bucket_examples():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(9) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


@pytest.mark.assignment("07.buckets")
def test_buckets_hold_every_batch_with_bounded_padding():
    for max_batch in range(1, 300):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[0] == 1, buckets
        assert buckets[-1] >= max_batch, (max_batch, buckets)
        for n in range(1, max_batch + 1):
            smallest = next(b for b in buckets if b >= n)
            assert smallest - n <= (15 if n > 8 else n - 1), (max_batch, n, smallest)


def _batch(n, width, seed):
    gen = torch.Generator().manual_seed(seed)
    meta = AttentionMetadata(
        slot_mapping=torch.randint(0, 1000, (n,), generator=gen),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_k=torch.randint(1, 300, (n,), generator=gen, dtype=torch.int32),
        block_tables=torch.randint(0, 60, (n, width), generator=gen, dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=300,
        num_decodes=n,
        cu_seqlens_q_host=list(range(n + 1)),
        seq_lens_k_host=[0] * n,
    )
    ids = torch.randint(0, 50_000, (n,), generator=gen)
    return ids, torch.randint(0, 300, (n,), generator=gen), meta


@pytest.mark.assignment("07.pad")
def test_fill_copies_the_batch_and_pads_to_its_bucket():
    inputs = StaticInputs([1, 2, 4, 8, 16], max_blocks=6, device=torch.device("cpu"))
    for n, width in [(16, 6), (11, 4), (3, 2), (4, 6), (1, 1)]:  # shrinking: stale rows remain
        ids, positions, meta = _batch(n, width, seed=n)
        bs = inputs.fill(ids, positions, meta)
        assert bs == next(b for b in [1, 2, 4, 8, 16] if b >= n), (n, bs)
        assert torch.equal(inputs.input_ids[:n], ids)
        assert torch.equal(inputs.positions[:n], positions)
        assert torch.equal(inputs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(inputs.seq_lens[:n], meta.seq_lens_k)
        assert torch.equal(inputs.block_tables[:n, :width], meta.block_tables)
        assert (inputs.slot_mapping[n:bs] == -1).all(), f"padding rows must store nothing (n={n})"
        assert (inputs.seq_lens[n:bs] == 0).all(), f"padding rows must attend to nothing (n={n})"


@pytest.mark.assignment("07.pad")
def test_fill_of_a_full_bucket_pads_nothing():
    inputs = StaticInputs([1, 2, 4, 8], max_blocks=3, device=torch.device("cpu"))
    for n in (8, 4, 2, 1):
        ids, positions, meta = _batch(n, 3, seed=10 + n)
        before = inputs.slot_mapping.clone()
        assert inputs.fill(ids, positions, meta) == n
        assert torch.equal(inputs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(inputs.slot_mapping[n:], before[n:]), "rows past the bucket changed"
        assert torch.equal(inputs.block_tables[:n], meta.block_tables)

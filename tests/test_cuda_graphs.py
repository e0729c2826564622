"""The CPU-testable half of CUDA graphs (nanovllm/engine/cuda_graphs.py, chapter 07): which
batch sizes get a graph, and how a batch is copied and padded into the static buffers
(``StaticInputs.fill``, graded as ``07.graphs``). Capture and replay themselves need a GPU
(tests/test_gpu.py); here a stand-in graph reruns the recorded step on the buffers it was
"captured" with, which is what a replay does, so the padding contract can be checked on CPU."""

from __future__ import annotations

import pytest
import torch

from nanovllm.context import AttentionMetadata, attention_metadata, get_attention_metadata
from nanovllm.engine.cuda_graphs import DecodeGraphs, StaticInputs, batch_buckets


def test_bucket_examples():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(9) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


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


@pytest.mark.assignment("07.graphs")
def test_fill_picks_the_smallest_bucket_that_holds_the_batch():
    gen = torch.Generator().manual_seed(1)
    for buckets in (batch_buckets(40), [1, 3, 10, 24], [5]):
        inputs = StaticInputs(buckets, max_blocks=4, device=torch.device("cpu"))
        sizes = torch.randint(1, buckets[-1] + 1, (12,), generator=gen).tolist() + [buckets[-1]]
        for n in sizes:
            ids, positions, meta = _batch(n, int(torch.randint(1, 5, (1,), generator=gen)), n)
            expected = min(b for b in buckets if b >= n)
            assert inputs.fill(ids, positions, meta) == expected, (buckets, n)
        ids, positions, meta = _batch(buckets[-1] + 1, 2, seed=0)
        with pytest.raises(ValueError):
            inputs.fill(ids, positions, meta)


@pytest.mark.assignment("07.graphs")
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


@pytest.mark.assignment("07.graphs")
def test_fill_of_a_full_bucket_pads_nothing():
    inputs = StaticInputs([1, 2, 4, 8], max_blocks=3, device=torch.device("cpu"))
    for n in (8, 4, 2, 1):
        ids, positions, meta = _batch(n, 3, seed=10 + n)
        before = inputs.slot_mapping.clone()
        assert inputs.fill(ids, positions, meta) == n
        assert torch.equal(inputs.slot_mapping[:n], meta.slot_mapping)
        assert torch.equal(inputs.slot_mapping[n:], before[n:]), "rows past the bucket changed"
        assert torch.equal(inputs.block_tables[:n], meta.block_tables)


# ----------------------------------------------------------------------------- replay on CPU

BLOCK, NUM_BLOCKS = 4, 64


class ToyStep(torch.nn.Module):
    """A decode forward pass reduced to what padding can break: each row writes one value to
    the cache at its slot (skipping slot -1, as ``store_kv`` does) and reads back the values of
    its ``seq_len`` keys through its block table (as the decode kernels do); it records the
    slots each row read."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = torch.zeros(NUM_BLOCKS * BLOCK)
        self.read: dict[int, list[int]] = {}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        keep = meta.slot_mapping >= 0
        self.cache[meta.slot_mapping[keep]] = (ids * 1000 + positions)[keep].float()
        out = torch.zeros(len(ids), 1)
        for b in range(len(ids)):
            t = torch.arange(int(meta.seq_lens_k[b]))
            slots = meta.block_tables[b, t // BLOCK].long() * BLOCK + t % BLOCK
            self.read[b] = slots.tolist()
            out[b] = self.cache[slots].sum()
        return out


class ReplayOnCPU:
    """Stands in for a captured graph: replays the step on the views it was captured with."""

    def __init__(self, graphs: DecodeGraphs, bs: int) -> None:
        self.graphs, self.bs, self.meta = graphs, bs, graphs._metadata(bs)
        self.ids, self.positions = graphs.inputs.input_ids[:bs], graphs.inputs.positions[:bs]

    def replay(self) -> None:
        with attention_metadata(self.meta):
            self.graphs.hidden[: self.bs] = self.graphs.model(self.ids, self.positions)


def _decode_batch(lens, tables):
    """Each sequence's next token sits at key ``len - 1``, in the block its table names."""
    lens_t = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor([int(tables[b][(n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                          for b, n in enumerate(lens)])
    width = max(len(row) for row in tables)
    block_tables = torch.tensor([row + [-1] * (width - len(row)) for row in tables],
                                dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots, cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens_k=lens_t, block_tables=block_tables, max_seqlen_q=1, max_seqlen_k=max(lens),
        num_decodes=len(lens), cu_seqlens_q_host=list(range(len(lens) + 1)),
        seq_lens_k_host=list(lens),
    )
    ids = torch.randint(1, 500, (len(lens),))
    return ids, lens_t.long() - 1, meta


@pytest.mark.assignment("07.graphs")
def test_replay_of_a_padded_batch_touches_only_its_real_rows(monkeypatch):
    """Steps of shrinking batches through ``DecodeGraphs.run``: a larger batch leaves its slots,
    lengths and tables in the buffers, then a smaller one is padded over them. Each replay must
    write the cache exactly where the batch run eagerly (unpadded) writes it, read only keys of
    the batch's own sequences, and return the eager outputs."""
    monkeypatch.setattr(
        DecodeGraphs, "_capture_all",
        lambda self: self.graphs.update({bs: ReplayOnCPU(self, bs) for bs in self.buckets}),
    )
    torch.manual_seed(3)
    model, eager = ToyStep(), ToyStep()
    graphs = DecodeGraphs(model, max_batch=16, max_blocks=6, block_size=BLOCK, hidden_size=1,
                          device=torch.device("cpu"), dtype=torch.float32)
    for n in (13, 9, 5, 3, 1, 6):  # buckets 16, 16, 8, 4, 1, 8
        lens = torch.randint(1, 3 * BLOCK + 1, (n,)).tolist()  # <= 3 blocks: 13 x 3 <= 64
        blocks, tables = torch.randperm(NUM_BLOCKS).tolist(), []
        for length in lens:
            need = -(-length // BLOCK)
            tables.append(blocks[:need])
            blocks = blocks[need:]
        ids, positions, meta = _decode_batch(lens, tables)
        out = graphs.run(ids, positions, meta)
        with attention_metadata(meta):
            expected = eager(ids, positions)
        assert torch.equal(model.cache, eager.cache), f"a padding row wrote the cache (n={n})"
        padding = {b: slots for b, slots in model.read.items() if b >= n and slots}
        assert not padding, f"padding rows read keys (n={n}): {padding}"
        assert all(model.read[b] == eager.read[b] for b in range(n)), n
        assert out.shape == (n, 1) and torch.equal(out, expected), n
        model.read.clear()

"""The analysis questions of the second half of the book, from CUDA graphs to troubleshooting
(the registry and the first half: :mod:`nanovllm.course.analysis_questions`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from nanovllm.course.analysis_questions import _gen, _shared_prompt_blocks, _simulate, question


# -- 07: CUDA graphs --------------------------------------------------------------------------
def _padding(n: int, max_batch: int) -> int:
    import torch

    from nanovllm.context import AttentionMetadata
    from nanovllm.engine.cuda_graphs import StaticInputs, batch_buckets

    inputs = StaticInputs(batch_buckets(max_batch), 2, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_k=torch.ones(n, dtype=torch.int32), block_tables=torch.zeros(n, 2,
        dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=1, num_decodes=n,
        cu_seqlens_q_host=list(range(n + 1)), seq_lens_k_host=[1] * n)
    return inputs.fill(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                       meta) - n


@question("07.q1", """Graphs captured for max batch 64: what fraction of the replayed batch is
padding when 37 sequences decode?""", "fraction", 1e-3)
def _padding_37() -> float:
    return _padding(37, 64) / (37 + _padding(37, 64))


@question("07.q2", """Graphs captured for max batch 256: over every batch size 1..256, what is the
most padding rows one replay carries?""", "rows")
def _most_padding() -> float:
    return max(_padding(n, 256) for n in range(1, 257))


# -- 08: quantization -------------------------------------------------------------------------
def _sqnr(w, quantize, columns=slice(None)) -> float:
    from nanovllm.layers.quantization.scales import dequantize

    error = (w - dequantize(*quantize(w)))[:, columns]
    return 10 * math.log10(float((w[:, columns] ** 2).sum()) / float((error**2).sum()))


@question("08.q1", """SQNR (signal-to-quantization-noise ratio) in dB of int8 per-channel
quantization of a 256 x 256 N(0, 1) matrix (torch seed 0)?""", "dB", 0.05)
def _sqnr_int8() -> float:
    import torch

    from nanovllm.layers.quantization.scales import quantize_int8

    return _sqnr(torch.randn(256, 256, generator=_gen()), quantize_int8)


@question("08.q2", """The same matrix with fp8 e4m3 per-row scales: SQNR in dB?""", "dB", 0.05)
def _sqnr_fp8() -> float:
    import torch

    from nanovllm.layers.quantization.scales import quantize_fp8

    return _sqnr(torch.randn(256, 256, generator=_gen()), quantize_fp8)


@question("08.q3", """The int8 matrix again, but every row's first entry is set to 100 (an outlier
channel of the input). SQNR in dB of the other 255 columns?""", "dB", 0.05)
def _sqnr_outlier() -> float:
    import torch

    from nanovllm.layers.quantization.scales import quantize_int8

    w = torch.randn(256, 256, generator=_gen())
    w[:, 0] = 100.0
    return _sqnr(w, quantize_int8, columns=slice(1, None))


# -- 09: tensor parallelism -------------------------------------------------------------------
def _as_rank(rank: int, size: int):
    from nanovllm import distributed

    saved = dict(distributed._state)
    distributed._state.update(rank=rank, size=size)
    return lambda: distributed._state.update(saved)


@question("09.q1", """A column-parallel layer with 1536 output features at TP = 4: which row of
the checkpoint's weight does rank 2's first row hold?""", "row index")
def _column_row() -> float:
    import torch

    from nanovllm.layers.linear import ColumnParallelLinear

    restore = _as_rank(2, 4)
    try:
        layer = ColumnParallelLinear(2, 1536)
        layer.weight.weight_loader(layer.weight, torch.arange(1536.0)[:, None].repeat(1, 2))
    finally:
        restore()
    return float(layer.weight[0, 0])


@question("09.q2", """A row-parallel layer with 1536 input features at TP = 4: which column of the
checkpoint's weight does rank 3's first column hold?""", "column index")
def _row_column() -> float:
    import torch

    from nanovllm.layers.linear import RowParallelLinear

    restore = _as_rank(3, 4)
    try:
        layer = RowParallelLinear(1536, 2)
        layer.weight.weight_loader(layer.weight, torch.arange(1536.0)[None, :].repeat(2, 1))
    finally:
        restore()
    return float(layer.weight[0, 0])


@question("09.q3", """SmolLM2's 49152-token vocabulary embedded at TP = 5: of all 49152 token ids,
how many does the last rank (rank 4) look up itself (its partial sum is nonzero)?""", "tokens")
def _last_rank_tokens() -> float:
    import torch

    from nanovllm.layers import embed_head
    from nanovllm.layers.embed_head import VocabParallelEmbedding

    restore, reduce = _as_rank(4, 5), embed_head.all_reduce
    embed_head.all_reduce = lambda x: x  # this rank's partial result, before the sum
    try:
        layer = VocabParallelEmbedding(49152, 2)
        layer.weight.weight_loader(layer.weight, torch.ones(49152, 2))
        out = layer(torch.arange(49152))
    finally:
        embed_head.all_reduce = reduce
        restore()
    return int((out != 0).any(dim=-1).sum())


# -- 10: serving ------------------------------------------------------------------------------
def _bucket(events):
    """A token bucket of 60 tokens refilled at 1 token/s on a fake clock; ``events`` is a list
    of (time, tokens taken); returns (bucket, clock) after them."""
    from nanovllm.serve.admission import TokenBucket

    clock = SimpleNamespace(now=0.0)
    bucket = TokenBucket(1.0, 60.0, clock=lambda: clock.now)
    for t, amount in events:
        clock.now = t
        bucket.take(amount)
    return bucket, clock


@question("10.q1", """A key's bucket holds 60 tokens and refills at 1 token/s. A request takes 100
tokens at t = 0 (a debt). At t = 10 s, how many seconds must the next 30-token request
wait?""", "seconds", 1e-3)
def _debt_wait() -> float:
    bucket, clock = _bucket([(0.0, 100)])
    clock.now = 10.0
    return bucket.wait_time(30)


@question("10.q2", """The same key then idles until t = 1000 s. How many tokens does its bucket
hold?""", "tokens", 1e-3)
def _idle_level() -> float:
    bucket, clock = _bucket([(0.0, 100)])
    clock.now = 1000.0
    bucket.wait_time(0)
    return bucket.level


# -- 11: performance (async scheduling) -------------------------------------------------------
@question("11.q1", """Async scheduling, one request with an 8-token prompt whose first output
token is EOS. How many tokens does the engine compute in all (every launched step's tokens)?""",
          "tokens")
def _async_waste() -> float:
    _, steps = _simulate([8], 16, async_scheduling=True, eos=(2,))
    return sum(b.num_tokens for b in steps)


@question("11.q2", """Async scheduling, four requests of 8-token prompts, max_tokens 6: after each
step's update, how many placeholder tokens are there at most, over all requests?""", "tokens")
def _placeholders() -> float:
    from nanovllm.engine.sequence import PLACEHOLDER

    counts = []
    _simulate([8] * 4, 6, async_scheduling=True, after_step=lambda sched: counts.append(
        sum(s.token_ids.count(PLACEHOLDER) for s in sched.requests.values())))
    return max(counts)


# -- 12: long context and new models ----------------------------------------------------------
@question("12.q1", """A sliding window of 8 keys over a 20-token prompt: how many (query, key)
pairs may attend?""", "pairs")
def _window_pairs() -> float:
    from nanovllm.layers.torch_attention import sliding_window_mask

    return int(sliding_window_mask(20, 20, 8).sum())


@question("12.q2", """A Phi-3 model with 40 heads, 10 KV heads of dimension 128: how many rows of
its fused qkv_proj weight go to k_proj?""", "rows")
def _phi3_k_rows() -> float:
    import torch

    from nanovllm.models.phi3 import Phi3ForCausalLM

    config = SimpleNamespace(num_heads=40, num_kv_heads=10, head_dim=128, intermediate_size=64)
    pieces = Phi3ForCausalLM.split_fused_tensor(
        SimpleNamespace(config=config), "model.layers.0.self_attn.qkv_proj.weight",
        torch.zeros(40 * 128 + 2 * 10 * 128, 1))
    return dict(pieces)["model.layers.0.self_attn.k_proj.weight"].shape[0]


# -- 13: troubleshooting ----------------------------------------------------------------------
@question("13.q1", """Chapter 04's three requests (a shared 40-token system prompt, 10 tokens each,
block size 16, prefix caching on) are allocated; then the second is dropped from the engine
without being freed. How many problems does check_refcounts report?""", "problems")
def _leak_problems() -> float:
    from nanovllm.engine.invariants import check_refcounts

    bm, seqs = _shared_prompt_blocks(True, keep=True)
    return len(check_refcounts(bm, [seqs[0], seqs[2]]))


@question("13.q2", """The same three requests, but the third is freed while the engine still runs
it (it stays a holder of the blocks it listed): how many problems does check_refcounts
report?""", "problems")
def _freed_holder_problems() -> float:
    from nanovllm.engine.invariants import check_refcounts

    bm, seqs = _shared_prompt_blocks(True, keep=True)
    table = list(seqs[2].block_table)
    bm.free(seqs[2])
    seqs[2].block_table = table  # a live request whose blocks were given back
    return len(check_refcounts(bm, seqs))

# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 09 — Tensor parallelism
#
# One GPU has a fixed amount of memory and a fixed memory bandwidth. A model whose weights do
# not fit cannot run on it at all, and a model that fits with little room left holds a small
# KV cache, so few sequences run at once (chapter 04). **Tensor parallelism** (TP) splits every
# weight matrix of the model across $N$ GPUs: each holds $1/N$ of the weights and $1/N$ of
# every token's KV cache, and reads only its own share at each step. The GPUs then work on the
# same tokens at the same time and exchange partial results: twice per transformer layer, an
# **all-reduce** sums them.
#
# The chapter starts from the memory and bandwidth a GPU needs for Qwen3-8B and Qwen3-32B. It
# splits a matmul by columns and by rows by hand and proves both equal to the full matmul,
# then simulates an all-reduce, and splits the embedding and the LM head over the vocabulary.
# Then the package's layers, proved equal to the full model by running every rank in this
# one process; the engine at TP=2 live on this CPU, two processes talking over gloo, giving
# the same greedy tokens as one; and the price: all-reduce latency, the per-step control
# message from rank 0 to the workers, and a cost model of both against a two-H200 record.
#
# Package modules taught here: `nanovllm/distributed.py` (the rank state, `all_reduce`,
# `all_gather_last_dim`, `broadcast_object`), `nanovllm/layers/linear.py` (column-, row-,
# QKV- and merged-column-parallel layers with their sharding weight loaders),
# `nanovllm/layers/embed_head.py` (the vocab-parallel embedding and LM head),
# `nanovllm/engine/executor.py` and `nanovllm/engine/worker.py` (rank 0 starts the workers
# and sends each step's `StepPlan`), `nanovllm/engine/shm_broadcast.py` (the shared-memory
# queue that carries it), and `nanovllm/benchmarks/tensor_parallel.py` and
# `nanovllm/benchmarks/control_plane.py` (the measurements). `EngineConfig` switches it on with vLLM's name: `tensor_parallel_size=N`.
#
# On a 2-core CPU the chapter runs (its time: the book's runtime table); the GPU numbers come
# from a record (section 7).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(9)

# %% [markdown]
# **Builds on:** Megatron-LM's tensor parallelism {cite}`shoeybi2019megatron`. The references are
# collected in the book's bibliography.

# %% [markdown]
# ## Setup
#
# Everything runs on the CPU, in float64 for the proofs and float32 for the engines, so
# that the printed results are the same on every machine. One thread, as in chapters 03 and
# 06: tiny matmuls on two shared cores run faster without OpenMP threads competing.
# `as_rank(r, n)` makes this process believe it is rank `r` of `n` while a layer is built,
# loaded and run; `simulated_collectives()` replaces the layers' all-reduce and all-gather
# by functions that record what each rank would send, so we can add up the ranks ourselves.

# %%
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams, distributed
from nanovllm.benchmarks import control_plane
from nanovllm.benchmarks.tensor_parallel import allreduce_sweep
from nanovllm.configs import config_path
from nanovllm.layers import embed_head, linear
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style
from nanovllm.viz.records import current, headline

torch.set_num_threads(1)
use_book_style()
DATA = figures_dir() / "data"
chapter_start = time.perf_counter()


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``size`` in this process (the state the layers read)."""
    saved = dict(distributed._state)
    distributed._state.update(rank=rank, size=size)
    try:
        yield
    finally:
        distributed._state.update(saved)


@contextmanager
def simulated_collectives() -> Iterator[list]:
    """The layers' collectives become identities that record their inputs (in call order)."""
    sent, saved = [], (linear.all_reduce, embed_head.all_reduce, embed_head.all_gather_last_dim)

    def record(x: torch.Tensor) -> torch.Tensor:
        sent.append(x.clone())
        return x

    # the layer modules imported these functions by name: patch them there
    linear.all_reduce = embed_head.all_reduce = embed_head.all_gather_last_dim = record
    try:
        yield sent
    finally:
        linear.all_reduce, embed_head.all_reduce, embed_head.all_gather_last_dim = saved


def same(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-12) -> None:
    """Print whether max |ours - ref| <= tol * max |ref| (a yes/no, the same on every machine)."""
    err = (ours.double() - ref.double()).abs().max().item()
    print(f"{name}: equal within {tol:g} (relative): {err <= tol * ref.abs().max().item()}")


# %% [markdown]
# ## 1. Why: memory and bandwidth per GPU
#
# We build Qwen3-8B and Qwen3-32B as the package builds them on rank $r$ of $N$, on PyTorch's
# `meta` device (shapes, no memory), and add up the bytes of one rank's parameters in bf16.
# The 32B shape is not shipped with the package; its `config.json` differs from the 8B's in
# five numbers, copied from the Hugging Face release (Qwen/Qwen3-32B). A rank also holds
# $1/N$ of the KV heads, so $1/N$ of every token's cache:

# %%
# NBVAL_CHECK_OUTPUT
QWEN3_32B = {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64, "num_key_value_heads": 8}
shape_dir = Path(tempfile.mkdtemp(prefix="ch09-shapes-"))
(shape_dir / "qwen3-32b").mkdir()
config_32b = json.loads((config_path("qwen3-8b") / "config.json").read_text()) | QWEN3_32B
(shape_dir / "qwen3-32b" / "config.json").write_text(json.dumps(config_32b))
SHAPES = {"qwen3-8b": config_path("qwen3-8b"), "qwen3-32b": shape_dir / "qwen3-32b"}


def rank_bytes(path: Path, n: int) -> tuple[ModelConfig, int]:
    """bf16 bytes of rank 0's parameters when the model is split over ``n`` ranks."""
    cfg = ModelConfig.from_pretrained(path)
    with as_rank(0, n), torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg).to(torch.bfloat16)
    return cfg, sum(p.numel() * p.element_size() for p in model.parameters())


H200_GB = 141e9 * 0.9  # what an engine may use of an H200 (gpu_memory_utilization 0.9)
per_rank = {(s, n): rank_bytes(p, n) for s, p in SHAPES.items() for n in (1, 2, 4, 8)}
print(f"{'model':10s} {'N':>2s} {'weights GB/GPU':>15s} {'KV kB/token/GPU':>16s} "
      f"{'KV tokens that fit':>19s}")
for (s, n), (cfg, nbytes) in per_rank.items():
    kv_token = cfg.kv_bytes_per_token(2) / n  # bf16 K and V, this rank's KV heads
    free = H200_GB - nbytes
    fit = f"{free / kv_token / 1e6:.2f} M" if free > 0 else "does not fit"
    print(f"{s:10s} {n:2d} {nbytes / 1e9:15.2f} {kv_token / 1e3:16.1f} {fit:>19s}")

# %% [markdown]
# Qwen3-32B in bf16 weighs about 66 GB: it fits one H200 but leaves room for fewer tokens of
# cache than one GPU holds for the 8B model with all its weights, and at $N=2$ each GPU has
# about twice the room *and* each token costs it half as much, so the cache holds about
# three times the tokens of $N=1$. The table makes the second argument too: every number per
# GPU falls as $1/N$, including the bytes a decode step must read. With the H200 copy
# bandwidth (the book's one record of it, `nanovllm/viz/records.py`), the weights alone bound a
# decode step below by:

# %%
# NBVAL_CHECK_OUTPUT
bandwidth = headline("h200_copy_bytes_per_s")
print(f"H200 copy bandwidth: {current('h200_copy_bytes_per_s')}")
for s in SHAPES:
    bounds = ", ".join(f"N={n}: {per_rank[s, n][1] / bandwidth * 1e3:5.2f} ms"
                       for n in (1, 2, 4, 8))
    print(f"{s:10s} weights read per decode step, per GPU -> {bounds}")

# %% [markdown]
# Those are bounds, reached only if the GPUs never wait for each other. Everything below is
# about what the split costs: which matrices can be split without changing the result, and
# what the ranks must exchange.
#
# ## 2. Splitting a matmul by hand
#
# A linear layer computes $Y = X W^\top$, with $X$ `[tokens, in]` and $W$ `[out, in]` (the
# checkpoint layout). Two ways to split $W$ over $N$ ranks.
#
# **By output features** ("column-parallel": the columns of $W^\top$, i.e. rows of $W$):
# rank $r$ holds rows $W_r$ `[out/N, in]` and computes $Y_r = X W_r^\top$, the columns
# $r\cdot out/N \ldots$ of $Y$. Every rank needs the whole $X$; the outputs are concatenated.
#
# **By input features** ("row-parallel": rows of $W^\top$): rank $r$ holds columns
# $W_{:,r}$ `[out, in/N]` and the matching columns $X_{:,r}$ of the input, and computes a
# **partial sum** $P_r = X_{:,r} W_{:,r}^\top$ `[tokens, out]`, since
# $Y = \sum_r X_{:,r} W_{:,r}^\top$ (the dot product over `in` split into $N$ pieces). The
# ranks add their $P_r$: an all-reduce.
#
# In float64, with fresh random inputs:

# %%
# NBVAL_CHECK_OUTPUT
gen = torch.Generator().manual_seed(9)
N, T, IN, OUT = 4, 5, 32, 24
X = torch.randn(T, IN, generator=gen, dtype=torch.float64)
W = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
Y = X @ W.T

column_parts = [X @ W_r.T for W_r in W.chunk(N, dim=0)]  # each rank: out/N outputs
same("by columns, concatenated", torch.cat(column_parts, dim=1), Y)
row_parts = [X_r @ W_r.T for X_r, W_r in zip(X.chunk(N, dim=1), W.chunk(N, dim=1))]
same("by rows, summed", sum(row_parts), Y)
print("each partial sum alone is far from Y:",
      all((P - Y).abs().max() > 1 for P in row_parts))

# %% [markdown]
# Equal, not bit-identical: the sum over `in` runs in another order, so the last bits may
# differ (in float64, by about $10^{-15}$; in bf16 the difference is visible, which is why
# the engine's TP=2 logits differ from TP=1's in the last digits and section 6 compares
# greedy tokens in float32).
#
# The trick of Megatron-LM (Shoeybi et al., 2019) is to **pair** the two splits. A
# column-parallel layer leaves each rank with a slice of the features, which is exactly the
# input slice a row-parallel layer wants: no communication between them. An MLP,
# $\mathrm{down}(\mathrm{silu}(\mathrm{gate}(x)) \cdot \mathrm{up}(x))$, splits `gate` and `up`
# by columns, and the elementwise SiLU and product work on each rank's slice on its own;
# `down` splits by rows; one all-reduce at the end. Attention does the same with heads:
# $q$, $k$, $v$ split by heads (columns), each rank attends with its own heads, and the
# output projection `o_proj` splits by rows: one all-reduce. **Two all-reduces per layer**.

# %%
# NBVAL_CHECK_OUTPUT
HIDDEN, INTER = 16, 48
x = torch.randn(T, HIDDEN, generator=gen, dtype=torch.float64)
gate, up = (torch.randn(INTER, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(2))
down = torch.randn(HIDDEN, INTER, generator=gen, dtype=torch.float64)
full_mlp = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
partials = [(F.silu(x @ g.T) * (x @ u.T)) @ d.T  # rank r: its slices, no communication
            for g, u, d in zip(gate.chunk(N), up.chunk(N), down.chunk(N, dim=1))]
same(f"MLP split over {N} ranks, one sum at the end", sum(partials), full_mlp)

# %% [markdown]
# ## 3. All-reduce
#
# An all-reduce takes one tensor from each of $N$ ranks and leaves **every** rank with their
# elementwise sum. The obvious way, everyone sends everything to rank 0 which sends the sum
# back, makes rank 0 move $2(N-1)$ messages while the others wait. NCCL's ring algorithm
# cuts each tensor into $N$ chunks and passes chunks around a ring: in $N-1$
# **reduce-scatter** steps each rank sends one chunk to its neighbour, which adds it to its
# own, until every chunk's full sum sits on one rank; in $N-1$ **all-gather** steps the sums
# travel around the ring. Every rank sends $2(N-1)/N$ of the tensor, whatever $N$: the
# ring uses every link at once. That fraction is why NCCL (and the benchmark of section 7)
# reports "bus bandwidth" $= 2(N-1)/N \cdot \text{bytes}/\text{time}$.
#
# Simulated in one process, with a list for the ranks:

# %%
# NBVAL_CHECK_OUTPUT
def ring_all_reduce_sim(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Ring all-reduce of one 1-D tensor per rank; returns the results and elements sent."""
    n = len(tensors)
    chunks = [list(t.clone().chunk(n)) for t in tensors]
    sent = 0
    for step in range(n - 1):  # reduce-scatter: rank r sends chunk (r - step) to r + 1
        outgoing = [(r, (r - step) % n, chunks[r][(r - step) % n].clone()) for r in range(n)]
        for r, c, data in outgoing:
            chunks[(r + 1) % n][c] += data
            sent += data.numel()
    for step in range(n - 1):  # all-gather: rank r passes on the full chunk (r + 1 - step)
        outgoing = [(r, (r + 1 - step) % n, chunks[r][(r + 1 - step) % n].clone())
                    for r in range(n)]
        for r, c, data in outgoing:
            chunks[(r + 1) % n][c] = data
            sent += data.numel()
    return [torch.cat(c) for c in chunks], sent


for n in (2, 4, 8):
    ranks = [torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(n)]
    results, sent = ring_all_reduce_sim(ranks)
    ok = all(torch.allclose(r, sum(ranks), rtol=0, atol=1e-12) for r in results)
    print(f"N={n}: every rank holds the sum: {ok}; each rank sent {sent // n} of 64 elements "
          f"= 2(N-1)/N x 64 = {2 * (n - 1) * 64 // n}")

# %% [markdown]
# ## 4. The embedding and the LM head, split over the vocabulary
#
# The two largest matrices of a small model are the embedding and the LM head, `[vocab,
# hidden]` each (151,936 × 1,024 for Qwen3-0.6B). Both are split by vocabulary rows: rank $r$
# holds the rows of token ids $[r\,s, (r+1)\,s)$, with $s = \lceil V/N \rceil$ (the last
# shard is padded with zero rows).
#
# **The embedding** is a lookup: each token's row lives on exactly one rank. Each rank looks
# up the tokens it owns, writes zeros for the others, and an all-reduce (a sum) gives every
# rank every token's row. The local ids of tokens a rank does not own are out of range, so
# they are clamped into range before the lookup and their rows zeroed after.
#
# **The LM head** multiplies the hidden state by the vocabulary matrix: a column-parallel
# layer (vocabulary = output features). Each rank computes the logits of its own tokens, and
# an **all-gather** concatenates them; the padding columns are cut off. By hand:

# %%
# NBVAL_CHECK_OUTPUT
V, H = 10, 6
table = torch.randn(V, H, generator=gen, dtype=torch.float64)
ids = torch.tensor([0, 9, 3, 4, 7, 7])
s = -(-V // 3)  # ceil(V / N) for N = 3: shards of 4, 4 and 2 (+ 2 padding rows)
shards = [F.pad(table[r * s:(r + 1) * s], (0, 0, 0, s - len(table[r * s:(r + 1) * s])))
          for r in range(3)]
contributions = []
for r, shard in enumerate(shards):
    local = ids - r * s
    owned = (local >= 0) & (local < s)
    contributions.append(F.embedding(local.clamp(0, s - 1), shard) * owned[:, None])
    print(f"rank {r} owns ids {r * s}..{r * s + s - 1}: looks up {ids[owned].tolist()}")
same("embedding: sum over ranks", sum(contributions), F.embedding(ids, table))
hidden = torch.randn(2, H, generator=gen, dtype=torch.float64)
logits = torch.cat([hidden @ shard.T for shard in shards], dim=-1)[:, :V]
same("LM head: concatenated logits", logits, hidden @ table.T)

# %% [markdown]
# In the engine every rank computes its logit slice, and the gathered logits are sampled
# on rank 0 alone; the workers only take part in the all-gather. (vLLM by default gathers
# to rank 0 only; this package gathers to every rank, which is simpler and on two GPUs
# costs about the same.)
#
# ## 5. The package's layers, and a proof that they agree
#
# `nanovllm/layers/linear.py`: each layer allocates its shard's shape at construction
# (`output_size // tp_size()` or `input_size // tp_size()`) and carries a `weight_loader` that
# takes the **full** checkpoint tensor and copies in this rank's slice, so the checkpoint
# loader (chapter 01) stays one generic loop for every $N$. The row-parallel layer's
# `forward` is the only place with an all-reduce; its bias is added once, after it:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(ColumnParallelLinear, RowParallelLinear)

# %% [markdown]
# The packed projections of chapter 01 shard *each part*: `QKVParallelLinear` gives rank $r$
# its q heads, then its k heads, then its v heads (with grouped-query attention the KV heads
# are split too, so $N$ must divide both head counts), and `MergedColumnParallelLinear` its
# slice of `gate`, then of `up`. The vocabulary layers, and the collectives in
# `nanovllm/distributed.py`, which are no-ops at $N=1$:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(QKVParallelLinear.weight_loader, VocabParallelEmbedding, ParallelLMHead,
            distributed.all_reduce, distributed.all_gather_last_dim)

# %% [markdown]
# The proof: every rank of $N=4$ in this process. Each builds its layers under `as_rank`,
# loads them from the full float64 tensors of section 2 through the weight loaders, and runs
# its part; `simulated_collectives` records what each rank sends to the all-reduce, and we
# add up (or concatenate) ourselves. The MLP is built from the package's pieces, as
# `nanovllm/models/llama.py` builds it: `MergedColumnParallelLinear` for gate and up,
# `SiluAndMul`, and `RowParallelLinear` for down.

# %%
# NBVAL_CHECK_OUTPUT
def load(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    """What the checkpoint loader does for one tensor: call the parameter's loader."""
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


columns, mlp_sums = [], None
with simulated_collectives() as sent:
    for r in range(N):
        with as_rank(r, N):
            col = ColumnParallelLinear(IN, OUT).double()
            load(col.weight, W)
            columns.append(col(X))
            gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER]).double()
            load(gate_up.weight, gate, 0)
            load(gate_up.weight, up, 1)
            down_proj = RowParallelLinear(INTER, HIDDEN).double()
            load(down_proj.weight, down)
            down_proj(SiluAndMul()(gate_up(x)))
    print(f"{len(sent)} all-reduces recorded: one per rank for the MLP")
    mlp_sums = sum(sent)
same("ColumnParallelLinear, 4 ranks concatenated", torch.cat(columns, dim=1), Y)
same("the package's MLP, 4 ranks summed", mlp_sums, full_mlp)

# %% [markdown]
# The vocabulary layers, over three ranks of the 10-token table of section 4 (uneven: the
# last rank holds two real rows and two of padding):

# %%
# NBVAL_CHECK_OUTPUT
with simulated_collectives() as sent:
    for r in range(3):
        with as_rank(r, 3):
            embed = VocabParallelEmbedding(V, H).double()
            load(embed.weight, table)
            embed(ids)
    embed_sum = sum(sent)
    sent.clear()
    for r in range(3):
        with as_rank(r, 3):
            head = ParallelLMHead(V, H).double()
            load(head.weight, table)
            head(hidden)  # records this rank's logit slice (the gather is simulated)
    gathered = torch.cat(sent, dim=-1)[:, :V]
same("VocabParallelEmbedding, 3 ranks summed", embed_sum, F.embedding(ids, table))
same("ParallelLMHead, 3 slices concatenated", gathered, hidden @ table.T)

# %% [markdown]
# Each rank of a real engine runs these same lines; only the collectives are real, and
# they are NCCL between GPUs and gloo between CPU processes.

# %% [markdown]
# Figure 9.1 puts the pieces together for one decoder layer of Qwen3-0.6B at TP=2, with each
# rank's weight shapes computed from the model's config: two column-parallel projections that need
# no communication, two row-parallel ones, each followed by an all-reduce. This is Megatron-LM's
# split of a transformer layer {cite}`shoeybi2019megatron`.

# %%
from nanovllm.viz.kernel_diagrams import tp_diagram

fig = tp_diagram()
figure(fig, "09_tp_layer",
       "One decoder layer split over two ranks: column-parallel qkv and gate_up, row-parallel "
       "o and down, one all-reduce after each of the latter.")

# %% [markdown]
# ## 6. The engine at TP=2, live on this CPU
#
# `LLM(..., tensor_parallel_size=2)` makes this process rank 0: it runs the scheduler, the
# sampler and shard 0. It starts one worker, `python -m nanovllm.engine.worker`, which loads
# shard 1 of the same checkpoint and then follows rank 0 step by step: each step rank 0
# sends it a `StepPlan` (the token ids, positions, cache slots and block tables of the
# step, as host arrays) through shared memory (section 7.1), and both ranks run the same
# forward pass, whose
# all-reduces keep them in lockstep. The KV cache is split by KV heads: each rank allocates
# its own heads' share, and the block manager, on rank 0, is unchanged.
#
# A tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, a vocabulary of 4,096)
# written to a folder as a checkpoint, its weights scaled so that different prompts give
# different greedy tokens (chapter 02 §6 and chapter 12 use the same recipe):

# %%
def make_tiny_llama(path: Path, vocab: int = 4096, seed: int = 0) -> Path:
    """A tiny Llama checkpoint folder (safetensors + config.json) with random weights."""
    hidden, inter, heads, kv_heads, layers = 64, 128, 4, 2, 2
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=0.15: torch.randn(*shape, generator=g) * std  # noqa: E731
    weights = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": rand(vocab, hidden, std=0.5)}
    d = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": rand(heads * d, hidden),
                    p + "self_attn.k_proj.weight": rand(kv_heads * d, hidden),
                    p + "self_attn.v_proj.weight": rand(kv_heads * d, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, heads * d),
                    p + "mlp.gate_proj.weight": rand(inter, hidden),
                    p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter),
                    p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-5, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    return path


tiny = str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="ch09-tiny-")) / "tiny-llama"))
prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, list(range(10, 60)), [5] * 3]
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

# %% [markdown]
# One engine of each size, in float32. `with LLM(...) as llm:` stops the worker when the
# block ends (as do `llm.shutdown()`, garbage collection and the interpreter's exit; a
# worker also exits by itself when rank 0 disappears). We time the generation too, and look
# at the worker while it runs:

# %%
def run(n: int) -> tuple[list[list[int]], float, list[int]]:
    """Greedy tokens at tensor_parallel_size n, the seconds generate took, worker pids."""
    options = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    with LLM(tiny, tensor_parallel_size=n, **options) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
        executor = llm.engine.runner.executor
        pids = [w.pid for w in executor.workers] if executor is not None else []
    return [o.token_ids for o in outs], seconds, pids


tokens_1, seconds_1, _ = run(1)
tokens_2, seconds_2, pids = run(2)

# %%
# NBVAL_CHECK_OUTPUT
print("TP=2 greedy tokens equal TP=1's:", tokens_2 == tokens_1)
print("distinct tokens generated:", len({t for seq in tokens_1 for t in seq}))
for prompt, seq in zip(prompts, tokens_2):
    print(f"prompt of {len(prompt):2d} tokens -> {seq[:10]} ...")


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(
        f"/proc/{pid}/status").read_text().lower()


time.sleep(0.5)
print(f"{len(pids)} worker process; still running after the with-block: "
      f"{any(alive(p) for p in pids)}")

# %% [markdown]
# The same tokens, from a model whose every weight matrix was split across two processes
# (tests/test_tensor_parallel.py also checks them against transformers, and SmolLM2 at TP=3).
# The time is another matter:

# %%
# NBVAL_IGNORE_OUTPUT
steps = greedy.max_tokens  # one prefill step, then decode steps: about one per token
print(f"TP=1: {seconds_1 * 1e3:6.1f} ms for {len(prompts)} x {steps} tokens "
      f"({seconds_1 / steps * 1e3:.2f} ms per step)")
print(f"TP=2: {seconds_2 * 1e3:6.1f} ms ({seconds_2 / steps * 1e3:.2f} ms per step)")

# %% [markdown]
# On this tiny model TP=2 is slower: each step's matmuls are microseconds, and two CPU
# processes exchanging messages over loopback TCP add far more than they save (on a
# shared 2-core machine they also compete for the cores). Where the time goes is the subject
# of the next section.
#
# ## 7. What the split costs
#
# ### 7.1 Two processes, two costs
#
# Each step of a TP engine pays for two kinds of messages. The **all-reduces** of the
# forward pass (section 2) carry `batch × hidden` numbers each: 2 KiB for one sequence of
# Qwen3-0.6B in bf16. And before the forward pass the workers must learn what to compute:
# rank 0 pickles the step's `StepPlan` (the token ids, positions, slots and block tables)
# and sends it to them. That **control message** lies on the critical path of every step:
# the worker cannot launch its forward pass before the plan arrives, and rank 0's forward
# waits at its first all-reduce for the worker's.
#
# The obvious way to send it is a `torch.distributed` broadcast, `broadcast_object`, over a
# gloo group (a TCP socket, even between GPUs of one machine); the package did so at first.
# The other way, vLLM's, is a **shared-memory message queue**: rank 0 writes the pickled plan
# into a ring of slots in a file in `/dev/shm` that every worker on the same host has mapped
# into its memory, and the workers poll it. There is no system call and no trip through the
# network stack: a worker sees the plan as soon as its chunk number appears (rank 0 writes
# the number after the bytes, behind a memory barrier). `nanovllm/engine/shm_broadcast.py`
# is that queue. The engine uses it for the workers it starts itself, and gloo for ranks that
# a launcher started, which may be on other hosts. A waiting worker spins for 10 ms, then
# polls every 0.1 ms, and every millisecond once it has waited a second, so an idle server
# costs next to no CPU.
#
# We measure all three between two processes on this CPU with the package's benchmarks:
# all-reduces of float32 messages from 2 KiB to 512 KiB (`allreduce_sweep`; with
# `device="cuda"` it measures NCCL, eager and from a CUDA graph), and plans sent both ways (`control_plane.measure`:
# decode plans for a context of 1,024 tokens at three batch sizes, and a 16,384-token
# prefill). A plan's latency runs from rank 0 starting to send it until the worker holds it,
# unpickled; each is sent while the worker already waits, as between two steps.

# %%
allreduce_rows = allreduce_sweep(2, sizes=[2 << 10, 32 << 10, 512 << 10], iters=100, device="cpu")
plan_rows = control_plane.measure(iters=100)

# %%
# NBVAL_IGNORE_OUTPUT
print("all-reduce, 2 gloo processes (median, rank 0):")
for row in allreduce_rows:
    print(f"  {row['bytes'] / 1024:4.0f} KiB: {row['eager_us']:6.0f} us")
print("control message, rank 0 -> worker:")
control_plane.print_table(plan_rows)
plan_us = {(r["plan"], r["transport"]): r["latency_p50_us"] for r in plan_rows}
for transport in control_plane.TRANSPORTS:
    per_step = 6 * allreduce_rows[0]["eager_us"] + plan_us["decode, batch 1", transport]
    print(f"the tiny model's step at TP=2, plans over {transport}: 6 collectives (2 layers x 2, "
          f"embedding, logits) and one plan ~ {per_step / 1e3:.1f} ms")
print(f"measured in section 6 (shared memory): {(seconds_2 - seconds_1) / steps * 1e3:.1f} ms "
      "more per step than TP=1")

# %% [markdown]
# The same benchmark ran on the host of an H200 machine (16 cores, no GPU involved), recorded
# in `figures/data/control_plane_h200_host.json`:

# %%
# NBVAL_CHECK_OUTPUT
host = json.loads((DATA / "control_plane_h200_host.json").read_text())
print(f"{host['device']}, {host['date'][:10]}: {host['command']}")
control_plane.print_table(host["rows"])

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, (where, rows) in zip(axes, (("this CPU, live", plan_rows),
                                    ("H200 machine's host, recorded", host["rows"]))):
    names = list(dict.fromkeys(r["plan"] for r in rows))
    xs = np.arange(len(names))
    for k, transport in enumerate(control_plane.TRANSPORTS):
        p50 = [r["latency_p50_us"] for r in rows if r["transport"] == transport]
        ax.bar(xs + (k - 0.5) * 0.38, p50, 0.38, color=BOOK_COLORS[k],
               label="gloo broadcast" if transport == "gloo" else "shared-memory ring")
    ax.set_xticks(xs, labels=[n.replace(", ", "\n") for n in names], fontsize=9)
    ax.set(title=where)
axes[0].set(ylabel="plan latency, rank 0 -> worker (µs, median)")
axes[0].legend(fontsize=9)
fig.suptitle("The control message of one step, two ways", fontsize=11)
fig.tight_layout()
figure(fig, "09_tensor_parallel_control_plane",
       "The median latency of one step's plan from rank 0 to the worker, sent by a gloo broadcast"
       " or through the shared-memory ring, for decode plans at three batch sizes and a prefill"
       " plan: live on this CPU (left) and recorded on the host of the H200 machine (right).")

# %% [markdown]
# In Figure 9.2, on this CPU a gloo message costs hundreds of microseconds or more whatever its size
# (the numbers depend on the machine and its load), and the tiny model's steps are almost nothing
# but messages. The messages do not account for all of section 6's extra time either: the rest is
# the two processes taking turns on two shared cores, each waking up the other through the kernel at
# every collective.
#
# A plan over gloo costs about as much as a small all-reduce, for a few kilobytes: most of
# it is the fixed cost of a gloo broadcast (two messages, the size then the bytes, through
# the kernel's TCP stack) and of pickling, not the bytes. Through shared memory what is left
# is mostly pickling, copying and unpickling, several times less: on the H200 machine's host
# a median of 1,000 to 1,300 µs per plan over gloo against 85 to 174 µs. On a GPU a decode step of
# a small model takes one to a few milliseconds (chapter 07), so that difference is a
# visible share of it. Only processes on one host share memory: plans to other hosts still
# go over gloo (or, in a larger engine, a faster network).
#
# ### 7.2 A cost model, against two H200s
#
# The record `figures/data/tp_h200x2.json` was made on two H200s linked by NVLink with the
# package's benchmark (the commands are in the record): the NCCL all-reduce latency by
# message size, eager and replayed from a CUDA graph, and decode steps of Qwen3-0.6B and
# Qwen3-8B shapes (random bf16 weights, context 1,024, CUDA graphs on) at TP=1 and TP=2.

# %%
# NBVAL_CHECK_OUTPUT
record = json.loads((DATA / "tp_h200x2.json").read_text())
print(f"device: {record['device']}; {record['software']}")
for run_info in record["runs"]:
    print(f"  {run_info['date'][:16]}  {run_info['command']}")
parity = record["parity"]
print(f"parity ({parity['model']}, {parity['dtype']}, CUDA graphs): TP=2 tokens equal "
      f"{parity['tp2']['tokens_equal']}/{parity['tp2']['tokens']}, max |logprob diff| "
      f"{parity['tp2']['max_abs_logprob_diff']:.1e}")
ar = record["allreduce"]["2"]
engines = {(e["model"], e["tp"]): e for e in record["engines"]}
step_ms = {(m, n, d["batch"]): d["graphs_ms"] for (m, n), e in engines.items() for d in e["decode"]}
print("decode step with CUDA graphs, ms   batch 1   batch 64")
for m, n in engines:
    print(f"  {m:11s} TP={n}              {step_ms[m, n, 1]:7.2f}   {step_ms[m, n, 64]:8.2f}")
print(f"(this record's TP=1 rows are its own baseline, measured like its TP=2 rows; the book's "
      f"current batch-1 step, chapter 07: {current('h200_qwen3_0.6b_graph_decode_step_batch1')})")

# %% [markdown]
# TP=2 does **not** make a single decode step faster here: for the 0.6B shape it is nearly
# twice as slow at batch 1, for the 8B shape 5 to 11% slower. A model says what to expect.
# At TP=2 each GPU reads half the weights and does half the arithmetic, so the best TP=2
# step takes half the TP=1 step, plus the communication: two all-reduces per layer, plus
# one for the embedding and an all-gather of the logits, each a message of `batch × hidden`
# bf16 numbers, at the recorded latency of a graph-replayed all-reduce of that size
# (interpolated between the recorded sizes):

# %%
# NBVAL_CHECK_OUTPUT
def allreduce_us(nbytes: float) -> float:
    """Recorded NCCL all-reduce latency (graph replay), log-log interpolated by size."""
    sizes = np.log([r["bytes"] for r in ar])
    return float(np.exp(np.interp(np.log(nbytes), sizes, np.log([r["graph_us"] for r in ar]))))


model_cfgs = {m: ModelConfig.from_pretrained(config_path(m)) for m in ("qwen3-0.6b", "qwen3-8b")}
cost_rows = []
print("model       batch  message  collectives  comm ms  TP=1 ms  TP=1/2 + comm  TP=2 recorded"
      "  gap")
for m, cfg in model_cfgs.items():
    for batch in (1, 64):
        message = batch * cfg.hidden_size * 2  # bf16
        count = 2 * cfg.num_layers + 2  # per layer attention + MLP; embedding; logits
        comm = count * allreduce_us(message) / 1e3
        one, two = step_ms[m, 1, batch], step_ms[m, 2, batch]
        cost_rows.append((m, batch, one, one / 2 + comm, two))
        print(f"{m:11s} {batch:5d} {message / 1024:5.0f} KiB {count:12d} {comm:8.2f} "
              f"{one:8.2f} {one / 2 + comm:14.2f} {two:14.2f} {two - one / 2 - comm:5.2f}")

# %% [markdown]
# Figure 9.3 draws the record and the model. The all-reduces themselves are small: with CUDA graphs
# one costs about 9 µs, and a step's 58 to 74 of them well under a millisecond. The model predicts
# TP=2 steps *faster* than TP=1, and the recorded steps are 1.8 to 3.3 ms slower than it says (the
# last column), for both shapes and both batch sizes: a cost per step that the data sent does not
# explain. The likely culprit is the host side. At TP=1 a step's host work is rank 0's: prepare the
# batch, copy its inputs, launch the graph. At TP=2, rank 0 also pickles the plan and sends it
# (through gloo when this record was made), and only then can the worker receive and unpickle it,
# copy its inputs to its GPU and launch its graph; rank 0's graph waits at its first all-reduce
# until the worker's arrives, so the worker's host path is in series with the GPUs. (The eager
# numbers in the record show the same thing louder: TP=2 eager steps are 1.6 to 2.3× TP=1's, because
# every eager all-reduce costs about 32 µs of launch and synchronisation.) The record predates the
# shared-memory queue of section 7.1: on this CPU the queue cuts a plan's latency several times, but
# how much of the 1.8 to 3.3 ms it recovers on two H200s has not been measured yet.

# %%
fig, (ax_ar, ax_step) = plt.subplots(1, 2, figsize=(11, 4))
sizes_b = [r["bytes"] for r in ar]
ax_ar.plot(sizes_b, [r["eager_us"] for r in ar], "o-", color=BOOK_COLORS[1], label="eager")
ax_ar.plot(sizes_b, [r["graph_us"] for r in ar], "o-", color=BOOK_COLORS[0],
           label="replayed from a CUDA graph")
for (m, cfg), marker in zip(model_cfgs.items(), ("v", "^")):
    nbytes = [batch * cfg.hidden_size * 2 for batch in (1, 64)]
    ax_ar.plot(nbytes, [allreduce_us(b) for b in nbytes], marker, color="black", ms=8,
               label=f"{m} decode message, batch 1 and 64")
ax_ar.set(xscale="log", yscale="log", xlabel="message (bytes)", ylabel="latency (µs)",
          title="NCCL all-reduce, 2 GPUs (recorded)")
ax_ar.legend(loc="upper left", fontsize=8)
labels = [f"{m}\nB={b}" for m, b, *_ in cost_rows]
xs = np.arange(len(cost_rows))
for k, (what, color) in enumerate((("TP=1 recorded", BOOK_COLORS[2]),
                                   ("TP=2 model: TP=1/2 + all-reduces", BOOK_COLORS[0]),
                                   ("TP=2 recorded", BOOK_COLORS[1]))):
    ax_step.bar(xs + (k - 1) * 0.27, [row[2 + k] for row in cost_rows], 0.27, color=color,
                label=what)
ax_step.set_xticks(xs, labels=labels, fontsize=9)
ax_step.set(ylabel="decode step (ms), CUDA graphs", title="Decode step: model vs record")
ax_step.legend(fontsize=8)
fig.suptitle(f"Recorded on {record['device']}, {record['runs'][0]['date'][:10]} "
             "(figures/data/tp_h200x2.json)", fontsize=10)
fig.tight_layout()
figure(fig, "09_tensor_parallel_cost",
       f"Recorded on {record['device']}: the NCCL all-reduce latency by message size, eager and"
       " from a CUDA graph, with the messages of a decode step marked (left); decode steps at"
       " TP=1 and TP=2, and the TP=2 time the cost model predicts (right): compare the model's"
       " bars with the recorded TP=2 ones.")

# %% [markdown]
# ## 8. Where TP=2 wins: throughput
#
# A whole workload is not one decode step. The same record runs the nano-vllm workload (256
# requests, about 134,000 output tokens, chapter 11) at TP=1 and TP=2 with 40 GiB of KV
# cache per GPU:

# %%
# NBVAL_CHECK_OUTPUT
print("model        TP  output tok/s  seconds")
for (m, n), e in engines.items():
    print(f"{m:11s} {n:3d} {e['output_tok_s']:13,.0f} {e['seconds']:8.2f}")
for m in model_cfgs:
    gain = engines[m, 2]["output_tok_s"] / engines[m, 1]["output_tok_s"]
    print(f"{m}: TP=2 / TP=1 = {gain:.2f}x throughput, on twice the GPUs")
print(f"(TP=1 here has 40 GiB of KV cache and ran in a process that had run other engines; the "
      f"book's current single-GPU figure, chapter 11: {current('h200_qwen3_0.6b_tok_s')})")

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
for k, n in enumerate((1, 2)):
    values = [engines[m, n]["output_tok_s"] for m in model_cfgs]
    bars = ax.bar(np.arange(2) + (k - 0.5) * 0.35, values, 0.35, color=BOOK_COLORS[k],
                  label=f"TP={n}")
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=9)
ax.set_xticks(np.arange(2), labels=list(model_cfgs))
ax.set(ylabel="output tokens / s", title="nano-vllm workload, bf16 (recorded)")
ax.legend()
fig.suptitle(f"{record['device']}, {record['runs'][-1]['date'][:10]}", fontsize=9)
fig.tight_layout()
figure(fig, "09_tensor_parallel_throughput",
       f"Recorded output throughput of the nano-vllm workload (bf16) on {record['device']}, at"
       " TP=1 on one GPU and TP=2 on two, for the Qwen3-0.6B and Qwen3-8B shapes.")

# %% [markdown]
# Figure 9.4: TP=2 serves 1.26× the tokens per second for the 0.6B shape and 1.55× for the 8B shape,
# although no single step got faster. What pays: prefill, where the matmuls are large and
# compute-bound, splits its arithmetic over two GPUs; each GPU's 40 GiB of cache holds half of every
# token's KV, so the engine can keep twice the tokens in flight; and the 8B shape is heavier per
# step, so the fixed per-step overhead of section 7.2 is a smaller share of it. (The record does not
# separate these parts; a run with the cache halved at TP=2 would isolate the capacity.) On two GPUs
# that is less than 2× (the GPUs could instead run two independent TP=1 engines, "data parallel", at
# up to 2× for a model that fits one GPU). TP is the right tool when the model does not fit, when
# its cache would be too small on one GPU, or when one request's latency must fall for models large
# enough that the per-step overhead is small next to the matmuls; the shared-memory queue of section
# 7.1 attacks that overhead, and a record made with it will show how much of it is left.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"chapter run time so far: {time.perf_counter() - chapter_start:.0f} s")

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# these parts of the package yourself: the column-parallel weight loader (this rank's rows,
# section 2), the row-parallel weight loader (this rank's columns; the bias whole), and the
# vocab-parallel embedding's lookup with several ranks (mask, clamp, embed, all-reduce;
# section 4). Each function's docstring is the handout; the project's tests grade your code
# (`make check CHAPTERS=09` in your edition): unit tests that simulate the ranks in one process as
# section 5 does, and the engine at TP=2 and TP=3 on CPU.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("09"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — shard a packed QKV weight.** Write `qkv_shard(wq, wk, wv, rank, n)`: the
# checkpoint's `wq` `[heads * d, hidden]`, `wk` and `wv` `[kv_heads * d, hidden]`, and this
# rank's packed matrix `[q heads | k heads | v heads]` for rank `rank` of `n`: its
# `heads / n` consecutive query heads, then its `kv_heads / n` key heads, then its value
# heads, each head `head_dim` rows (so `heads = wq.shape[0] / head_dim`). Raise
# `ValueError` if `n` does not divide both head counts. The check runs every rank's
# attention with its shard and its slice of `o_proj`, sums the ranks, and compares with the
# full attention.

# %% tags=["exercise"]
import torch


def qkv_shard(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, rank: int, n: int,
              head_dim: int) -> torch.Tensor:
    """Rank ``rank`` of ``n``: its q heads, then k heads, then v heads, as one matrix."""
    raise NotImplementedError("exercise 09.qkv_shard")


# %% tags=["check", "raises-exception"]
import torch
import torch.nn.functional as F


def attention(x, wq, wk, wv, wo, heads, kv_heads, d):
    """Causal grouped-query attention of one sequence x [T, hidden], float64."""
    t = x.shape[0]
    q = (x @ wq.T).view(t, heads, d).transpose(0, 1)
    k = (x @ wk.T).view(t, kv_heads, d).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = (x @ wv.T).view(t, kv_heads, d).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(0, 1).reshape(t, heads * d) @ wo.T


gen = torch.Generator().manual_seed(901)
for heads, kv_heads, d, n in [(8, 2, 4, 2), (6, 3, 2, 3), (4, 4, 3, 4), (8, 4, 2, 1)]:
    hidden = 12
    wq = torch.randn(heads * d, hidden, generator=gen, dtype=torch.float64)
    wk, wv = (torch.randn(kv_heads * d, hidden, generator=gen, dtype=torch.float64)
              for _ in range(2))
    wo = torch.randn(hidden, heads * d, generator=gen, dtype=torch.float64)
    x = torch.randn(5, hidden, generator=gen, dtype=torch.float64)
    total = torch.zeros(5, hidden, dtype=torch.float64)
    hq, hkv = heads // n, kv_heads // n
    for rank in range(n):
        packed = qkv_shard(wq, wk, wv, rank, n, head_dim=d)
        assert packed.shape == ((hq + 2 * hkv) * d, hidden), (heads, kv_heads, n, packed.shape)
        q_r, k_r, v_r = packed.split([hq * d, hkv * d, hkv * d])
        wo_r = wo[:, rank * hq * d:(rank + 1) * hq * d]  # o_proj: row-parallel
        total += attention(x, q_r, k_r, v_r, wo_r, hq, hkv, d)
    ref = attention(x, wq, wk, wv, wo, heads, kv_heads, d)
    assert torch.allclose(total, ref, rtol=1e-10, atol=1e-10), f"heads {heads}/{kv_heads}, n {n}"
for bad in [(3, 1), (4, 3)]:  # (n, rank): 3 does not divide 8 heads; 4 does not divide 2 kv
    try:
        qkv_shard(torch.zeros(8 * 2, 4), torch.zeros(2 * 2, 4), torch.zeros(2 * 2, 4),
                  bad[1] % bad[0], bad[0], head_dim=2)
    except ValueError:
        continue
    raise AssertionError(f"n={bad[0]} must raise ValueError (8 heads, 2 KV heads)")
print("Exercise 1 passed: the ranks' attention outputs sum to the full attention")

# %% [markdown]
# **Exercise 2 — a ring all-reduce that returns the time it takes.** Write
# `ring_allreduce_time_us(nbytes, n, latency_us, bandwidth_gbs)`: the time of a ring
# all-reduce of an `nbytes` message over `n` ranks if each of its $2(n-1)$ steps costs a
# fixed `latency_us` plus the time to send one chunk, `nbytes / n`, at `bandwidth_gbs`
# (GB/s, $10^9$ bytes per second) per link. Then `fit_latency_bandwidth(sizes, times_us, n)`:
# the `(latency_us, bandwidth_gbs)` that fit measured times best in least squares (the model
# is linear in `latency_us` and `1 / bandwidth_gbs`). The check fits it to synthetic data
# with known parameters and to a noisy copy.

# %% tags=["exercise"]
import numpy as np


def ring_allreduce_time_us(nbytes: float, n: int, latency_us: float,
                           bandwidth_gbs: float) -> float:
    """Time of a ring all-reduce: 2(n-1) steps of latency plus one chunk's transfer."""
    raise NotImplementedError("exercise 09.ring_allreduce_time_us")


def fit_latency_bandwidth(sizes, times_us, n: int) -> tuple[float, float]:
    """Least-squares (latency_us, bandwidth_gbs) of the ring model for measured times."""
    raise NotImplementedError("exercise 09.fit_latency_bandwidth")


# %% tags=["check", "raises-exception"]
import numpy as np

assert abs(ring_allreduce_time_us(0, 2, 5.0, 100.0) - 10.0) < 1e-9  # two steps of latency
assert abs(ring_allreduce_time_us(8e6, 8, 0.0, 100.0) - 14 * 1e6 / 100e3) < 1e-6
sizes = np.logspace(3, 8.5, 12)
for n, lat, bw in [(2, 4.3, 150.0), (8, 1.7, 40.0), (4, 10.0, 300.0)]:
    times = np.array([ring_allreduce_time_us(s, n, lat, bw) for s in sizes])
    times_ref = 2 * (n - 1) * (lat + sizes / n / (bw * 1e3))  # written out again
    assert np.allclose(times, times_ref, rtol=1e-12), (n, lat, bw)
    got_lat, got_bw = fit_latency_bandwidth(sizes, times, n)
    assert abs(got_lat - lat) < 1e-6 * lat and abs(got_bw - bw) < 1e-6 * bw, (got_lat, got_bw)
    rng = np.random.default_rng(n)
    noisy = times * (1 + 0.01 * rng.standard_normal(times.shape))
    got_lat, got_bw = fit_latency_bandwidth(sizes, noisy, n)
    assert abs(got_bw - bw) < 0.05 * bw, (n, got_bw, bw)
print("Exercise 2 passed: the ring model and its least-squares fit")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/09.json` *before* measuring; then `make analysis CH=09 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("09")

# %% [markdown]
# ## Summary
#
# - **Why**: each of $N$ GPUs holds $1/N$ of the weights and $1/N$ of every token's KV cache
#   and reads $1/N$ of the bytes per step. Qwen3-32B weighs about 66 GB in bf16: at $N=2$ an
#   H200 holds about three times the KV tokens of $N=1$.
# - **Splitting a matmul**: by output features (column-parallel), the outputs concatenate; by
#   input features (row-parallel), the partial sums add up. Pairing them (gate/up then down;
#   q/k/v by heads then o_proj) needs **two all-reduces per layer**, plus one for the
#   vocab-parallel embedding (mask, clamp, look up, sum) and an all-gather of the LM head's
#   logit slices.
# - **All-reduce**: every rank ends with the sum; the ring algorithm sends $2(N-1)/N$ of the
#   tensor per rank, whatever $N$.
# - **The package**: sharding weight loaders take the full checkpoint tensor and copy in the
#   rank's slice, so the checkpoint loader is one loop for every $N$; we proved the layers
#   equal to the unsplit matmuls by running all ranks in one process. At TP=2 on CPU (gloo,
#   two processes) the engine's greedy tokens equal TP=1's.
# - **The price**: a decode all-reduce is a small message, about 9 µs from a CUDA graph on
#   two NVLinked H200s; the per-step control message (a pickled `StepPlan`: hundreds of µs
#   over gloo on this CPU, several times less through the shared-memory queue the package
#   uses) and the worker's host work are on the critical path. On the
#   H200 record TP=2 makes no single decode step faster (0.6B: 1.68 → 3.13 ms at batch 1),
#   and a cost model of half the compute plus the all-reduces leaves 1.8 to 3.3 ms per step
#   unexplained: a fixed cost per step, most likely that host path, which is why vLLM (and
#   now this package) passes step inputs through shared memory. That record was made with
#   plans over gloo.
# - **Where it wins**: throughput, 1.26× (0.6B) and 1.55× (8B) on the nano-vllm workload with
#   two GPUs, from split prefill compute and KV capacity; and models that do not fit one GPU.

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
# # Chapter 02 — Attention
#
# Chapter 01 used attention as a black box: `causal_attention(q, k, v, scale)` took the
# queries, keys and values of one sequence and returned a mix of the values. This chapter
# opens the box. Attention is the one part of a transformer whose cost depends on how much
# text came *before* the current token, so it is the part that decides how long a context an
# engine can afford, and it is where the fastest engines spend their most careful kernels.
#
# We build it up in small steps, each checked against a slow float64 reference written
# straight from the definition, on fresh random inputs:
#
# 1. **naive attention**, $\mathrm{softmax}(QK^\top/\sqrt d)\,V$, as three matrix operations;
# 2. **causal masking**, so a token sees only its past;
# 3. a **numerically stable softmax**, after watching the naive one overflow;
# 4. **online softmax**, the idea behind FlashAttention: keys processed in tiles with a
#    running maximum and sum, so the $L\times L$ score matrix never exists;
# 5. **grouped-query attention (GQA)**, several query heads sharing one key/value head;
# 6. **variable-length packing**: many sequences laid end to end (`cu_seqlens`), and queries
#    that are fewer than keys because a prefix is already cached.
#
# Then we read the package's PyTorch versions and prove they agree with ours, count the
# memory traffic that tiling saves (Figure 2.2), take apart the package's **Triton prefill
# kernel** tile by tile and run it (on a CPU under the Triton interpreter), switch it on in
# the engine, and finish with its recorded speed on an H200 (Figure 2.4).
#
# **Package modules taught here:** `nanovllm/layers/torch_attention.py` (the PyTorch reference
# backend: `causal_attention`, `paged_attention`), `nanovllm/layers/attention.py` (the layer
# and its backend dispatch), `nanovllm/context.py` (`AttentionMetadata`),
# `nanovllm/kernels/prefill_attention.py` (the Triton varlen paged prefill kernel) and
# `nanovllm/benchmarks/prefill_kernel.py` (its benchmark).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(2)

# %% [markdown]
# **Builds on:** online softmax {cite}`milakov2018online` and FlashAttention 1-3
# {cite}`dao2022flashattention,dao2024flashattention2,shah2024flashattention3`; §7 compares with
# FlashAttention-4 {cite}`flashattention4`. The references are collected in the book's
# bibliography.

# %% [markdown]
# ## Setup
#
# Triton decides whether to compile kernels for a GPU or to *interpret* them in Python when it
# is first imported, by reading the environment variable `TRITON_INTERPRET`. On a machine
# without a GPU we therefore set it in this very first cell, before anything imports triton
# (the top-level `nanovllm` import does not; `transformers`, which we use later, does).
#
# Everything we build by hand runs on the CPU in fp32 or float64, even on a GPU machine, so the
# printed numbers are the same everywhere; the Triton kernel and the engine run on `device`.
# Helpers: `show_source` renders package code, `check` asserts that two tensors agree within
# a tolerance and says so, `rand` draws seeded random inputs.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`

import inspect
import json
import math
import time
from itertools import accumulate
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from nanovllm.configs import config_path
from nanovllm.context import AttentionMetadata
from nanovllm.layers import torch_attention
from nanovllm.models import ModelConfig
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
use_book_style()


def check(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    """Assert max |ours - theirs| <= tol and print a one-line verdict."""
    diff = (ours.double().cpu() - theirs.double().cpu()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| = {diff:.2e} > {tol:g}"
    print(f"{name}: agree (max |diff| <= {tol:g})")


def rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Standard-normal values from a private, seeded generator (CPU)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# %% [markdown]
# ## 1. Why attention is the part that grows
#
# Take one token going through one decoder layer. The projections (q, k, v, o) and the MLP
# multiply it by fixed weight matrices: about two floating-point operations (FLOPs) per
# weight of the layer, **whatever the position of the token**. Attention is different.
# The token's query is compared with the key of every earlier token, and the values of all
# of them are mixed. For a token at position $t$ with $H$ query heads of $d$ channels that is
# $t+1$ dot products of length $d$ and $t+1$ weighted sums of $d$-vectors per head: about
# $4\,(t+1)\,d\,H$ FLOPs (a multiply-add counts two). The first cost is flat, the second grows
# linearly with the context, so beyond some position attention dominates. For a whole prompt
# of $L$ tokens the attention work sums to about $2L^2dH$: quadratic in the length.
#
# Here are the two costs for the two model shapes of this book, read from their configs
# (shipped in `nanovllm/configs/`):

# %%
def linear_weights_per_layer(c: ModelConfig) -> int:
    """Weights a token meets in one layer: q, k, v, o projections and the 3-matrix MLP."""
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn_proj = c.hidden_size * (q_out + 2 * kv_out) + q_out * c.hidden_size
    return attn_proj + 3 * c.hidden_size * c.intermediate_size


print(f"{'model':14s} {'heads/kv':>8s} {'weights/layer':>14s} {'linear FLOPs/token':>19s} "
      f"{'attn FLOPs/key':>15s} {'crossover t':>12s}")
crossover = {}
for name in ("smollm2-135m", "qwen3-0.6b"):
    c = ModelConfig.from_pretrained(config_path(name))
    linear = 2 * linear_weights_per_layer(c)
    per_key = 4 * c.head_dim * c.num_heads
    crossover[name] = linear // per_key
    print(f"{name:14s} {f'{c.num_heads}/{c.num_kv_heads}':>8s} {linear_weights_per_layer(c):14,d} "
          f"{linear:19,d} {per_key:15,d} {crossover[name]:12,d}")

smollm = ModelConfig.from_pretrained(config_path("smollm2-135m"))
print("\nSmolLM2, share of a token's per-layer FLOPs spent in attention:")
for t in (128, 1024, 4096, 8192, 32768):
    attn = 4 * (t + 1) * smollm.head_dim * smollm.num_heads
    share = attn / (attn + 2 * linear_weights_per_layer(smollm))
    print(f"  position {t:6,d}: {share:6.1%}")

# %% [markdown]
# For SmolLM2 the attention of one token costs as much as all its matrix multiplications once
# the token has 3,072 predecessors (Qwen3-0.6B: 3,840). At position 32,768 attention is more
# than nine tenths of the work. And FLOPs are only half the story: as we will see in section
# 3, a naive implementation also *stores* a score for every (query, key) pair, which costs
# memory traffic and memory space that grow quadratically with the length.
#
# ### The formula
#
# For one head, stack the $L_q$ queries as rows of $Q \in \mathbb{R}^{L_q\times d}$ and the
# $L_k$ keys and values as rows of $K, V \in \mathbb{R}^{L_k\times d}$. Then
#
# $$S = \frac{QK^\top}{\sqrt d}\in\mathbb{R}^{L_q\times L_k},\qquad
#   P_{ij} = \frac{e^{S_{ij}}}{\sum_{j'} e^{S_{ij'}}},\qquad O = PV.$$
#
# Row $i$ of $S$ scores how well query $i$ matches each key; the softmax turns the scores
# into weights that are positive and sum to one; output $i$ is the weighted average of the
# values. The factor $1/\sqrt d$ keeps the scores' spread independent of $d$: a dot product of
# two random unit-variance $d$-vectors has variance $d$.
#
# ### The yardstick
#
# Every version below is checked against `reference_attention`: the definition applied one
# query at a time, in float64, with no cleverness, so it is easy to trust. It already handles
# the two complications we add later: queries may be fewer than keys (query $i$ of $L_q$ then
# sits at absolute position $L_k - L_q + i$ and, when causal, sees keys $0..L_k-L_q+i$), and
# query head $h$ may read key/value head $h \,/\!/\, (H/H_{kv})$ (GQA).

# %%
def reference_attention(q, k, v, scale, causal=True):
    """softmax(q k^T * scale) v by the definition, one query row at a time, in float64.

    q: [Lq, H, d]; k, v: [Lk, Hkv, d]. Query i sits at position Lk - Lq + i; when causal it
    sees keys 0 .. Lk - Lq + i. Query head h reads KV head h // (H // Hkv).
    """
    q, k, v = q.double(), k.double(), v.double()
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, _ = k.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        for i in range(lq):
            last = lk - lq + i if causal else lk - 1  # the last key query i may see
            scores = (k[: last + 1, kv] @ q[i, h]) * scale
            weights = torch.exp(scores - scores.max())  # float64: the shift changes nothing
            out[i, h] = (weights / weights.sum()) @ v[: last + 1, kv]
    return out


# %% [markdown]
# ## 2. Building attention step by step
#
# ### 2.1 Naive attention
#
# The formula, transcribed: one head, three operations. The softmax is written out as
# exponentials divided by their sum, exactly as in the formula.

# %%
def naive_softmax(s: torch.Tensor) -> torch.Tensor:
    e = torch.exp(s)
    return e / e.sum(dim=-1, keepdim=True)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """One head: q [Lq, d], k and v [Lk, d]. Every query sees every key."""
    s = q @ k.T * scale  # [Lq, Lk]: the whole score matrix
    return naive_softmax(s) @ v


L, d = 24, 32
q, k, v = rand(L, d, seed=1), rand(L, d, seed=2), rand(L, d, seed=3)
out = naive_attention(q, k, v, d**-0.5)
ref = reference_attention(q[:, None], k[:, None], v[:, None], d**-0.5, causal=False)[:, 0]
print("output shape:", tuple(out.shape))
check("naive attention vs float64 reference", out, ref, 1e-5)

# %% [markdown]
# ### 2.2 Causal masking
#
# A language model predicts token $t+1$ from tokens $0..t$, so during training and prefill the
# query of token $i$ must not see keys $j > i$. We set those scores to $-\infty$ before the
# softmax; $e^{-\infty} = 0$ gives them zero weight. The mask is the lower triangle, shown
# here for 6 tokens (`#`: allowed, `.`: masked):

# %%
def show_mask(mask: torch.Tensor) -> None:
    for row in mask.tolist():
        print(" ".join("#" if ok else "." for ok in row))


show_mask(torch.ones(6, 6, dtype=torch.bool).tril())


def causal_naive_attention(q, k, v, scale):
    """One head, q/k/v [L, d]: query i sees keys 0..i."""
    s = q @ k.T * scale
    allowed = torch.ones(s.shape, dtype=torch.bool).tril()
    return naive_softmax(s.masked_fill(~allowed, float("-inf"))) @ v


out = causal_naive_attention(q, k, v, d**-0.5)
ref = reference_attention(q[:, None], k[:, None], v[:, None], d**-0.5, causal=True)[:, 0]
check("causal attention vs float64 reference", out, ref, 1e-5)
print("first output row is v[0] exactly:", torch.equal(out[0], v[0]))

# %% [markdown]
# The first token sees only itself, so its output is its own value vector, bit for bit.
#
# ### 2.3 A softmax that does not overflow
#
# `naive_softmax` computes $e^{s}$ and that is a problem: the exponential of a moderately
# large score no longer fits in a floating-point number. Attention scores that large are not
# exotic: queries and keys are activations of a trained network, some of whose channels are
# known to be very large. Watch the naive softmax fail, in fp16 and in fp32:

# %%
print(f"largest fp16: {torch.finfo(torch.float16).max:,.0f}   ln of it: "
      f"{math.log(torch.finfo(torch.float16).max):.2f}")
print(f"largest fp32: {torch.finfo(torch.float32).max:.3e}   ln of it: "
      f"{math.log(torch.finfo(torch.float32).max):.2f}")
cases = {torch.float16: [2.0, 10.0, 12.0], torch.float32: [80.0, 90.0, 100.0]}
for dtype, values in cases.items():
    s = torch.tensor(values, dtype=dtype)
    print(f"{str(dtype):14s} scores {values}: exp -> {torch.exp(s).tolist()}, "
          f"naive softmax -> {naive_softmax(s).tolist()}")

# %% [markdown]
# $e^{x}$ exceeds the largest fp16 number (65,504) once $x > 11.09$, and the largest fp32
# number once $x > 88.72$. One infinite exponential makes the sum infinite, the finite entries
# become $0$ and the infinite one $\infty/\infty = $ NaN. The cure is an identity: for any
# constant $m$,
#
# $$\frac{e^{s_j}}{\sum_{j'} e^{s_{j'}}} = \frac{e^{s_j-m}}{\sum_{j'} e^{s_{j'}-m}}.$$
#
# Choose $m = \max_j s_j$: every exponent is then $\le 0$, every exponential lies in $(0, 1]$,
# and the largest one is exactly $1$, so the sum is at least $1$. Nothing overflows, and
# nothing that matters underflows.

# %%
def stable_softmax(s: torch.Tensor) -> torch.Tensor:
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


for dtype, values in cases.items():
    s = torch.tensor(values, dtype=dtype)
    exact = torch.softmax(s.double(), dim=-1)
    print(f"{str(dtype):14s} stable softmax -> "
          f"[{', '.join(f'{p:.4g}' for p in stable_softmax(s).tolist())}]   "
          f"float64: [{', '.join(f'{p:.4g}' for p in exact.tolist())}]")

s = rand(16, 40, seed=4) * 30  # scores up to ~100: the naive softmax overflows in fp32
print("naive softmax finite:", bool(torch.isfinite(naive_softmax(s)).all()))
check("stable softmax vs float64 softmax", stable_softmax(s), torch.softmax(s.double(), -1), 1e-6)

# %% [markdown]
# `torch.softmax` does the same shift internally. From here on our attention uses the stable
# form; the mask's $-\infty$ entries are harmless because every row keeps at least one finite
# score (a query always sees key 0).
#
# ### 2.4 Online softmax: the flash idea
#
# The stable softmax needs the row maximum *before* it can exponentiate anything, so it seems
# to need the whole row of scores at once: the whole $L_q\times L_k$ matrix $S$ for the whole
# sequence, $L^2$ scores per head for a prompt of $L$ tokens. FlashAttention
# (Dao et al., 2022) avoids it with an *online* softmax (Milakov and Gimelshein, 2018): visit
# the keys in tiles of $B_N$ keys and keep, per query row, three running quantities:
#
# - $m$, the largest score seen so far;
# - $\ell$, the sum of $e^{s - m}$ over the keys seen so far;
# - $\mathbf a$, the sum of $e^{s-m}\,\mathbf v$ over the keys seen so far (a $d$-vector).
#
# When a tile with scores $s_1..s_{B_N}$ arrives, the new maximum is
# $m' = \max(m, \max_j s_j)$. Everything accumulated so far was exponentiated relative to the
# old $m$; multiplying it by $\alpha = e^{m - m'}$ re-expresses it relative to $m'$
# (because $e^{s-m}e^{m-m'} = e^{s-m'}$). So
#
# $$\ell \leftarrow \alpha\,\ell + \sum_j e^{s_j - m'},\qquad
#   \mathbf a \leftarrow \alpha\,\mathbf a + \sum_j e^{s_j - m'}\,\mathbf v_j,\qquad
#   m \leftarrow m'.$$
#
# **Why this is exact.** By induction, after any number of tiles $\ell = \sum e^{s - m}$ and
# $\mathbf a = \sum e^{s-m}\mathbf v$ over the keys seen, with $m$ their maximum: true at the
# start ($\ell = 0$, $\mathbf a = 0$, $m = -\infty$) and kept by each update. After the last
# tile, $\mathbf a / \ell = \sum_j e^{s_j-m}\mathbf v_j / \sum_j e^{s_j - m}$, which is the
# stable softmax-weighted average: exactly attention. At every step $m$ bounds all scores
# seen, so no exponential exceeds 1. And the state per query row is $d + 2$ numbers, whatever
# the number of keys.

# %%
def online_attention(q, k, v, scale, tile=8):
    """One head, causal, q/k/v [L, d]: keys in tiles of `tile`, softmax kept online."""
    n, dim = q.shape
    m = torch.full((n,), float("-inf"))  # running max per query row
    ell = torch.zeros(n)  # running sum of exp(s - m)
    acc = torch.zeros(n, dim)  # running sum of exp(s - m) * v
    q_pos = torch.arange(n)
    for start in range(0, n, tile):
        k_pos = torch.arange(start, min(start + tile, n))
        s = q @ k[k_pos].T * scale  # [n, tile]: one tile of scores, never the whole row
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)  # rescales what was accumulated against the old max
        p = torch.exp(s - m_new[:, None])
        ell = alpha * ell + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v[k_pos]
        m = m_new
    return acc / ell[:, None]


ref = reference_attention(q[:, None], k[:, None], v[:, None], d**-0.5)[:, 0]
for tile in (1, 5, 8, 24):
    check(f"online attention, tiles of {tile:2d} keys, vs float64 reference",
          online_attention(q, k, v, d**-0.5, tile), ref, 1e-5)

# %% [markdown]
# The tile size changes the order of the floating-point additions, not the result. (The first
# tile always contains key 0, which every query sees, so $m$ is finite after the first tile
# and $e^{m - m'}$ is never $e^{-\infty - (-\infty)}$: Exercise 1 asks you to handle rows whose
# first tiles are entirely masked.)
#
# To watch the invariant at work, follow query row 20 (which sees keys 0..20) through tiles
# of 8 keys. After each tile, $\mathbf a/\ell$ must equal attention over the keys seen so
# far: the last column compares it with the reference restricted to those keys.

# %%
row, tile, scale = 20, 8, d**-0.5
m, ell, acc = float("-inf"), 0.0, torch.zeros(d)
print(f"{'keys seen':>10s} {'tile max':>9s} {'m':>8s} {'alpha':>8s} {'ell':>9s} "
      f"{'max|a/ell - attention(seen)|':>28s}")
for start in range(0, row + 1, tile):
    keys = torch.arange(start, min(start + tile, row + 1))
    s = k[keys] @ q[row] * scale
    m_new = max(m, s.max().item())
    alpha = math.exp(m - m_new)
    p = torch.exp(s - m_new)
    ell, acc, m = alpha * ell + p.sum().item(), alpha * acc + p @ v[keys], m_new
    seen = int(keys[-1]) + 1
    partial = reference_attention(q[row : row + 1, None], k[:seen, None], v[:seen, None],
                                  scale, causal=False)[0, 0]
    err = (acc / ell - partial).abs().max().item()  # fp32 rounding: its digits vary by CPU
    print(f"{'0..' + str(seen - 1):>10s} {s.max().item():9.4f} {m:8.4f} {alpha:8.4f} {ell:9.4f} "
          f"{'< 1e-06' if err < 1e-6 else f'{err:.1e}':>28s}")

# %% [markdown]
# Whenever a tile brings a larger score, $m$ rises and $\alpha < 1$ shrinks the old sum;
# otherwise $\alpha = 1$. The differences in the last column are fp32 rounding (below
# $10^{-6}$): the running result *is* attention over the keys seen so far, at every step.

# %% [markdown]
# Figure 2.1 draws the same computation the way the Triton kernel of §5 organises it: the score
# matrix of one sequence is cut into tiles of queries and keys (the package's tile sizes on a
# GPU), tiles above the diagonal are never loaded, and each query tile walks its key tiles keeping
# only $m$, $\ell$ and the unnormalised output. The running-maximum rule is Milakov and
# Gimelshein's online softmax {cite}`milakov2018online`; FlashAttention
# {cite}`dao2022flashattention` made it the tiling of attention.

# %%
from nanovllm.viz.kernel_diagrams import online_softmax_diagram

fig = online_softmax_diagram()
figure(fig, "02_online_softmax_tiles",
       "Online softmax over tiles: full, masked and skipped tiles of a causal prefill, and the"
       " running state one query tile keeps.")

# %% [markdown]
# ### 2.5 Grouped-query attention
#
# A model runs $H$ heads in parallel, each with its own projections. In grouped-query
# attention the keys and values have fewer heads, $H_{kv}$, and each is shared by
# $H / H_{kv}$ consecutive query heads (SmolLM2: 9 query heads over 3 KV heads; Qwen3-0.6B:
# 16 over 8). The point is the KV cache (chapter 03): only K and V are cached, so the cache
# shrinks by the group size, for a small loss in quality. For the attention computation GQA is
# only an indexing rule: query head $h$ reads KV head $h \,/\!/\, (H/H_{kv})$, which
# `repeat_interleave` spells out.

# %%
def gqa_attention(q, k, v, scale):
    """Causal attention for all heads: q [L, H, d], k and v [L, Hkv, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, d]
    s = torch.einsum("ihd,jhd->hij", q, k) * scale  # [H, L, L]
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    p = stable_softmax(s.masked_fill(~allowed, float("-inf")))
    return torch.einsum("hij,jhd->ihd", p, v)


H, H_kv = 6, 2
qh, kh, vh = rand(L, H, d, seed=5), rand(L, H_kv, d, seed=6), rand(L, H_kv, d, seed=7)
check("GQA attention (6 query heads, 2 KV heads) vs float64 reference",
      gqa_attention(qh, kh, vh, d**-0.5), reference_attention(qh, kh, vh, d**-0.5), 1e-5)
c = smollm
kv_bytes = 2 * c.num_layers * c.head_dim * 2  # K and V, every layer, bf16, per KV head
print(f"SmolLM2 KV cache per token in bf16: {c.num_kv_heads * kv_bytes:,d} bytes with "
      f"{c.num_kv_heads} KV heads; it would be {c.num_heads * kv_bytes:,d} with one per query head")

# %% [markdown]
# ### 2.6 Variable-length packing and cached prefixes
#
# An engine serves many requests of different lengths in one step. Padding them all to the
# longest wastes work, so the engine **packs** them: the new tokens of all sequences are laid
# end to end in one `[total_tokens, heads, head_dim]` tensor, and a vector of cumulative
# lengths, `cu_seqlens` (a 0 followed by the running sums of the lengths), says where each
# sequence starts: sequence $j$ occupies rows `cu_seqlens[j] : cu_seqlens[j+1]`.
# Attention must never mix sequences, so over the packed tokens the allowed (query, key)
# pairs form a block-diagonal of causal triangles.
#
# The second twist: the queries of a sequence can be fewer than its keys. When a prompt's
# first tokens are already in the KV cache (a shared system prompt found by prefix caching,
# chapter 04, or the earlier chunks of a long prompt split by chunked prefill, chapter 06),
# only the remaining tokens are computed, but they attend to all keys. With $L_k$ keys and
# $L_q$ new queries, query $i$ sits at absolute position $L_k - L_q + i$ and sees keys
# $0..L_k-L_q+i$: the causal triangle is shifted right by the prefix length. A decode step is
# the extreme case $L_q = 1$: one query that sees every key. Here is the packed mask of three
# sequences: a 4-token prompt, a 3-token chunk after a 3-token cached prefix, and a decode
# step over 4 keys.

# %%
def offset_causal_mask(q_len: int, k_len: int) -> torch.Tensor:
    """[q_len, k_len] bool: query i (at position k_len - q_len + i) sees keys 0..its position."""
    q_pos = torch.arange(k_len - q_len, k_len)
    return torch.arange(k_len)[None, :] <= q_pos[:, None]


lens_q, lens_k = [4, 3, 1], [4, 6, 4]
cu_q, cu_k = [0, *accumulate(lens_q)], [0, *accumulate(lens_k)]
print("cu_seqlens_q =", cu_q, "  cu_seqlens_k =", cu_k)
packed_mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
for b in range(len(lens_q)):
    packed_mask[cu_q[b] : cu_q[b + 1], cu_k[b] : cu_k[b + 1]] = offset_causal_mask(
        lens_q[b], lens_k[b])
show_mask(packed_mask)

# %% [markdown]
# Rows are the packed queries, columns the packed keys. The middle block shows the
# shifted triangle: the chunk's first query (position 3) sees the 3 cached keys and itself. The
# last row is the decode step, seeing all 4 of its keys. The zeros off the diagonal blocks are
# why packed attention is computed sequence by sequence (or, in a kernel, by giving each
# program one sequence), never as one big masked matrix: that would be almost all waste.
#
# Our final small version handles everything at once: packing, GQA and the shifted causal
# mask, each sequence with the stable softmax.

# %%
def attention(q, k, v, scale):
    """Causal GQA attention of q [Lq, H, d] over k, v [Lk, Hkv, d]; queries are the last Lq."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~offset_causal_mask(q.shape[0], k.shape[0]), float("-inf"))
    return torch.einsum("hij,jhd->ihd", stable_softmax(s), v)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    """Packed attention: sequence b's queries q[cu_q[b]:cu_q[b+1]] over its keys only."""
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        out[qs:qe] = attention(q[qs:qe], k[ks:ke], v[ks:ke], scale)
    return out


# (new queries, all keys) per sequence: a decode, a plain prompt, two chunks after prefixes
seqs = [(1, 29), (40, 40), (12, 40), (7, 33)]
cu_q = [0, *accumulate(ql for ql, _ in seqs)]
cu_k = [0, *accumulate(kl for _, kl in seqs)]
H, H_kv, d = 4, 2, 32
scale = d**-0.5
q_packed = rand(cu_q[-1], H, d, seed=8)
k_packed, v_packed = rand(cu_k[-1], H_kv, d, seed=9), rand(cu_k[-1], H_kv, d, seed=10)
ours = varlen_attention(q_packed, k_packed, v_packed, cu_q, cu_k, scale)
ref = torch.cat([reference_attention(q_packed[cu_q[b] : cu_q[b + 1]],
                                     k_packed[cu_k[b] : cu_k[b + 1]],
                                     v_packed[cu_k[b] : cu_k[b + 1]], scale)
                 for b in range(len(seqs))])
print("packed queries:", tuple(q_packed.shape), " packed keys:", tuple(k_packed.shape))
check("varlen attention (packed, GQA, cached prefixes) vs float64 reference", ours, ref, 1e-5)

# %% [markdown]
# ## 3. The package's PyTorch attention
#
# The package's reference backend, `nanovllm/layers/torch_attention.py`, is what we just
# built, with two differences. Instead of an explicit softmax it calls PyTorch's fused
# `F.scaled_dot_product_attention` (SDPA), which picks the fastest implementation it has for
# the device and the arguments (on a GPU usually a tiled, online-softmax one); and instead
# of contiguous K/V it reads them from the **paged KV cache**. `causal_attention` is one
# sequence's attention with the shifted mask (plain `is_causal` when there is no prefix, no
# mask at all for a single query); `paged_attention` runs a packed batch: all decode rows
# together, then each prefill chunk, gathering its keys and values from the cache blocks listed
# in its block table.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(torch_attention.causal_attention, torch_attention.gather_kv,
            torch_attention.paged_attention)

# %% [markdown]
# First `causal_attention` against our `attention`, on fresh random inputs covering the three
# branches (no prefix, a chunk after a prefix, a single query):

# %%
for i, (ql, kl) in enumerate([(40, 40), (12, 40), (1, 33), (25, 64)]):
    qs = rand(ql, 6, 16, seed=20 + i)
    ks, vs = rand(kl, 3, 16, seed=30 + i), rand(kl, 3, 16, seed=40 + i)
    check(f"causal_attention, {ql:2d} queries over {kl:2d} keys, vs ours",
          torch_attention.causal_attention(qs, ks, vs, 0.25), attention(qs, ks, vs, 0.25), 1e-5)

# %% [markdown]
# `paged_attention` needs the cache layout that chapter 04 builds. In brief: the cache is a
# pool of fixed-size **blocks**, `k_cache` and `v_cache` of shape
# `[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns some blocks, in any
# order, listed in its row of `block_tables` (padded with -1); its token $t$ lives in block
# `block_tables[b, t // block_size]` at row `t % block_size`. Writing a token's key and value
# goes through its **slot**, `block_id * block_size + row` (`store_kv`). The step's layout
# travels in an `AttentionMetadata` (`nanovllm/context.py`), with decode rows first.
#
# `paged_layout` scatters our packed K/V into such a cache with shuffled block ids, so that
# no sequence's blocks are contiguous, and describes the batch:

# %%
def paged_layout(k, v, seqs, block_size, seed=0, fill=0.0, device="cpu"):
    """Packed K/V of `seqs` = [(q_len, k_len), ...] -> (k_cache, v_cache, metadata)."""
    num_seqs = len(seqs)
    blocks_per_seq = [-(-kl // block_size) for _, kl in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks nobody owns
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((num_seqs, max(blocks_per_seq)), -1, dtype=torch.int32)
    slots = []
    for b, (_, kl) in enumerate(seqs):
        ids = torch.tensor([order.pop() for _ in range(blocks_per_seq[b])], dtype=torch.int32)
        tables[b, : len(ids)] = ids
        pos = torch.arange(kl)
        slots.append(ids[pos // block_size].long() * block_size + pos % block_size)
    shape = (num_blocks, block_size, k.shape[1], k.shape[2])
    k_cache = torch.full(shape, fill, dtype=k.dtype, device=device)
    v_cache = torch.full(shape, fill, dtype=v.dtype, device=device)
    torch_attention.store_kv(k.to(device), v.to(device), k_cache, v_cache,
                             torch.cat(slots).to(device))
    lens_q, lens_k = [ql for ql, _ in seqs], [kl for _, kl in seqs]
    cu = [0, *accumulate(lens_q)]
    int32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),  # K/V already stored
        cu_seqlens_q=torch.tensor(cu, **int32), seq_lens_k=torch.tensor(lens_k, **int32),
        block_tables=tables.to(device), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        num_decodes=sum(ql == 1 for ql in lens_q), cu_seqlens_q_host=cu, seq_lens_k_host=lens_k)
    return k_cache, v_cache, meta


block_size = 16
k_cache, v_cache, meta = paged_layout(k_packed, v_packed, seqs, block_size)
print("k_cache shape:", tuple(k_cache.shape), " num_decodes:", meta.num_decodes)
print("block_tables:\n", meta.block_tables)
out = torch_attention.paged_attention(q_packed, k_cache, v_cache, meta, scale)
check("paged_attention over shuffled blocks vs our varlen_attention", out, ours, 1e-5)
check("paged_attention vs float64 reference", out, ref, 1e-5)

# %% [markdown]
# The first sequence (a decode step with 29 keys) owns two blocks, the 40-key sequences three
# each, the last one three for its 33 keys; the ids are scattered over a pool of 14 blocks
# (the 11 owned and 3 spares), yet the package's attention reads exactly the right keys and agrees
# with our contiguous version and with the float64 definition.
#
# ## 4. Memory traffic: why tile at all?
#
# On a GPU the arithmetic is rarely the bottleneck of naive attention; memory is. A GPU
# computes in on-chip registers and shared memory (tens of megabytes in total) and keeps
# tensors in HBM, its main memory, which is large but much slower to reach. An unfused
# implementation runs one kernel per operation and passes the $L\times L$ intermediates
# through HBM: the first matmul **writes** $S$, the softmax **reads** $S$ and **writes** $P$,
# the second matmul **reads** $P$. That is at least $4L^2$ elements of traffic per head (more
# if scaling and masking are separate kernels), on top of reading $Q, K, V$ and writing $O$
# ($4Ld$ elements).
#
# A tiled kernel keeps a tile of $B_M$ queries in registers, streams the keys and values past
# it and writes only the output. $Q$ is read once and $O$ written once; $K$ and $V$ are read
# once *per query tile*, and with causal masking only up to the diagonal. For one head of
# $L$ tokens:
#
# $$\text{naive} \approx 4Ld\,e + 4L^2 e, \qquad
#   \text{tiled} \approx 2Ld\,e + 2d\,e \sum_{t} \min\big((t+1)B_M, L\big)
#   \approx 2Ld\,e + \frac{L^2 d\,e}{B_M},$$
#
# with $e$ bytes per element. The quadratic term shrinks by about $4B_M/d$, and more
# importantly no $L\times L$ matrix is ever stored: the extra memory of the tiled kernel is a
# tile of scores in registers. (On a GPU the repeated K/V reads mostly hit the L2 cache, so
# the tiled kernel's true HBM traffic is closer still to the minimum $4Ld\,e$.)

# %%
def naive_traffic(L: int, d: int, b: int = 2) -> int:
    """Bytes one head moves through HBM: read Q, K, V; write S; read S, write P; read P; write O."""
    return 4 * L * d * b + 4 * L * L * b


def tiled_traffic(L: int, d: int, block_m: int, b: int = 2) -> int:
    """Bytes one head moves: Q once, O once, K and V once per query tile up to the diagonal."""
    kv_rows = sum(min((t + 1) * block_m, L) for t in range(-(-L // block_m)))
    return 2 * L * d * b + 2 * kv_rows * d * b


def minimum_traffic(L: int, d: int, b: int = 2) -> int:
    return 4 * L * d * b  # read Q, K, V and write O, once each


d_model = smollm.head_dim
lengths = [2**i for i in range(8, 16)]
for L_ in (1024, 8192, 32768):
    naive, tiled = naive_traffic(L_, d_model), tiled_traffic(L_, d_model, 64)
    print(f"L = {L_:6,d}: naive {naive / 1e6:9.1f} MB, tiled (B_M = 64) {tiled / 1e6:7.1f} MB, "
          f"ratio {naive / tiled:4.1f}x  (per head per layer, bf16, head_dim {d_model})")
from nanovllm.viz.records import headline

# the book's one record of the H200's device-to-device copy bandwidth (nanovllm/viz/records.py)
H200_TB_PER_S = round(headline("h200_copy_bytes_per_s") / 1e12, 2)
L_ = 8192
layers_heads = smollm.num_layers * smollm.num_heads
naive_gb = naive_traffic(L_, d_model) * layers_heads / 1e9
tiled_gb = tiled_traffic(L_, d_model, 64) * layers_heads / 1e9
print(f"\nSmolLM2, one {L_:,d}-token prompt, all {smollm.num_layers} layers x {smollm.num_heads} "
      f"heads: naive moves {naive_gb:.1f} GB = {naive_gb / H200_TB_PER_S:.1f} ms at "
      f"{H200_TB_PER_S} TB/s; tiled {tiled_gb:.2f} GB = {tiled_gb / H200_TB_PER_S:.2f} ms")
print(f"one head's score matrix at L = {L_:,d} in bf16: {L_ * L_ * 2 / 2**20:.0f} MiB; "
      f"at L = 32,768: {32768**2 * 2 / 2**30:.0f} GiB")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10.5, 3.8))
L_arr = np.array(lengths)
ax1.loglog(L_arr, [naive_traffic(n, d_model) for n in lengths], "o-", label="naive (S, P in HBM)",
           color=BOOK_COLORS[3])
ax1.loglog(L_arr, [tiled_traffic(n, d_model, 64) for n in lengths], "o-",
           label="tiled, $B_M$ = 64", color=BOOK_COLORS[0])
ax1.loglog(L_arr, [minimum_traffic(n, d_model) for n in lengths], "--",
           label="minimum (Q, K, V, O once)", color="grey")
ax1.set_xlabel("sequence length L (tokens)")
ax1.set_ylabel("HBM traffic per head (bytes)")
ax1.set_title(f"One head, head_dim {d_model}, bf16, causal")
ax1.legend()
for i, bm in enumerate((16, 64, 128)):
    ratios = [naive_traffic(n, d_model) / tiled_traffic(n, d_model, bm) for n in lengths]
    ax2.semilogx(L_arr, ratios, "o-", label=f"$B_M$ = {bm}", color=BOOK_COLORS[[5, 0, 2][i]])
ax2.set_xlabel("sequence length L (tokens)")
ax2.set_ylabel("naive / tiled traffic")
ax2.set_title("Traffic saved by tiling")
ax2.legend(title="query tile")
for ax in (ax1, ax2):
    ax.set_xticks(lengths[::2], [f"{n:,d}" for n in lengths[::2]])
fig.tight_layout()
figure(fig, "02_attention_memory_traffic",
       "HBM traffic of one attention head for a causal prompt of L tokens"
       f" (head_dim {d_model}, bf16),"
       " from the formulas above: naive, tiled with 64-row query tiles, and the floor of reading"
       " Q, K, V and writing O once (left); the ratio naive / tiled for three query-tile sizes"
       " (right). Larger query tiles re-read K and V fewer times.")

# %% [markdown]
# Figure 2.2, left: bytes that one attention head moves through GPU memory for a causal prompt of
# $L$ tokens (SmolLM2's head_dim 64, bf16), computed with the formulas above. Both curves become
# quadratic, but the naive one sits several times higher and, above all, *stores* its $L\times L$
# matrices: at $L = 8{,}192$ one head's score matrix alone is 128 MiB, at 32,768 it is 2 GiB, per
# head, per layer in flight. Right: the ratio naive / tiled, which levels off near $4B_M/d$: larger
# query tiles re-read K and V fewer times (with 16-row tiles and head_dim 64 the re-reads cost as
# much traffic as the score matrix did, and what tiling still saves is the storage). The dashed line
# is the floor (each of Q, K, V, O crosses HBM once), which a tiled kernel approaches in practice
# because the re-reads of K and V mostly come from the L2 cache.
#
# ## 5. The Triton prefill kernel, tile by tile
#
# `nanovllm/kernels/prefill_attention.py` is the prefill path of the `triton` attention
# backend: causal attention of a packed batch of new tokens over the **paged** cache, every
# feature of section 2 in one GPU kernel. Its docstring is the specification:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.kernels import prefill_attention as prefill_kernel  # imports triton

display(Markdown(prefill_kernel.__doc__))
print("kernel mode:", "Triton interpreter (CPU)" if prefill_kernel._is_interpreted()
      else "compiled for the GPU")


# %% [markdown]
# Triton programs are written for *one program instance*, which works on blocks of data with
# whole-tile operations (`tl.load` of a tile of pointers, `tl.dot` of two tiles); the launcher
# starts a grid of such programs, which the GPU runs in parallel. Let us read the kernel in the
# order it runs. The excerpts below are cut from the module's source.

# %%
def show_excerpt(first: str, last: str, before: int = 0, module=prefill_kernel) -> None:
    """Render `module`'s lines from the one containing `first` (and `before` lines above it)
    to the next line containing `last`."""
    lines = inspect.getsource(module).splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    display(Markdown("```python\n" + "\n".join(lines[start - before : end + 1]) + "\n```"))


# %% [markdown]
# **The grid.** The launcher starts one program per (query tile, head, sequence):

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("num_m_tiles = triton.cdiv(max_seqlen_q, tile_m)", "grid = (num_m_tiles")

# %% [markdown]
# Sequences differ in length but the grid is rectangular, so it is sized by the longest chunk
# (`max_seqlen_q`); programs whose query tile lies past their own sequence's end return at once.
# Each program first finds its place. Program ids on axis 0 are handed out in *reverse*:
# the last query tile of a sequence sees the most keys, so the heaviest programs start first
# and the light ones fill the tail of the launch.

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("m_tile = num_m_tiles - 1 - tl.program_id(0)", "kv_head = head // GROUP")

# %% [markdown]
# `prefix_len = kv_len - q_len` is the shift of section 2.6, and `kv_head = head // GROUP` is
# GQA. **The query tile** (`BLOCK_M` rows of `HEAD_DIM` channels) is loaded once and stays in
# registers for the whole program, next to the online-softmax state of section 2.4: `m_i`,
# `l_i` and the accumulator `acc`, all in fp32.

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("offs_m = m_tile * BLOCK_M", "acc = tl.zeros([BLOCK_M, HEAD_DIM]")

# %% [markdown]
# **The key loop, with causal tile skipping.** A key tile falls into one of three classes for
# a given query tile: entirely visible to every query row (no mask needed), crossing the
# diagonal (mask needed), or entirely in the future of every row (skip it: no loads, no
# math). The kernel computes the boundaries `n_full` (keys every row sees) and `n_end` (one past
# the last key the tile's last row sees) and runs the loop twice, once without and once with
# the mask; keys at or beyond `n_end` are never visited. Then it divides by `l` and stores.

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("# Keys [0, n_full) are visible", "tl.store(o_ptrs")

# %% [markdown]
# **Reading K and V through the block table.** Inside the loop each key tile's cache block is
# looked up in the sequence's row of the block table. Both tile and block sizes are powers of
# two, so when `BLOCK_N <= block_size` a key tile lies inside one block and needs one id;
# otherwise each key gets its own. K is loaded transposed (`[HEAD_DIM, BLOCK_N]`) so that
# `tl.dot(q, k_t)` gives the score tile. Keys past the sequence's end are masked *before* their
# block id would be read, so the table's `-1` padding is never used as an address.

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("for start_n in range(n_start, n_end, BLOCK_N):", "v = tl.load(v_ptrs")

# %% [markdown]
# **Online softmax in registers.** The rest of the loop body computes the score tile with
# `tl.dot` and then is section 2.4 line for line. Two details: with 16-bit inputs on a GPU
# the products run on the tensor cores with fp32 accumulation (the probabilities `p` are
# rounded to the input dtype for the second product), while fp32 inputs take exact IEEE fp32
# products (`DOT_FP32`); and the scores are multiplied by `qk_scale` = scale × $\log_2 e$, so
# the kernel can use `exp2` (a single hardware instruction) instead of `exp`:
# $2^{x\log_2 e} = e^x$.

# %%
# NBVAL_IGNORE_OUTPUT
show_excerpt("k_t = k_t.to(tl.float32)", "m_i = m_new", before=1)


# %% [markdown]
# ### 5.1 What the tile loop visits
#
# The boundaries are simple integer arithmetic, so we can replay them in Python and draw which
# (query tile, key tile) pairs a sequence's programs touch. `tile_classes` mirrors the kernel's
# `first_pos`, `n_full` and `n_end`; the cell then checks on random shapes that the schedule is
# right: every key a query may see lies in a visited tile, and the unmasked tiles contain only
# keys that every row of the query tile may see.

# %%
def tile_classes(q_len: int, kv_len: int, block_m: int, block_n: int) -> np.ndarray:
    """[query tiles, key tiles]: 2 = visited without mask, 1 = visited with mask, 0 = skipped."""
    prefix = kv_len - q_len
    classes = np.zeros((-(-q_len // block_m), -(-kv_len // block_n)), dtype=int)
    for m_tile in range(classes.shape[0]):
        first_pos = prefix + m_tile * block_m
        n_full = (first_pos + 1) // block_n * block_n
        n_end = prefix + min((m_tile + 1) * block_m, q_len)
        for n_tile in range(classes.shape[1]):
            start = n_tile * block_n
            classes[m_tile, n_tile] = 2 if start < n_full else (1 if start < n_end else 0)
    return classes


rng = np.random.default_rng(0)
for _ in range(300):
    kv_len = int(rng.integers(1, 300))
    q_len = int(rng.integers(1, kv_len + 1))
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    classes = tile_classes(q_len, kv_len, bm, bn)
    visible = offset_causal_mask(q_len, kv_len).numpy()
    for i in range(q_len):
        seen = np.flatnonzero(visible[i])
        assert (classes[i // bm, seen // bn] > 0).all(), "a visible key was skipped"
    for m_tile, n_tile in zip(*np.nonzero(classes == 2)):
        rows = visible[m_tile * bm : (m_tile + 1) * bm, n_tile * bn : (n_tile + 1) * bn]
        assert rows.all(), "an unmasked tile holds a key some row must not see"
print("tile schedule checked on 300 random (q_len, kv_len, BLOCK_M, BLOCK_N)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2))
cmap = plt.matplotlib.colors.ListedColormap(["white", BOOK_COLORS[1], BOOK_COLORS[0]])
for ax, (ql, kl) in zip(axes, [(128, 128), (64, 128)]):
    bm = bn = 16
    classes = tile_classes(ql, kl, bm, bn)
    ax.imshow(classes, cmap=cmap, vmin=0, vmax=2, extent=(0, kl, ql, 0), aspect="equal")
    ax.plot([kl - ql, kl], [0, ql], color="black", lw=1.2)  # the causal diagonal
    ax.set_xticks(range(0, kl + 1, 32))
    ax.set_yticks(range(0, ql + 1, 32))
    ax.grid(False)
    for x in range(0, kl + 1, bn):
        ax.axvline(x, color="grey", lw=0.4)
    for y in range(0, ql + 1, bm):
        ax.axhline(y, color="grey", lw=0.4)
    visited = (classes > 0).mean()
    prefix = f", after a {kl - ql}-token prefix" if kl > ql else ""
    ax.set_title(f"{ql} queries over {kl} keys{prefix}\nvisits {visited:.0%} of the tiles",
                 fontsize=11)
    ax.set_xlabel("key position")
    ax.set_ylabel("query (new token)")
handles = [plt.matplotlib.patches.Patch(color=BOOK_COLORS[0], label="no mask"),
           plt.matplotlib.patches.Patch(color=BOOK_COLORS[1], label="masked (crosses diagonal)"),
           plt.matplotlib.patches.Patch(facecolor="white", edgecolor="grey", label="skipped")]
fig.legend(handles=handles, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.04))
fig.tight_layout(rect=(0, 0.06, 1, 1))
figure(fig, "02_attention_tiles",
       "The (query tile, key tile) pairs the Triton prefill kernel visits with 16 x 16 tiles:"
       " without a mask, with a mask (crossing the causal diagonal) or skipped, for a 128-token"
       " prompt (left) and for 64 new tokens after a 64-token cached prefix (right).")
for ql, kl in [(128, 128), (64, 128)]:
    counts = np.bincount(tile_classes(ql, kl, 16, 16).ravel(), minlength=3)
    print(f"{ql} queries over {kl} keys, 16 x 16 tiles: {counts[2]} unmasked, {counts[1]} masked, "
          f"{counts[0]} skipped of {counts.sum()}")

# %% [markdown]
# Figure 2.3 shows which (query tile, key tile) pairs the kernel visits, 16 × 16 tiles. Each row of
# tiles is one program (per head). For a plain prompt (left) the kernel visits the lower triangle of
# tiles: 28 without a mask, 8 on the diagonal with one, and skips the other 28, so causal attention
# costs a little over half of full attention. For a chunk after a cached prefix (right) every query
# sees the whole prefix, so more tiles run unmasked, and the diagonal is shifted right by the
# prefix, exactly as in the mask of section 2.6.
#
# ### 5.2 Running the kernel
#
# Now the real thing, on the packed batch of section 2.6 (a decode row, a 40-token prompt and
# two chunks after cached prefixes; 4 query heads over 2 KV heads, head_dim 32, blocks of 16
# tokens). On a CPU it runs under the Triton interpreter, which executes each program's tile
# operations with NumPy: slow (far slower than PyTorch on the same CPU), but the same
# code, the same tiles and the same block-table reads as on a GPU. To make the test harsher,
# every cache row that no sequence owns is filled with NaN: if the kernel read one, the output
# would be NaN. We try three tile shapes: 16 × 16 (many tiles, both loops busy), 32 × 32 (the
# CPU default) and 16 × 32 (key tiles larger than cache blocks: one block id per key).

# %%
k_cache_nan, v_cache_nan, meta_dev = paged_layout(k_packed, v_packed, seqs, block_size,
                                                  fill=float("nan"), device=device)
print("unowned cache rows holding NaN:", int(k_cache_nan[..., 0, 0].isnan().sum()))


def run_kernel(q, k_cache, v_cache, meta, tiles=None):
    return prefill_kernel.prefill_attention(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, scale,
        meta.max_seqlen_q, tiles=tiles)


for block_m, block_n in [(16, 16), (32, 32), (16, 32)]:
    num_m_tiles = -(-meta_dev.max_seqlen_q // block_m)
    print(f"tiles {block_m} x {block_n}: grid = ({num_m_tiles} query tiles, {H} heads, "
          f"{len(seqs)} sequences) = {num_m_tiles * H * len(seqs)} programs")
    out = run_kernel(q_packed.to(device), k_cache_nan, v_cache_nan, meta_dev,
                     tiles=(block_m, block_n, 4, 2))  # (BLOCK_M, BLOCK_N, warps, stages)
    assert torch.isfinite(out).all()
    check(f"Triton kernel, fp32, tiles {block_m:2d} x {block_n:2d}, vs float64 reference",
          out, ref, 2e-5)
check("Triton kernel, fp32, vs package paged_attention", out, ours, 2e-5)

# %% [markdown]
# The grid is sized by the longest chunk (40 new tokens), so with 16-row query tiles it has
# 48 programs; those of the decode row and of the short chunks beyond their own last query
# tile returned at once. In fp16 the kernel's products run in half precision (on a GPU, on
# the tensor cores), so we compare with the reference computed from the same fp16 inputs and
# allow for the error that fp16 rounding of the probabilities brings:

# %%
q16, k16, v16 = q_packed.half(), k_packed.half(), v_packed.half()
kc16, vc16, meta16 = paged_layout(k16, v16, seqs, block_size, fill=float("nan"), device=device)
out16 = run_kernel(q16.to(device), kc16, vc16, meta16)
ref16 = torch.cat([reference_attention(q16[cu_q[b] : cu_q[b + 1]], k16[cu_k[b] : cu_k[b + 1]],
                                       v16[cu_k[b] : cu_k[b + 1]], scale)
                   for b in range(len(seqs))])
print("output dtype:", out16.dtype)
check("Triton kernel, fp16, vs float64 reference", out16, ref16, 5e-3)

# %% [markdown]
# On a GPU the next cell times the kernel live on the benchmark's prefill shape (a few hundred
# prompts of up to about a thousand tokens, with Qwen3-0.6B's attention heads, in bf16), with
# the functions of `nanovllm/benchmarks/prefill_kernel.py`, against PyTorch's `varlen_attn` on
# contiguous K/V where this PyTorch has it. On a CPU it only says so; section 7 plots the
# results recorded on an H200.

# %%
# NBVAL_IGNORE_OUTPUT
if device == "cuda":
    from nanovllm.benchmarks import prefill_kernel as bp

    bench_seqs = [(n, n) for n in bp.prompt_lengths()]
    flops = bp.attention_flops(bench_seqs, *bp.QWEN3_0_6B[::2])
    print(f"{torch.cuda.get_device_name()}: {len(bench_seqs)} prompts, "
          f"{sum(n for n, _ in bench_seqs):,d} tokens, {flops / 1e12:.3f} TFLOP per pass")
    for bs in (256, 16):
        case = bp.build_case(bench_seqs, bs, torch.bfloat16, bp.QWEN3_0_6B)
        ms = bp.bench(bp.kernel_call(case))
        print(f"  ours, paged (block size {bs:3d}): {ms * 1e3:8.1f} us  "
              f"{flops / ms / 1e9:6.1f} TFLOP/s")
    for name, fn in bp.varlen_peers(case).items():
        ms = bp.bench(fn)
        print(f"  torch {name:18s}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s")
    del case
else:
    print("no GPU here: the kernel ran under the Triton interpreter (correctness only); "
          "see section 7 for the H200 numbers")

# %% [markdown]
# ## 6. Switching it on in the engine
#
# The attention layer (`nanovllm/layers/attention.py`) stores the step's new keys and values
# into the paged cache, then hands the query and the cache to its **backend** (one class per
# backend in `nanovllm/layers/attention_backends.py`). The `triton` backend sends the decode rows
# to the decode kernel of chapter 05 and everything else to the prefill kernel above, shifting the
# query offsets past the decodes:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers import attention as attention_layer
from nanovllm.layers import attention_backends

show_source(attention_backends.TritonBackend, attention_backends.resolve_backend,
            attention_layer.Attention.forward)

# %% [markdown]
# `EngineConfig(attention_backend=...)` picks the backend ("auto" takes Triton on a GPU and
# PyTorch on a CPU). To exercise every path of the kernel inside the engine we use a tiny
# 2-layer Llama with random weights (4 query heads over 2 KV heads, head_dim 16), saved with
# `transformers` into a temporary folder. Its weights are drawn with a standard deviation of
# 0.2 (rather than the usual 0.02) so that its greedy output depends visibly on attention. A
# warm-up request puts a 24-token shared prefix into the prefix cache; then three prompts that
# start with it are generated with a step budget of 32 tokens, so the batches mix decode rows,
# chunks that start after a cached prefix and chunks of a split prompt. Both backends run in
# fp32; greedy tokens must be identical.

# %%
import tempfile

import transformers

from nanovllm import LLM, SamplingParams

transformers.utils.logging.disable_progress_bar()
tiny_config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=False, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)
torch.manual_seed(0)
tiny_path = Path(tempfile.mkdtemp()) / "tiny-llama"
transformers.LlamaForCausalLM(tiny_config).save_pretrained(tiny_path)

gen = torch.Generator().manual_seed(0)
shared = torch.randint(0, 256, (24,), generator=gen).tolist()
prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 11, 16)]
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
engine_tokens, engine_seconds, hits = {}, {}, {}
for backend in ("torch", "triton"):
    llm = LLM(str(tiny_path), attention_backend=backend, dtype="float32", enforce_eager=True,
              num_kv_blocks=64, max_num_batched_tokens=32)
    llm.generate([shared + [1]], greedy, use_tqdm=False)  # warm-up: caches the shared prefix
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    engine_seconds[backend] = time.perf_counter() - start
    engine_tokens[backend] = [o.token_ids for o in outputs]
    hits[backend] = llm.engine.block_manager.hit_tokens
    print(f"{backend:6s} backend: {engine_tokens[backend]}")
    del llm

# %%
# NBVAL_CHECK_OUTPUT
print(f"prompt tokens found in the prefix cache: {hits['torch']} (torch), "
      f"{hits['triton']} (triton)")
print("triton tokens == torch tokens:", engine_tokens["triton"] == engine_tokens["torch"])
assert engine_tokens["triton"] == engine_tokens["torch"]

# %%
# NBVAL_IGNORE_OUTPUT
for backend, seconds in engine_seconds.items():
    print(f"{backend:6s} backend on {device}: {seconds:.2f} s for 3 x 6 tokens")

# %% [markdown]
# 48 prompt tokens came from the prefix cache (16 per prompt: one full block of the shared 24
# tokens), so each prompt's first chunk already started after a cached prefix. On a CPU the
# Triton run is far slower than the PyTorch one: the interpreter executes the kernel's tile
# operations one program at a time in Python. That is its purpose here, a faithful way to run
# and test the GPU code anywhere; speed is a GPU matter, and the next section shows it.
#
# ## 7. Recorded on an H200
#
# `python -m nanovllm.benchmarks.prefill_kernel` times the kernel on the benchmark's prefill shape
# and, in the same run, PyTorch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention
# through PyTorch) on the same values stored *contiguously*, the layout that needs no block
# table. Throughput counts useful FLOPs only,
# $4\,d\,H \sum_b \big(q_b(k_b-q_b) + q_b(q_b+1)/2\big)$: the (query, key) pairs the causal
# mask allows. The results were recorded on an H200 into
# `figures/data/prefill_kernel_h200.json` (Qwen3-0.6B's attention shape) and
# `prefill_kernel_h200_hd64.json` (SmolLM2's):

# %%
# NBVAL_CHECK_OUTPUT
data_dir = figures_dir() / "data"
recorded = {
    "Qwen3-0.6B shape": json.loads((data_dir / "prefill_kernel_h200.json").read_text()),
    "SmolLM2 shape": json.loads((data_dir / "prefill_kernel_h200_hd64.json").read_text()),
}


def recorded_tflops(result: dict) -> dict:
    """{'ours, block 256': TFLOP/s, 'ours, block 16': ..., 'varlen_attn': ...} of one run."""
    runs = {}
    for r in result["runs"]:
        if r["name"] == "triton_prefill_paged":
            runs[f"ours, block {r['block_size']}"] = r["tflops"]
        elif r["name"] == "varlen_attn (contiguous)":
            runs["varlen_attn"] = r["tflops"]
    order = ["ours, block 256", "ours, block 16", "varlen_attn"]
    return {name: runs[name] for name in order if name in runs}


BAR_LABELS = {"ours, block 256": "ours, paged\n(block 256)", "ours, block 16":
              "ours, paged\n(block 16)", "varlen_attn": "torch varlen_attn\n(contiguous)"}


from nanovllm.benchmarks.prefill_kernel import prompt_lengths

defaults = inspect.signature(prompt_lengths).parameters
lens = prompt_lengths()
print(f"workload: {len(lens)} prompt lengths drawn from {defaults['low'].default}.."
      f"{defaults['high'].default} (seed {defaults['seed'].default}): {min(lens)}..{max(lens)}, "
      f"{sum(lens):,d} tokens")
for label, result in recorded.items():
    assert result["workload"]["total_tokens"] == sum(lens)
    w = result["workload"]
    print(f"{label}: {result['device']}, {result['date'][:10]}, torch {result['torch']}, "
          f"triton {result['triton']}")
    print(f"  command: {result['command']}")
    print(f"  {w['num_prompts']} prompts, {w['total_tokens']:,d} tokens, heads {w['num_heads']}/"
          f"{w['num_kv_heads']}, head_dim {w['head_dim']}, {w['dtype']}, "
          f"{w['flops'] / 1e12:.3f} TFLOP; tiles {tuple(result['tiles'].values())}")
    for name, tflops in recorded_tflops(result).items():
        print(f"  {name:16s} {tflops:6.1f} TFLOP/s")
    print(f"  agreement with varlen_attn (relative error): "
          f"{result['agreement_rel_err_vs_varlen_attn']:.1e}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.9), sharey=True)
for ax, (label, result) in zip(axes, recorded.items()):
    runs = recorded_tflops(result)
    colors = [BOOK_COLORS[0], BOOK_COLORS[5], BOOK_COLORS[1]]
    bars = ax.bar([BAR_LABELS[n] for n in runs], list(runs.values()), color=colors[: len(runs)])
    ax.bar_label(bars, fmt="%.0f", padding=2)
    ax.set_ylim(0, 1.15 * max(runs.values()))
    w = result["workload"]
    ax.set_title(f"{label}: {w['num_heads']}/{w['num_kv_heads']} heads, head_dim {w['head_dim']}",
                 fontsize=11)
    ax.grid(axis="x", visible=False)
axes[0].set_ylabel("attention TFLOP/s (bf16)")
first = recorded["Qwen3-0.6B shape"]
work = first["workload"]
fig.suptitle(f"Recorded: {first['device']}, {first['date'][:10]}, {work['num_prompts']} prompts / "
             f"{work['total_tokens']:,d} tokens, causal prefill", fontsize=11)
fig.text(0.5, -0.02, "commands: " + " ; ".join(r["command"].split(" --out")[0]
                                               for r in recorded.values()),
         ha="center", fontsize=8, color="grey")
fig.tight_layout()
figure(fig, "02_attention_h200",
       f"Recorded causal-prefill attention throughput on {first['device']} ({work['dtype']},"
       f" {work['num_prompts']} prompts, no cached prefix) with Qwen3-0.6B's head shape (left) and"
       " SmolLM2's (right): our Triton kernel reading K/V through block tables, with 256-token and"
       " 16-token cache blocks, against PyTorch's varlen_attn reading the same K/V contiguously.")

# %%
# NBVAL_CHECK_OUTPUT
tiles_runs = [r for r in recorded["Qwen3-0.6B shape"]["runs"] if "tiles" in r]
print("tile sweep, Qwen3-0.6B shape (BLOCK_M, BLOCK_N, warps, stages): TFLOP/s at block 256 / 16")
for tiles in dict.fromkeys(tuple(r["tiles"]) for r in tiles_runs):
    by_block = {r["block_size"]: r["tflops"] for r in tiles_runs if tuple(r["tiles"]) == tiles}
    print(f"  {str(tiles):16s} {by_block[256]:6.1f} / {by_block[16]:6.1f}")
H200_BF16_MATMUL_TFLOPS = round(headline("h200_bf16_matmul_flops") / 1e12)  # bf16 8192^3 matmul
for label, result in recorded.items():
    runs = recorded_tflops(result)
    speedup = runs["ours, block 256"] / runs["varlen_attn"]
    print(f"{label}: ours (block 256) / varlen_attn = {speedup:.2f}x; "
          f"block 16 costs {1 - runs['ours, block 16'] / runs['ours, block 256']:.0%}; "
          f"{runs['ours, block 256'] / H200_BF16_MATMUL_TFLOPS:.0%} of a {H200_BF16_MATMUL_TFLOPS} "
          f"TFLOP/s bf16 matmul")

# %% [markdown]
# Figure 2.4 shows the recorded prefill attention throughput on an NVIDIA H200 (bf16, 256 prompts of
# 100–1,024 tokens, no cached prefix), for our Triton kernel reading K/V through block tables with
# cache blocks of 256 and 16 tokens, and for PyTorch's `varlen_attn` reading the same K/V laid out
# contiguously. Date, versions and commands are printed above.
#
# With Qwen3-0.6B's shape our paged kernel reaches 234 TFLOP/s with 256-token blocks and 213
# with 16-token blocks, against 165 for `varlen_attn`: 1.42× faster, despite the indirection
# through the block table. Read that ratio in its context: one workload (prefills only, no
# cached prefix), bf16, torch 2.11's `varlen_attn`, one session on one GPU. It says nothing
# about decode steps, and nothing about FlashAttention's newest kernels, which come next. With
# SmolLM2's smaller heads (head_dim 64) the gap is wider (2.12×), mostly because `varlen_attn`
# drops to 107 TFLOP/s there. Small blocks cost a little (more block-id lookups, less contiguous
# loads), about 9% at head_dim 128. The sweep shows how the tiles were chosen: 64 query rows × 32
# keys with 4 warps is the best of those tried; 8 warps or 128-row tiles are slower (the kernel's
# docstring explains the choice by register pressure: the fp32 score tile, the accumulator and the
# K/V pointers must stay in registers). For scale, the last column printed above compares the
# kernel with a large bf16 matmul on the same machine: prefill attention runs at a fraction of the
# dense-matmul rate. Attention has more to do per FLOP than a matmul: the softmax's exponentials,
# the masked diagonal tiles and, with prompts of at most 1,024 tokens, many short sequences whose
# programs have little work each.

# %% [markdown]
# ### 7.1 Against FlashAttention-4
#
# The engine can also run FlashAttention's own kernels: `LLM(..., attention_backend="flash_attn")`
# uses FlashAttention-4 (the `flash-attn-4` package, written in NVIDIA's CuTe DSL, Hopper or newer
# GPUs) on the same paged cache (`nanovllm/layers/flash_attention.py`). A second benchmark,
# `python -m nanovllm.benchmarks.attention_backends`, times both backends through the engine's
# entry point on one causal prompt of 1k to 8k tokens (Qwen3-0.6B's heads, bf16, 16-token cache
# blocks), in the same run on the same H200:

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.benchmarks.attention_backends import comparison

fa_record = json.loads((data_dir / "attention_backends_h200.json").read_text())
print(f"{fa_record['device']}, {fa_record['date'][:10]}, flash-attn-4 {fa_record['flash_attn_4']}, "
      f"triton {fa_record['triton']}; command: {fa_record['command'].split(' --out')[0]}")
print(" prompt   ours TFLOP/s   flash-attn TFLOP/s   our time / theirs")
fa_prefill = comparison(fa_record, "prefill")
for row in fa_prefill:
    print(f"{row['tokens']:7d} {row['ours']:14.0f} {row['flash_attn']:20.0f} {row['ratio']:17.2f}x")
print(f"FlashAttention-4 is {min(r['ratio'] for r in fa_prefill):.1f}-"
      f"{max(r['ratio'] for r in fa_prefill):.1f}x faster than our prefill kernel here")

# %% [markdown]
# Here ours loses, clearly. FlashAttention-4 on Hopper uses what our Triton kernel does not:
# the tensor memory accelerator (TMA) that copies tiles between global and shared memory
# without occupying threads, warp specialization (some warps only load while others only
# compute, overlapping the two), and the Hopper `wgmma` matrix instructions with deeper
# software pipelining. Our kernel is a readable 64×32-tile loop; closing the gap means
# adopting those techniques (Triton exposes some of them, e.g. TMA descriptors and warp
# specialization in recent versions). Chapter 05 makes the same comparison for decode, where
# the answer is different, and chapter 11 for the whole engine.

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# these parts of the package yourself: the PyTorch attention with its shifted causal mask, and the
# loop that runs a packed batch of decodes and prefill chunks. Each function's docstring is the
# handout; the project's tests grade your code (`make check CHAPTERS=02` in your edition), and once
# they pass this notebook runs on your own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("02"))

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to write (replace its `raise NotImplementedError`); the cell after
# it checks your version on
# seeded random inputs against a reference written differently (PyTorch's `softmax`, a loop over
# positions, float64 attention one sequence at a time), never against the package. The cells
# are self-contained: run them in any order.
#
# **Exercise 1 — online softmax.** Write `online_softmax(score_tiles)`: given a list of score
# tiles `[R, n_1], [R, n_2], ...` (the column blocks of one `[R, N]` score matrix, in order),
# return `softmax` of the whole matrix along its last dimension, `[R, N]`. Find each row's
# maximum and normaliser in **one pass** over the tiles with a running max `m` and running sum
# `ell` (rescaling `ell` when `m` grows), then normalise each tile with the final `m`, `ell`.
# Scores can be huge (±1000: no overflow allowed) and can be `-inf` (masked keys); a row may
# have entire tiles of `-inf`, even its first tiles, but every row has at least one finite score.

# %% tags=["exercise"]
import torch


def online_softmax(score_tiles: list[torch.Tensor]) -> torch.Tensor:
    """softmax(cat(score_tiles, dim=1), dim=1), with the row statistics found in one pass."""
    raise NotImplementedError("exercise 02.online_softmax")


# %% tags=["check", "raises-exception"]
import torch

gen = torch.Generator().manual_seed(201)
for trial in range(20):
    rows = int(torch.randint(1, 9, (1,), generator=gen))
    widths = torch.randint(1, 12, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
    spread = [1.0, 30.0, 1000.0][trial % 3]
    scores = torch.randn(rows, int(widths.sum()), generator=gen) * spread
    scores[torch.rand(scores.shape, generator=gen) < 0.3] = float("-inf")  # masked keys
    if trial % 2:  # some rows see nothing in their first tile(s)
        scores[: rows // 2 + 1, : int(widths[0])] = float("-inf")
    keep = torch.randint(0, scores.shape[1], (rows,), generator=gen)
    scores[torch.arange(rows), keep] = torch.randn(rows, generator=gen) * spread  # >= 1 finite
    tiles = list(scores.split(widths.tolist(), dim=1))
    out = online_softmax(tiles)
    assert out.shape == scores.shape, f"shape {tuple(out.shape)}, expected {tuple(scores.shape)}"
    assert torch.isfinite(out).all(), f"non-finite probabilities (score spread {spread})"
    torch.testing.assert_close(out, torch.softmax(scores, dim=1), atol=1e-6, rtol=1e-5)
print("Exercise 1 passed: online_softmax equals softmax on 20 random tiled score matrices")

# %% [markdown]
# **Exercise 2 — the causal mask after a prefix.** Write `causal_mask(q_len, k_len)`: a
# boolean `[q_len, k_len]` tensor that is `True` where query `i` may attend to key `j`, for the
# last `q_len` of `k_len` positions (a chunk after a cached prefix of `k_len - q_len` tokens).
# The check compares your mask, position by position, with the rule above, and uses it for
# attention against a float64 reference that attends one query at a time.

# %% tags=["exercise"]
import torch


def causal_mask(q_len: int, k_len: int) -> torch.Tensor:
    """[q_len, k_len] bool: query i, at position k_len - q_len + i, sees keys 0 .. that position."""
    raise NotImplementedError("exercise 02.causal_mask")


# %% tags=["check", "raises-exception"]
import torch
import torch.nn.functional as F

gen = torch.Generator().manual_seed(202)
shapes = [(1, 1), (1, 9), (9, 9), (5, 17)]
shapes += [(int(q), int(q) + int(p)) for q, p in zip(torch.randint(1, 40, (8,), generator=gen),
                                                     torch.randint(0, 40, (8,), generator=gen))]
for q_len, k_len in shapes:
    mask = causal_mask(q_len, k_len)
    assert mask.shape == (q_len, k_len) and mask.dtype == torch.bool, "want a [q_len, k_len] bool"
    assert int(mask.sum()) == q_len * (k_len - q_len) + q_len * (q_len + 1) // 2, "wrong key count"
    prefix = k_len - q_len
    for i in range(q_len):  # reference: query i sits at position prefix + i
        for j in range(k_len):
            assert bool(mask[i, j]) == (j <= prefix + i), (
                f"q_len {q_len}, k_len {k_len}: query {i} (position {prefix + i}) and key {j} "
                f"should be {'visible' if j <= prefix + i else 'masked'}")
    # the mask in attention, against float64 attention computed one query at a time
    q = torch.randn(q_len, 4, 16, generator=gen)
    k, v = torch.randn(k_len, 4, 16, generator=gen), torch.randn(k_len, 4, 16, generator=gen)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=0.25).transpose(0, 1)
    expected = torch.empty(q_len, 4, 16, dtype=torch.float64)
    for i in range(q_len):
        seen = prefix + i + 1  # keys 0 .. prefix + i
        scores = torch.einsum("hd,khd->hk", q[i].double(), k[:seen].double()) * 0.25
        expected[i] = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), v[:seen].double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
print(f"Exercise 2 passed: causal_mask matches the position rule on {len(shapes)} shapes, and "
      "attention with it matches a float64 reference")

# %% [markdown]
# **Exercise 3 — pack a batch.** Write `pack_varlen(seqs)`: given a list of tensors
# `[L_b, H, d]` (some `L_b` may be 0), return the packed tensor `[sum L_b, H, d]` and
# `cu_seqlens`, an int32 tensor `[B + 1]` with `cu_seqlens[b]` the row where sequence `b`
# starts (and `cu_seqlens[B]` the total). The check also runs causal attention over your
# packed batch with one block-diagonal mask built from your `cu_seqlens` and compares it with
# float64 causal attention applied to each sequence alone.

# %% tags=["exercise"]
import torch


def pack_varlen(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the sequences end to end; cu_seqlens[b] = first row of sequence b (int32, B + 1)."""
    raise NotImplementedError("exercise 02.pack_varlen")


# %% tags=["check", "raises-exception"]
import torch
import torch.nn.functional as F


def reference_causal_attention(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 self-attention of one sequence [L, H, d], keys after the query scored -inf."""
    x64 = x.double()
    scores = torch.einsum("qhd,khd->hqk", x64, x64) * scale
    future = torch.ones(len(x), len(x), dtype=torch.bool).triu(diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, x64)


gen = torch.Generator().manual_seed(203)
for _ in range(5):
    lengths = torch.randint(0, 30, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
    lengths[0] = max(int(lengths[0]), 1)
    seqs = [torch.randn(int(n), 4, 16, generator=gen) for n in lengths]
    packed, cu = pack_varlen(seqs)
    assert cu.dtype == torch.int32 and cu.shape == (len(seqs) + 1,), "cu_seqlens: int32 [B + 1]"
    assert cu.tolist() == [0, *torch.cumsum(lengths, 0).tolist()], f"wrong cu_seqlens {cu.tolist()}"
    assert torch.equal(packed, torch.cat(seqs)), "packed rows differ from the sequences"
    # one block-diagonal causal mask over the packed tokens, built from cu_seqlens
    seq_id = torch.repeat_interleave(torch.arange(len(seqs)), cu.diff().long())
    pos = torch.arange(len(packed))
    mask = (seq_id[:, None] == seq_id[None, :]) & (pos[None, :] <= pos[:, None])
    t = packed.transpose(0, 1)
    out = F.scaled_dot_product_attention(t, t, t, attn_mask=mask, scale=0.25).transpose(0, 1)
    expected = torch.cat([reference_causal_attention(s, 0.25) for s in seqs if len(s)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
print("Exercise 3 passed: pack_varlen on 5 random batches; packed attention matches float64 "
      "attention per sequence")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/02.json` *before* measuring; then `make analysis CH=02 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("02")

# %% [markdown]
# ## Summary
#
# - Attention is the only part of a layer whose cost grows with the context: about
#   $4(t+1)dH$ FLOPs for a token at position $t$, against a fixed cost for the projections and
#   the MLP. For SmolLM2 the two are equal at position 3,072; a prompt's attention grows as $L^2$.
# - We built it from the formula $\mathrm{softmax}(QK^\top/\sqrt d)V$, checking every step
#   against a float64 definition: a **causal mask** of $-\infty$ scores; the **stable softmax**,
#   which subtracts the row maximum because $e^x$ overflows fp16 above 11 and fp32 above 88;
#   the **online softmax**, a running max, sum and rescaled accumulator per query row, exact by
#   induction and independent of the tile size; **GQA**, an indexing rule
#   (query head $h$ reads KV head $h\,/\!/\,$group) that shrinks the KV cache; and **packing**
#   with `cu_seqlens`, where a chunk after a cached prefix shifts the causal diagonal: query $i$
#   sits at position $L_k - L_q + i$.
# - The package's PyTorch backend (`nanovllm/layers/torch_attention.py`) computes the same
#   thing over the paged cache: `causal_attention` per sequence, `paged_attention` per packed
#   batch, both agreeing with our versions and with the definition.
# - Tiling is about memory: naive attention moves and stores $L\times L$ matrices, a tiled
#   kernel keeps a query tile and its softmax state in registers and reads K and V once per
#   query tile (Figure 2.2).
# - The Triton kernel (`nanovllm/kernels/prefill_attention.py`) runs one program per
#   (query tile, head, sequence): it loads its query tile once, walks the key tiles unmasked up
#   to the diagonal, masked across it, and skips the rest, looking up each key tile's cache block
#   in the block table, and keeps the softmax online in fp32 with `exp2`. It agrees with the
#   definition under the Triton interpreter on a CPU, gives the engine the same tokens as the
#   PyTorch backend, and on an H200 it outruns PyTorch's `varlen_attn` while reading a paged
#   cache (Figure 2.4).
#
# Next, chapter 03 looks at what attention reads during generation: the KV cache, what it
# saves, what it costs per token, and why a contiguous cache per request wastes memory.

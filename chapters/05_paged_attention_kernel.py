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
# # Chapter 05 — The paged attention kernel
#
# Chapter 04 scattered every sequence's keys and values over fixed-size *blocks* of one big
# cache and gave each sequence a *block table* that says where its blocks are. That made memory
# management easy and cheap. It also left a debt: attention now has to read a sequence's
# history from wherever the block table scattered it. This chapter pays the debt with a GPU
# kernel, written in Triton, that reads the paged cache at nearly the full speed of the memory.
#
# We build it in four steps, each a small PyTorch function checked against a float64
# reference: **one query against one block**, then **many blocks through a block table** (with
# the online softmax of chapter 02), then **grouped-query attention** (one program reads each
# block once for all the query heads that share it), then **split-KV** (several programs share
# one long sequence and merge their results with a log-sum-exp rule). Then we read the
# package's Triton kernel, run it on this CPU under the Triton interpreter, and check that it
# computes the same numbers. Finally we count bytes, draw the roofline and compare the kernel,
# as measured on an H200 GPU, with the memory-copy ceiling and with cuDNN's attention.
#
# Package modules taught here: `nanovllm/kernels/decode_attention.py` (the decode kernel),
# `nanovllm/kernels/split_kv.py` (the split count and the merge of the splits),
# `nanovllm/kernels/launch_config.py` (the tile sizes, fixed by a measured rule),
# `nanovllm/kernels/store_kv.py` (the cache-write kernel), the `triton` backend in
# `nanovllm/layers/attention.py`, and the benchmark `nanovllm/benchmarks/decode_kernel.py`.

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(5)

# %% [markdown]
# **Builds on:** PagedAttention {cite}`kwon2023paged`, flash-decoding {cite}`dao2023flashdecoding`
# and the roofline model {cite}`williams2009roofline`. The references are collected in the book's
# bibliography.

# %% [markdown]
# ## Setup
#
# Triton compiles kernels for a GPU. Without one, Triton can *interpret* a kernel: it runs the
# kernel's Python body with NumPy, one program after another, on CPU tensors. That is slow
# (milliseconds per tiny launch) but exact enough to test a kernel, and it lets everyone read
# and run this chapter on a laptop. The interpreter has to be chosen before `triton` is first
# imported, so the very first thing we do, on a machine without CUDA, is set
# `TRITON_INTERPRET=1`.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

# %% [markdown]
# The rest of the imports (among them `show_source`, which renders the package's code), and two
# helpers: `agree` compares a result with a reference and prints a yes/no verdict (never the raw
# error, which differs between machines), `make_paged_case` builds a random paged cache whose
# blocks are scattered in shuffled order, with block tables padded by `-1` as the engine pads
# them.

# %%
import inspect
import json
import math
import time

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
use_book_style()


def agree(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Print whether max |ours - ref| <= tol (a boolean, the same on every machine)."""
    ok = (ours.detach().cpu().double() - ref.cpu().double()).abs().max().item() <= tol
    print(f"{name}: agrees within {tol:g}: {ok}")
    assert ok, name


def make_paged_case(seq_lens, block_size, num_heads, num_kv_heads, head_dim, seed,
                    dtype=torch.float32, spare_blocks=3, dev="cpu"):
    """q [B, H, D], caches [num_blocks, block_size, Hkv, D], seq_lens [B], tables [B, width]."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)  # scatter the blocks
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(dev) for t in (q, k_cache, v_cache, lens, tables)]


# %% [markdown]
# ## 1. Why decode attention needs its own kernel
#
# In a **decode step** every running sequence brings exactly one new token. Its query vector
# (one per query head) must be compared with the keys of *all* the sequence's earlier tokens,
# and the values averaged with the softmax weights:
#
# $$o_h = \sum_{t<L} \frac{e^{s_{h,t}}}{\sum_{t'} e^{s_{h,t'}}}\, v_{t},\qquad
#   s_{h,t} = \frac{q_h \cdot k_t}{\sqrt{d}} .$$
#
# Count the work for one sequence of $L$ cached tokens, $H$ query heads, $H_{kv}$ KV heads of
# dimension $d$, stored in $e$ bytes per number. The kernel must *read* $2 L H_{kv} d\, e$
# bytes (all keys and values) and *compute* about $4 L H d$ floating-point operations (a
# multiply and an add for $q\cdot k$, the same for the weighted sum of $v$). Their ratio, the
# **arithmetic intensity**, does not depend on $L$ at all:
#
# $$I = \frac{4 L H d}{2 L H_{kv} d\, e} = \frac{2}{e}\cdot\frac{H}{H_{kv}}
#   \ \text{FLOP/byte}.$$
#
# Compare that with what a GPU can do per byte it reads. The two numbers below were measured on
# an H200 (the device of all recorded results in this book), the rate of a large bf16 matrix
# multiply and of a device-to-device copy (read + write), and are read from the book's one
# record of each (`nanovllm/viz/records.py`).

# %%
from nanovllm.viz.records import headline, is_recorded

H200_BF16_TFLOPS = headline("h200_bf16_matmul_flops") / 1e12  # bf16 8192^3 matmul
H200_COPY_TBS = headline("h200_copy_bytes_per_s") / 1e12  # large device-to-device copy
print(f"H200: bf16 matmul {H200_BF16_TFLOPS:.0f} TFLOP/s"
      f"{'' if is_recorded('h200_bf16_matmul_flops') else ' (measured, record pending)'}, "
      f"copy {H200_COPY_TBS:.2f} TB/s")
ridge = H200_BF16_TFLOPS / H200_COPY_TBS  # FLOP per byte where compute and memory balance

qwen3 = {"num_heads": 16, "num_kv_heads": 8, "head_dim": 128}  # Qwen3-0.6B attention
intensity = 2 / 2 * qwen3["num_heads"] / qwen3["num_kv_heads"]  # bf16: e = 2 bytes
print(f"H200 ridge point: {ridge:.0f} FLOP/byte")
print(f"decode attention, Qwen3-0.6B shape, bf16: {intensity:.0f} FLOP/byte "
      f"-> {ridge / intensity:.0f}x below the ridge")

# %% [markdown]
# Decode attention does two operations per byte while the GPU could do the ridge point's worth
# (printed above): it is **memory-bound**, by the factor the cell prints. Its speed is the speed
# at which it streams the KV cache, and the job of the kernel is simple to state:
#
# 1. read every byte of K and V **exactly once**, from wherever the block table put it;
# 2. keep enough reads in flight that the memory system stays busy.
#
# Everything in this chapter serves one of these two goals.

# %% [markdown]
# ## 2. The specification: a float64 reference
#
# The cache layout is the engine's (chapter 04): `k_cache` and `v_cache` are
# `[num_blocks, block_size, num_kv_heads, head_dim]`; token `t` of sequence `b` lives in block
# `block_tables[b, t // block_size]`, row `t % block_size`; query head `h` uses KV head
# `h // group` with `group = num_heads // num_kv_heads`. The reference gathers each sequence's
# tokens into a contiguous tensor and applies the formula in float64. It is slow and obviously
# right: the yardstick for every step below.

# %%
def reference_decode(q, k_cache, v_cache, seq_lens, block_tables, scale):
    """float64 decode attention over the paged cache, one sequence at a time. Out: [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]))
        if len(t) == 0:
            continue  # an empty sequence (a padding row) attends to nothing: zeros
        blocks = block_tables[b].cpu().long()[t // block_size]
        k = k_cache.cpu()[blocks, t % block_size].double()  # [L, Hkv, D]
        v = v_cache.cpu()[blocks, t % block_size].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


# Four sequences over a cache of 16-token blocks, SmolLM2's head layout (9 query heads share 3 KV
# heads, head_dim 64). The block table rows are padded with -1 to the longest sequence.
LENS = [5, 16, 37, 70]
H, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5
q, k_cache, v_cache, seq_lens, block_tables = make_paged_case(LENS, BS, H, HKV, D, seed=0)
ref = reference_decode(q, k_cache, v_cache, seq_lens, block_tables, SCALE)
print("cache:", tuple(k_cache.shape), " q:", tuple(q.shape), " reference out:", tuple(ref.shape))
print("block tables (-1 = padding):")
print(block_tables)

# %% [markdown]
# Sequence 3 holds 70 tokens, so it needs $\lceil 70/16 \rceil = 5$ blocks, and its last block
# is only partly filled (70 − 4·16 = 6 rows). The block ids are shuffled: neighbours in a
# sequence are not neighbours in memory. That is the whole point of paging, and the whole
# difficulty for the kernel.
#
# ## 3. Step 1 — one query, one block
#
# Start with the smallest piece: one query head of one sequence whose history fits in a single
# block. Read the block's valid rows, score, softmax, average. Sequence 0 has 5 tokens, all in
# its first block.

# %%
def attend_one_block(q_h, k_block, v_block, n, scale):
    """One query vector [D] against the first n rows of one block [block_size, D]."""
    scores = (k_block[:n] @ q_h) * scale  # [n]
    return torch.softmax(scores, dim=0) @ v_block[:n]  # [D]


b, h = 0, 4
kv_head = h // (H // HKV)
block = int(block_tables[b, 0])
out = attend_one_block(q[b, h], k_cache[block, :, kv_head], v_cache[block, :, kv_head],
                       int(seq_lens[b]), SCALE)
agree("step 1, one block (sequence 0, head 4)", out, ref[b, h], 1e-5)

# %% [markdown]
# ## 4. Step 2 — many blocks through the block table
#
# A longer sequence spans several blocks. We could gather them into one contiguous tensor
# first, as the reference does, but that copy writes (and later re-reads) every byte: it
# triples the memory traffic of a kernel whose only cost *is* memory traffic. Instead we
# visit the blocks in table order and fold each one into a running result with the **online
# softmax** of chapter 02. After each block we keep three things: the largest score so far
# $m$, the sum $\ell$ of $e^{s-m}$ so far, and the unnormalised output
# $a = \sum e^{s-m} v$. A new block with scores $s$ updates them as
#
# $$m' = \max(m, \max s),\quad \alpha = e^{m - m'},\quad
#   \ell' = \alpha\,\ell + \textstyle\sum e^{s - m'},\quad
#   a' = \alpha\,a + \textstyle\sum e^{s - m'} v ,$$
#
# and at the end $o = a / \ell$. Each block is read once, straight from its scattered place.
# Only the valid rows of the last block are used; table entries past the end of the sequence
# (the `-1` padding) are never looked at.

# %%
def attend_paged(q_h, k_cache, v_cache, table, n, kv_head, scale):
    """One query vector [D] over a sequence of n tokens stored in the blocks of `table`."""
    block_size = k_cache.shape[1]
    m = torch.tensor(float("-inf"), dtype=q_h.dtype)
    l = torch.tensor(0.0, dtype=q_h.dtype)  # noqa: E741
    acc = torch.zeros_like(q_h)
    for j in range(-(-n // block_size)):
        rows = min(block_size, n - j * block_size)  # the last block may be partial
        block = int(table[j])
        k = k_cache[block, :rows, kv_head]  # read this block's keys once...
        v = v_cache[block, :rows, kv_head]  # ...and its values once
        s = (k @ q_h) * scale
        m_new = torch.maximum(m, s.max())
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
        l = l * alpha + p.sum()  # noqa: E741
        acc = acc * alpha + p @ v
        m = m_new
    return acc / l


b, h = 3, 7
out = attend_paged(q[b, h], k_cache, v_cache, block_tables[b], int(seq_lens[b]),
                   h // (H // HKV), SCALE)
agree("step 2, five scattered blocks (sequence 3, head 7)", out, ref[b, h], 1e-5)

# %% [markdown]
# ## 5. Step 3 — grouped-query attention: read each block once per group
#
# With grouped-query attention (GQA, chapter 01) several query heads share one KV head:
# SmolLM2 has 9 query heads over 3 KV heads (groups of 3), Qwen3-0.6B 16 over 8 (groups of 2).
# If we ran `attend_paged` once per *query* head, every KV block would be read `group` times.
# Since the kernel's cost is bytes read, that would make it `group` times slower.
#
# The fix is to give one program a whole group: its query is a `[group, D]` tile, the scores
# of a block are a `[group, rows]` matrix (a small matrix product, which GPUs like), and `m`
# and `ℓ` become vectors with one entry per query head. To make the saving visible, the
# batched version below counts how many block reads (of K and of V) it performs, and compares
# that with one program per query head.

# %%
def attend_paged_group(q_g, k_cache, v_cache, table, n, kv_head, scale):
    """A group of query heads [G, D] sharing kv_head; returns ([G, D], blocks read)."""
    block_size = k_cache.shape[1]
    m = torch.full((q_g.shape[0],), float("-inf"), dtype=q_g.dtype)
    l = torch.zeros(q_g.shape[0], dtype=q_g.dtype)  # noqa: E741
    acc = torch.zeros_like(q_g)
    reads = 0
    for j in range(-(-n // block_size)):
        rows = min(block_size, n - j * block_size)
        block = int(table[j])
        k, v = k_cache[block, :rows, kv_head], v_cache[block, :rows, kv_head]
        reads += 2  # one K block, one V block
        s = (q_g @ k.T) * scale  # [G, rows]
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(dim=1)  # noqa: E741
        acc = acc * alpha[:, None] + p @ v
        m = m_new
    return acc / l[:, None], reads


def decode_gqa(q, k_cache, v_cache, seq_lens, block_tables, scale):
    """All sequences: one 'program' per (sequence, KV head). Returns (out, blocks read)."""
    batch, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out, total_reads = torch.zeros_like(q), 0
    for b in range(batch):  # on the GPU, these two loops are the grid of programs
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            out[b, heads], reads = attend_paged_group(
                q[b, heads], k_cache, v_cache, block_tables[b], int(seq_lens[b]), kv_head, scale)
            total_reads += reads
    return out, total_reads


out, reads_gqa = decode_gqa(q, k_cache, v_cache, seq_lens, block_tables, SCALE)
agree("step 3, GQA over the whole batch", out, ref, 1e-5)
blocks = sum(-(-n // BS) for n in LENS)
print(f"block reads, one program per KV head:    {reads_gqa}  (= 2 x {blocks} blocks x {HKV})")
print(f"block reads, one program per query head: {2 * blocks * H}  ({H // HKV}x more bytes)")

# %% [markdown]
# Same numbers, a third of the memory traffic for SmolLM2 (half for Qwen3). On the GPU the two
# Python loops of `decode_gqa` become the *grid*: `batch × num_kv_heads` programs run in
# parallel, each on its own streaming multiprocessor (SM) slot.
#
# ## 6. Step 4 — split-KV: more programs for few long sequences
#
# The grid has `batch × num_kv_heads` programs. For Qwen3-0.6B at batch 1 that is 8 programs,
# on a GPU with 132 SMs: 124 SMs idle while 8 walk the whole history one tile after another.
# Memory bandwidth comes from many reads in flight at once, so a batch this small cannot reach
# it. **Split-KV** (also called flash-decoding) cuts each sequence's key range into
# `num_splits` chunks handled by separate programs. Each chunk returns its *partial* state
# $(m_s, \ell_s, a_s)$ — exactly the running state of step 2, stopped at the chunk's end — and
# a second, tiny pass merges them. Rescaling every partial to the common maximum
# $M = \max_s m_s$ gives the **log-sum-exp merge**:
#
# $$o = \frac{\sum_s e^{m_s - M}\, a_s}{\sum_s e^{m_s - M}\, \ell_s}.$$
#
# A chunk can be empty (a short sequence cut into many chunks); its $m_s = -\infty$ gets weight
# $e^{-\infty} = 0$, so it drops out. Below, the chunks are aligned to tiles of 32 keys, as in
# the kernel (`split_len` rounded up to a whole number of tiles).

# %%
def partial_state(q_g, k_cache, v_cache, table, start, end, kv_head, scale):
    """Unnormalised (m [G], l [G], acc [G, D]) of a query group over keys [start, end)."""
    block_size = k_cache.shape[1]
    t = torch.arange(start, max(start, end))  # empty when the split starts past the end
    blocks = table.long()[t // block_size]
    k, v = k_cache[blocks, t % block_size, kv_head], v_cache[blocks, t % block_size, kv_head]
    s = (q_g @ k.T) * scale  # [G, number of keys]
    if s.shape[1] == 0:
        g = q_g.shape[0]
        return torch.full((g,), float("-inf")), torch.zeros(g), torch.zeros_like(q_g)
    m = s.max(dim=1).values
    p = torch.exp(s - m[:, None])
    return m, p.sum(dim=1), p @ v


def merge_partials(ms, ls, accs):
    """Log-sum-exp merge of S partial states: ms, ls [S, G], accs [S, G, D] -> [G, D]."""
    m_max = ms.max(dim=0).values
    w = torch.exp(ms - m_max)  # [S, G]; an empty split (-inf) weighs 0
    return (w[..., None] * accs).sum(dim=0) / (w * ls).sum(dim=0)[:, None]


def decode_split(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, tile=32):
    batch, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        split_len = math.ceil(math.ceil(n / num_splits) / tile) * tile  # whole tiles
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            parts = [partial_state(q[b, heads], k_cache, v_cache, block_tables[b],
                                   s * split_len, min((s + 1) * split_len, n), kv_head, scale)
                     for s in range(num_splits)]  # on the GPU: separate programs
            ms, ls, accs = (torch.stack(x) for x in zip(*parts))
            out[b, heads] = merge_partials(ms, ls, accs)
    return out


for num_splits in (1, 2, 3, 5):
    agree(f"step 4, split-KV with {num_splits} split(s)",
          decode_split(q, k_cache, v_cache, seq_lens, block_tables, SCALE, num_splits), ref, 1e-5)

# %% [markdown]
# With 5 splits, sequence 0 (5 tokens, one tile) has four empty chunks; the merge ignores them
# and the result is unchanged. Splitting is not free: every split writes its partial state to
# memory and the merge reads it back, and with many sequences the grid is already full. So the
# package splits only when the batch is too small to fill the GPU. Its rule,
# `choose_num_splits` (`nanovllm/kernels/split_kv.py`), aims at a few programs per SM and never gives a split fewer than 64
# keys. Here is what it picks on an H200 (132 SMs) for Qwen3-0.6B's 8 KV heads:

# %%
from nanovllm.kernels.split_kv import choose_num_splits

print("batch   programs without split   splits (ctx 1024)   splits (ctx 4096)")
for batch in (1, 4, 16, 32, 33, 64, 256):
    s1, s4 = (choose_num_splits(batch, 8, ctx, num_sms=132) for ctx in (1024, 4096))
    print(f"{batch:5d}   {batch * 8:22d}   {s1:17d}   {s4:17d}")

# %% [markdown]
# At batch 1 the 8 programs become 128 (ctx 1024, 16 splits: 64 keys each) or 256 (ctx 4096,
# 32 splits, the cap); from batch 33 on, `batch × 8 ≥ 2 × 132` programs already fill the GPU
# and nothing is split. The rule looks only at shapes, never at the data, so a decode step that
# calls it can be recorded in a CUDA graph (chapter 07).

# %% [markdown]
# Figure 5.1 draws the split for Qwen3-0.6B's shapes on an H200: `choose_num_splits` decides the
# count from the batch and the number of SMs alone, the kernel gives each split a whole number of
# key tiles, and `combine_splits` merges the partial $(m, \ell, \text{acc})$ with the log-sum-exp
# rule. The idea is flash-decoding {cite}`dao2023flashdecoding`.

# %%
from nanovllm.viz.kernel_diagrams import split_kv_diagram

fig = split_kv_diagram()
figure(fig, "05_split_kv",
       "Split-KV decode: one sequence's keys cut into splits, one program each, merged by "
       "combine_splits.")

# %% [markdown]
# ## 7. The package's kernel
#
# Now the real thing, `nanovllm/kernels/decode_attention.py`. Read the kernel with the four
# steps in mind. One program handles one `(sequence, kv head, split)`
# (`tl.program_id(0..2)`). It loads its group's queries as one `[GROUP_PAD, D_PAD]` tile
# (padded to 16 rows, the smallest shape `tl.dot` accepts), walks its key range in tiles of
# `BLOCK_N` keys, looks up each key's block in the block table (the *gather*), and runs the
# online softmax in base 2: scores are multiplied by `scale · log2(e)` once, so the kernel can
# use the cheaper `exp2` ($2^{x\log_2 e} = e^x$, the same numbers). With one split it
# normalises and writes the output itself; otherwise it writes `(m, ℓ, acc)` to fp32 scratch
# and `_combine_splits_kernel` (in `nanovllm/kernels/split_kv.py`, with `choose_num_splits`)
# performs the log-sum-exp merge.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.kernels import decode_attention as decode_module
from nanovllm.kernels import split_kv

show_source(decode_module._decode_split_kernel, split_kv._combine_splits_kernel)

# %% [markdown]
# The Python launcher checks the shapes, picks the split count, allocates the partials only
# when there are several splits, and launches one or two kernels:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(decode_module.decode_attention)

# %% [markdown]
# ### 7.1 Does it compute the same numbers?
#
# We run the kernel on the same case as above (fp32), with the automatic split count and with
# 3 forced splits (which exercises the merge kernel), and compare with the float64 reference
# and with this chapter's `decode_split`. On a CPU each launch runs under the interpreter
# (a second or so); on a GPU it is compiled once and then takes microseconds. fp32 caches use
# exact fp32 products (`input_precision="ieee"`), so the tolerance is tight on both.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.kernels.decode_attention import decode_attention

case = [t.to(device) for t in (q, k_cache, v_cache, seq_lens, block_tables)]
out_auto = decode_attention(*case, SCALE)
out_split3 = decode_attention(*case, SCALE, num_splits=3)
print("output:", tuple(out_auto.shape), out_auto.dtype)
agree("Triton kernel, automatic splits vs float64 reference", out_auto, ref, 1e-4)
agree("Triton kernel, 3 splits vs float64 reference", out_split3, ref, 1e-4)
agree("Triton kernel, 3 splits vs this chapter's decode_split", out_split3,
      decode_split(q, k_cache, v_cache, seq_lens, block_tables, SCALE, 3), 1e-4)

# %% [markdown]
# Two harder cases, on fresh random inputs. First Qwen3-0.6B's head layout (16 query heads
# over 8 KV heads, head_dim 128) in **bf16**, with a padding row of length 0 (the rows a CUDA
# graph batch is padded with, chapter 07), which must come out as zeros. bf16 keeps only 8
# bits of mantissa, so the tolerance is looser. (The interpreter cannot multiply bf16 numbers
# correctly, so on a CPU the launcher upcasts bf16 tiles to fp32 before `tl.dot`; on a GPU
# they go to the tensor cores as they are.) Second, block size 32 with one long sequence and
# four splits.

# %%
# NBVAL_CHECK_OUTPUT
cases = {
    "bf16, Qwen3 heads (16/8, d=128), block 16, with an empty row":
        (dict(seq_lens=[33, 0, 100], block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
              seed=1, dtype=torch.bfloat16), None, 5e-2),
    "fp32, 8 heads over 2 (groups of 4), block 32, 4 splits":
        (dict(seq_lens=[200, 9], block_size=32, num_heads=8, num_kv_heads=2, head_dim=32,
              seed=2), 4, 1e-4),
}
for name, (spec, splits, tol) in cases.items():
    q2, k2, v2, lens2, tables2 = make_paged_case(**spec, dev=device)
    scale2 = spec["head_dim"] ** -0.5
    out2 = decode_attention(q2, k2, v2, lens2, tables2, scale2, num_splits=splits)
    ref2 = reference_decode(q2, k2, v2, lens2, tables2, scale2)
    agree(name, out2, ref2, tol)
    if 0 in spec["seq_lens"]:
        print("  the empty row is all zeros:", bool((out2[1] == 0).all()))

# %% [markdown]
# ### 7.2 `store_kv`: writing the new token into the cache
#
# Before attention can read a decode token's key and value, they must be in the cache. The
# block manager has already chosen each new token's **slot**,
# `slot = block_table[pos // block_size] · block_size + pos % block_size` (chapter 04); the
# `store_kv` kernel only moves the bytes: one program per token loads its
# `[num_kv_heads, head_dim]` key and value and stores them at that slot, cast to the cache's
# dtype. A slot of `-1` means "skip this token"; chapter 07 pads CUDA-graph batches with such
# rows.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.kernels import store_kv as store_module

show_source(store_module._store_kv_kernel)

# %% [markdown]
# We write 5 tokens (one of them a `-1` padding row) with the Triton kernel and with the
# PyTorch backend's `store_kv` (an indexed assignment), and compare the two caches bit for bit.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.kernels.store_kv import store_kv
from nanovllm.layers import torch_attention

gen = torch.Generator().manual_seed(3)
new_k = torch.randn(5, HKV, D, generator=gen)
new_v = torch.randn(5, HKV, D, generator=gen)
slots = torch.tensor([3, 17, -1, 40, 79])  # block 0 row 3, block 1 row 1, skip, ...
k_triton, v_triton = k_cache.clone().to(device), v_cache.clone().to(device)
k_torch, v_torch = k_cache.clone(), v_cache.clone()
store_kv(new_k.to(device), new_v.to(device), k_triton, v_triton, slots.to(device))
torch_attention.store_kv(new_k, new_v, k_torch, v_torch, slots)
print("Triton store_kv == PyTorch store_kv (K and V, bit for bit):",
      torch.equal(k_triton.cpu(), k_torch) and torch.equal(v_triton.cpu(), v_torch))
flat = k_triton.cpu().view(-1, HKV, D)
print("slot 40 now holds token 3's key:", torch.equal(flat[40], new_k[3]))
changed = (k_triton.cpu() != k_cache).any(dim=(2, 3)).flatten().nonzero().flatten().tolist()
print("slots that changed:", changed, "(the -1 row wrote nothing)")

# %% [markdown]
# ### 7.3 Switched on in the engine: the `triton` backend
#
# The engine reaches these kernels through the attention *backend*
# (`nanovllm/layers/attention_backends.py`):
# every attention layer calls `backend.store_kv(...)`, then `backend.attend(...)` with the
# step's `AttentionMetadata` (`nanovllm/context.py`). The `triton` backend sends the decode
# rows of a batch to `decode_attention` and the prompt rows to the prefill kernel of
# chapter 02:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.attention_backends import TorchBackend, TritonBackend

show_source(TritonBackend)

# %% [markdown]
# Below we build one decode step for our four sequences exactly as the model runner would:
# each sequence's new token goes to position `seq_len` (so the table must have room for it),
# its slot is computed from the block table, and the metadata carries the new lengths. Then we
# run one attention layer's work with the `triton` backend and with the `torch` reference
# backend, on two copies of the same cache.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.context import AttentionMetadata

triton_backend, torch_backend = TritonBackend(), TorchBackend()

# New lengths after this step; sequence 1 (16 tokens) spills into a new block: take a spare one.
new_lens = [n + 1 for n in LENS]
tables_step = block_tables.clone()
spare = sorted(set(range(k_cache.shape[0])) - set(block_tables.flatten().tolist()))
tables_step[1, 1] = spare[0]
slot_of = lambda b, pos: int(tables_step[b, pos // BS]) * BS + pos % BS  # noqa: E731
step_slots = torch.tensor([slot_of(b, n) for b, n in enumerate(LENS)])
gen = torch.Generator().manual_seed(4)
q_new, k_new, v_new = (torch.randn(len(LENS), h, D, generator=gen) for h in (H, HKV, HKV))
meta = AttentionMetadata(
    slot_mapping=step_slots.to(device),
    cu_seqlens_q=torch.arange(len(LENS) + 1, dtype=torch.int32, device=device),
    seq_lens_k=torch.tensor(new_lens, dtype=torch.int32, device=device),
    block_tables=tables_step.to(device),
    max_seqlen_q=1, max_seqlen_k=max(new_lens), num_decodes=len(LENS),
    cu_seqlens_q_host=list(range(len(LENS) + 1)), seq_lens_k_host=new_lens,
)
outs = {}
for name, backend in (("triton", triton_backend), ("torch", torch_backend)):
    kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
    backend.store_kv(k_new.to(device), v_new.to(device), kc, vc, meta.slot_mapping)
    outs[name] = backend.attend(q_new.to(device), kc, vc, meta, SCALE)
ref_step = reference_decode(q_new, kc.cpu(), vc.cpu(), torch.tensor(new_lens), tables_step, SCALE)
print("step slots:", step_slots.tolist())
agree("triton backend vs float64 reference", outs["triton"], ref_step, 1e-4)
agree("triton backend vs torch backend", outs["triton"], outs["torch"], 1e-4)

# %% [markdown]
# On a CPU the interpreter is far too slow to generate whole answers with this backend (a
# 30-layer model makes 60 kernel launches per token). On a GPU, the next cell starts the engine
# on SmolLM2 twice, once per backend, in fp32, and compares the greedy answers and the time.
# (On a GPU the `auto` backend *is* `triton`.) Where SmolLM2's weights are not installed, it
# uses random weights of SmolLM2's shape and token-id prompts instead.

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    from nanovllm import LLM, SamplingParams, smollm2_path
    from nanovllm.configs import config_path
    from nanovllm.weights.smollm2 import WeightsUnavailableError

    try:
        model, load_format = smollm2_path(), "auto"
        prompts = ["The capital of France is", "Paged attention reads the KV cache"]
    except WeightsUnavailableError:
        model, load_format = config_path("smollm2-135m"), "dummy"
        prompts = [list(range(1, 60, 3)), list(range(500, 700, 7))]
    params = SamplingParams(temperature=0, max_tokens=32)
    answers = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, load_format=load_format, dtype="float32", attention_backend=backend,
                  num_kv_blocks=256)  # a fixed cache: the two engines share the GPU
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (Triton compiles here)
        start = time.perf_counter()
        answers[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"{backend:6s}: {time.perf_counter() - start:.2f} s for 2 x 32 tokens ({load_format})")
        del llm
    print("same greedy tokens:", answers["torch"] == answers["triton"])
else:
    print("no GPU here: the engine's triton backend is exercised on a GPU only")

# %% [markdown]
# ## 8. Bytes, the roofline, and the H200 measurements
#
# Because the kernel is memory-bound, the right yardstick is bytes per second. One call moves
#
# $$\text{bytes} = \underbrace{2\,B\,L\,H_{kv}\,d\,e}_{\text{K and V}}
#   + \underbrace{2\,B\,H\,d\,e}_{q\text{ in, }o\text{ out}},$$
#
# and the fastest it could possibly run is that number divided by the memory bandwidth: the
# **roofline** of a memory-bound kernel. (A roofline bounds a kernel's speed by the memory
# bandwidth and by the peak arithmetic rate, whichever binds first; chapter 11 §3 draws both
# roofs. A decode attention kernel does too little arithmetic per byte to meet the second.)
# `nanovllm/benchmarks/decode_kernel.py` measured the kernel on an H200
# (`python -m nanovllm.benchmarks.decode_kernel`, Qwen3-0.6B's attention shape, bf16, blocks
# scattered in shuffled order over a pool much larger than the 60 MB L2 cache, each call timed
# inside a CUDA graph so that only device time counts). It also measured, in the same
# run, the copy bandwidth (the ceiling) and PyTorch's `scaled_dot_product_attention` on the
# same bytes laid out *contiguously* (cuDNN and flash backends): the peers. We load the
# recorded file:

# %%
record = json.loads((figures_dir() / "data" / "bench_decode_h200.json").read_text())
print(f"recorded on {record['device']} ({record['num_sms']} SMs), {record['date']}, "
      f"torch {record['torch']}, triton {record['triton']}")
print("command:", record["command"])
print("shape:", record["shape"])
copy_bw = record["copy_bytes_per_s"]
print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s;  rows: {len(record['rows'])}")


# %% [markdown]
# First, our formula must give the benchmark's byte counts, for all 16 recorded rows:

# %%
# NBVAL_CHECK_OUTPUT
def decode_bytes(batch, ctx, num_heads, num_kv_heads, head_dim, elem):
    """Bytes one decode_attention call must move: K and V of every token, q in, out out."""
    kv = 2 * batch * ctx * num_kv_heads * head_dim * elem  # every cached key and value
    return kv + 2 * batch * num_heads * head_dim * elem  # + q read, out written


shape = record["shape"]
print("formula == recorded bytes, all rows:", all(
    decode_bytes(r["batch"], r["ctx"], shape["num_heads"], shape["num_kv_heads"],
                 shape["head_dim"], 2) == r["bytes"] for r in record["rows"]))

# %% [markdown]
# Now the table: for each shape, the bytes moved, the roofline time (bytes / copy bandwidth),
# the measured time of our kernel and of cuDNN SDPA (both in microseconds of device time), and
# our fraction of the copy bandwidth.

# %%
rows16 = [r for r in record["rows"] if r["block_size"] == 16]
print(" ctx  batch splits    MB   floor us   ours us  cuDNN us  flash us  ours % copy")
for r in rows16:
    floor = r["bytes"] / copy_bw * 1e6
    print(f"{r['ctx']:4d} {r['batch']:6d} {r['num_splits']:6d} {r['bytes'] / 1e6:6.0f} "
          f"{floor:10.1f} {r['us']:9.1f} {r['sdpa']['cudnn']['us']:9.1f} "
          f"{r['sdpa']['flash']['us']:9.1f} {r['frac_copy']:11.0%}")
big = max(rows16, key=lambda r: r["bytes"])
small = min(rows16, key=lambda r: r["bytes"])
ratio = [r["us"] / r["sdpa"]["cudnn"]["us"] for r in rows16]
print(f"ours / cuDNN time: from {min(ratio):.2f} to {max(ratio):.2f}")
bs256 = {(r["batch"], r["ctx"]): r["us"] for r in record["rows"] if r["block_size"] == 256}
worst = max(abs(bs256[(r["batch"], r["ctx"])] / r["us"] - 1) for r in rows16)
print(f"block size 256 vs 16: times differ by at most {worst:.1%}")

# %% [markdown]
# What the numbers say:
#
# * **Large batches run at the roofline.** From batch 64 at ctx 1024 on, the kernel streams
#   the paged cache at 86–102% of the copy bandwidth. The largest case (batch 256, ctx 4096,
#   printed above as about 100% or more) slightly *beats* the copy: the copy figure counts a
#   read and a write per byte, and a kernel that only reads keeps the memory bus in one
#   direction, which is a little more efficient. The "roof" is a measured practical ceiling,
#   not a law of nature.
# * **Small batches cannot.** Batch 1 at ctx 1024 moves only about 4 MB; even at full
#   bandwidth that is a microsecond of work, and a kernel launch, the first round trip to
#   memory and the merge pass cost several microseconds whatever the size. Nobody reaches the
#   roofline there, cuDNN included: the two are within about a microsecond. Split-KV
#   is what keeps this case latency-bound instead of occupancy-bound.
# * **Paging is almost free.** cuDNN reads the *same* bytes from contiguous tensors, yet our
#   kernel, gathering 16-token blocks through a table, takes between the two printed ratios of
#   its time (at most about 20% more at batch 16, within a few percent at large batches). Block
#   size 16 and block size 256 give nearly the same time: a 16-token block of one KV head is
#   16 × 128 × 2 = 4 KB of contiguous memory, already large enough for efficient reads.
# * The flash-attention backend of SDPA is not built for one-query decode: in the largest case
#   (batch 256, context 4096) it reaches 2.3 TB/s, about half the copy bandwidth.
#
# Figure 5.2 shows the same data: on the left, time against bytes moved, with the roofline as
# a straight line; on the right, the fraction of the copy bandwidth against the batch size.

# %%
fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
peers = [("ours", lambda r: r["us"], BOOK_COLORS[0], "o"),
         ("cuDNN SDPA (contiguous)", lambda r: r["sdpa"]["cudnn"]["us"], BOOK_COLORS[1], "s"),
         ("flash SDPA (contiguous)", lambda r: r["sdpa"]["flash"]["us"], BOOK_COLORS[2], "^")]
for name, us, color, marker in peers:
    for ctx, style, fill in ((1024, "-", color), (4096, "--", "none")):
        rs = [r for r in rows16 if r["ctx"] == ctx]
        ax_t.plot([r["bytes"] / 1e6 for r in rs], [us(r) for r in rs], linestyle="none",
                  marker=marker, color=color, markerfacecolor=fill, markersize=7,
                  label=name if ctx == 1024 else None)
        ax_f.plot([r["batch"] for r in rs], [r["bytes"] / (us(r) * 1e-6) / copy_bw for r in rs],
                  style, color=color, marker=marker, markerfacecolor=fill,
                  label=name if ctx == 1024 else None)
mb = [2, 6e3]
ax_t.plot(mb, [m * 1e6 / copy_bw * 1e6 for m in mb], ":", color="black",
          label=f"roofline: bytes / {copy_bw / 1e12:.2f} TB/s")
ax_t.set(xscale="log", yscale="log", xlabel="bytes moved per call (MB)",
         ylabel="device time per call (µs)",
         title="Time vs bytes (filled: ctx 1024, hollow: 4096)")
ax_t.legend(fontsize=8, loc="upper left")
ax_f.axhline(1.0, color="black", linestyle=":")
ax_f.set(xscale="log", xlabel="batch (sequences)", ylabel="fraction of copy bandwidth",
         title="Bandwidth (solid: ctx 1024, dashed: 4096)")
ax_f.set_xticks([1, 16, 64, 256], labels=["1", "16", "64", "256"])
fig.suptitle(f"Recorded on {record['device']}, {record['date'][:10]} (Qwen3-0.6B heads, bf16, "
             "block size 16)", fontsize=10)
fig.tight_layout()
figure(fig, "05_paged_attention_bandwidth",
       f"Recorded decode attention on {record['device']} (Qwen3-0.6B heads, bf16, 16-token"
       " blocks): our paged kernel against cuDNN's and flash SDPA reading the same bytes"
       " contiguously. Left: time per call against bytes moved, with the copy-bandwidth roofline;"
       " right: the fraction of the copy bandwidth reached against the batch size.")

# %% [markdown]
# ### 8.1 A live measurement (GPU only)
#
# On a GPU the next cell times the kernel on one of the recorded shapes (batch 64, ctx 1024,
# bf16, block size 16) with `triton.testing.do_bench` and reports the bandwidth it reached, so
# you can compare your GPU with the H200. (It does not rotate over several caches as the
# benchmark does, so part of the data may come from the L2 cache; run
# `python -m nanovllm.benchmarks.decode_kernel` for the careful measurement.)

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    from triton.testing import do_bench

    batch, ctx = 64, 1024
    qg, kg, vg, lg, tg = make_paged_case([ctx] * batch, 16, 16, 8, 128, seed=5,
                                         dtype=torch.bfloat16, dev="cuda")
    ms = do_bench(lambda: decode_attention(qg, kg, vg, lg, tg, 128**-0.5), return_mode="median")
    nbytes = decode_bytes(batch, ctx, 16, 8, 128, 2)
    print(f"{torch.cuda.get_device_name()}: {ms * 1e3:.1f} us per call, "
          f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s (H200 recorded: "
          f"{next(r['us'] for r in rows16 if (r['batch'], r['ctx']) == (batch, ctx)):.1f} us)")
else:
    print("no GPU here: the recorded H200 results above stand in for a live measurement")

# %% [markdown]
# ### 8.2 Against FlashAttention-4
#
# FlashAttention-4 (the `flash-attn-4` package) reads a paged cache too, and the engine can use
# it (`attention_backend="flash_attn"`, chapter 02 §7.1). `python -m
# nanovllm.benchmarks.attention_backends` timed both backends on the same decode batches, same
# cache, same H200, each call inside a CUDA graph:

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.benchmarks.attention_backends import comparison

fa_record = json.loads((figures_dir() / "data" / "attention_backends_h200.json").read_text())
print(f"{fa_record['device']}, {fa_record['date'][:10]}, flash-attn-4 {fa_record['flash_attn_4']}")
print(" ctx  batch   ours TB/s   flash-attn TB/s   our time / theirs")
fa_decode = comparison(fa_record, "decode")
for row in fa_decode:
    print(f"{row['ctx']:4d} {row['batch']:6d} {row['ours']:11.2f} {row['flash_attn']:17.2f} "
          f"{row['ratio']:17.2f}x")
single = [r for r in fa_decode if r["batch"] == 1]
print(f"batch 1: ours takes {min(r['ratio'] for r in single):.2f}-"
      f"{max(r['ratio'] for r in single):.2f}x flash-attn's time; batches >= 16: "
      f"{min(r['ratio'] for r in fa_decode if r['batch'] >= 16):.2f}-"
      f"{max(r['ratio'] for r in fa_decode if r['batch'] >= 16):.2f}x")

# %% [markdown]
# In decode, ours holds its own. At batch 1 it is several times faster: on Hopper
# FlashAttention-4 does not split a sequence's keys, so one sequence gives it only a handful of
# programs (one per head and query tile) for 132 SMs, while our split-KV (§6) spreads the same
# keys over many programs. From batch 16 on the two are close, ours ahead in most cases: both
# stream the cache near the copy bandwidth, and there is little left to win. Prefill (chapter 02) is where FlashAttention-4
# is far ahead.

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# the two Triton kernels of the decode path yourself: the loop at the heart of
# `_decode_split_kernel`, which walks a sequence's block table, loads its K/V tiles and runs the
# online softmax (`05.decode_kernel`, sections 4-7), and the merge of the split-KV partials
# (`05.combine_splits`, section 6). The tests run both under the Triton interpreter, so no GPU
# is needed: small random cases (GQA groups, partial last blocks, one key, empty rows, several
# splits, a sliding window, fp16 and fp8 caches) against a float32 PyTorch reference. Each
# function's docstring is the handout; the project's tests grade your code
# (`make check CHAPTERS=05` in your edition), and once they pass this notebook runs on your own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("05"))

# %% [markdown]
# ### Hints, one rung at a time
#
# Read a hint only when stuck, and only the next one.
#
# **`05.decode_kernel`** (the loop of `_decode_split_kernel`)
#
# 1. It is `attend_paged_group` of section 5, stopped before the final division, with two
#    changes: the program walks *tokens* in tiles of `BLOCK_N` rather than whole blocks (a
#    tile may straddle two blocks, and `start` may sit mid-block), and the scores are in base 2.
# 2. For a tile of keys `t = tile_start + tl.arange(0, BLOCK_N)`, every quantity is a vector
#    over the tile: the block-table entry `t // PAGE` (one load of `BLOCK_N` entries), the row
#    `t % PAGE`, and so a `[BLOCK_N, D_PAD]` tile of pointers. Everything past `end` or past
#    `HEAD_DIM` is masked in every load: a masked load reads nothing, however wrong its address.
# 3. Keys past `end` in the last tile still get a score from `tl.dot` (their K rows loaded as
#    zeros): set those scores to `-inf` before the max, so `2^(s - m)` gives them weight 0.
#    Every tile holds at least one valid key, so the new maximum is finite.
# 4. The update of one tile, with `s` of shape `[GROUP_PAD, BLOCK_N]`: `m_new = max(m_i,
#    rowmax(s))`, `alpha = 2^(m_i - m_new)`, `p = 2^(s - m_new)`, `l_i = alpha l_i +
#    rowsum(p)`, `acc = alpha acc + p V`. Initialise `m_i` to `-inf` and the others to zero:
#    an empty range then leaves exactly what the code after the loop expects.
# 5. Dtypes: `q` is already in the dots' dtype; convert the K/V tiles right after loading
#    (`FP8_KV`: to `q_ptr.dtype.element_ty`; `DOT_FP32`: to fp32), cast `p` to V's dtype for the
#    second dot, and widen the block ids with `.to(tl.int64)` before multiplying by a stride.
#
# **`05.combine_splits`** (`_combine_splits_kernel`)
#
# 1. It is `merge_partials` of section 6 for one `(sequence, head)`, in base 2.
# 2. Load all splits at once: `tl.arange(0, SPLITS_PAD)` with the mask `s < num_splits`
#    (`other=-inf` for `m`, `0` for `l` and `acc`); then `tl.max`, `tl.exp2` and
#    `tl.sum(x, 0)`.
# 3. A padded CUDA-graph row has every `m_s = -inf`: `2^(-inf - (-inf))` is NaN, so replace an
#    all-`-inf` maximum by 0 (`tl.where`) and divide by 1 where the sum of weights is 0.

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — paged GQA decode for one sequence.** Write
# `paged_decode_one(q, k_cache, v_cache, block_table, seq_len, scale)` for one sequence:
# `q` is `[num_heads, head_dim]`, the caches are `[num_blocks, block_size, num_kv_heads,
# head_dim]`, `block_table` is a 1-D int tensor (padded with `-1`), and the result is
# `[num_heads, head_dim]`. Visit the blocks in table order with an online softmax, and handle
# each KV head's whole query group at once (section 5), so each block is read once per KV head.
# The check compares with a float64 reference that gathers the keys position by position and
# takes a plain softmax per query head.

# %% tags=["exercise"]
import torch


def paged_decode_one(q, k_cache, v_cache, block_table, seq_len, scale):
    """Decode attention of one sequence's query heads [H, D] over its paged history."""
    raise NotImplementedError("exercise 05.paged_decode_one")


# %% tags=["check", "raises-exception"]
import torch


def reference_decode_one(q, k_cache, v_cache, block_table, seq_len, scale):
    """float64: gather the history token by token, then a plain softmax for every query head."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[0] // num_kv_heads
    rows = [(int(block_table[p // block_size]), p % block_size) for p in range(seq_len)]
    keys = torch.stack([k_cache[b, r] for b, r in rows]).double()  # [seq_len, Hkv, D]
    values = torch.stack([v_cache[b, r] for b, r in rows]).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        kv = h // group  # query head h reads KV head h // group
        weights = torch.softmax(keys[:, kv] @ q[h].double() * scale, dim=0)
        out[h] = weights @ values[:, kv]
    return out


gen = torch.Generator().manual_seed(501)
for heads, kv_heads, dim, block_size, n in [(9, 3, 64, 16, 70), (16, 8, 128, 32, 33),
                                            (4, 4, 32, 16, 1), (8, 1, 16, 64, 200)]:
    blocks_needed = -(-n // block_size)
    pool = blocks_needed + 4
    k_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    table = torch.full((blocks_needed + 2,), -1, dtype=torch.int32)
    table[:blocks_needed] = torch.randperm(pool, generator=gen)[:blocks_needed].to(torch.int32)
    q = torch.randn(heads, dim, generator=gen)
    expected = reference_decode_one(q, k_cache, v_cache, table, n, dim**-0.5)
    out = paged_decode_one(q, k_cache, v_cache, table, n, dim**-0.5)
    assert out.shape == q.shape, f"shape {tuple(out.shape)}, expected {tuple(q.shape)}"
    case = f"heads {heads}, kv_heads {kv_heads}, head_dim {dim}, block_size {block_size}, n {n}"
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4,
                               msg=lambda m, case=case: f"{case}: {m}")
print("Exercise 1 passed: paged_decode_one matches a float64 softmax over the gathered history")

# %% [markdown]
# **Exercise 2 — merging split-KV partials.** Each of `S` splits returns, per query head, its
# largest score `m` (natural-log scale; `-inf` for an empty split), the sum `l` of
# `exp(score - m)` and the unnormalised output `acc = sum exp(score - m) · v`. Write
# `merge_splits(m, l, acc)` with `m`, `l` of shape `[S, H]` and `acc` of shape `[S, H, D]`,
# returning the attention output `[H, D]`. Empty splits must drop out without producing NaN.

# %% tags=["exercise"]
import torch


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """Log-sum-exp merge of split-KV partial states into the final output [H, D]."""
    raise NotImplementedError("exercise 05.merge_splits")


# %% tags=["check", "raises-exception"]
import torch

gen = torch.Generator().manual_seed(502)
for num_keys, cuts in [(50, [0, 7, 30, 50]), (64, [0, 64, 64, 64]), (9, [0, 0, 3, 9, 9])]:
    heads, dim = 4, 16
    scores = torch.randn(heads, num_keys, generator=gen, dtype=torch.float64) * 5
    v = torch.randn(num_keys, dim, generator=gen, dtype=torch.float64)
    expected = scores.softmax(dim=-1) @ v
    ms, ls, accs = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):  # split s covers keys [a, b); some are empty
        if a == b:
            ms.append(torch.full((heads,), float("-inf"), dtype=torch.float64))
            ls.append(torch.zeros(heads, dtype=torch.float64))
            accs.append(torch.zeros(heads, dim, dtype=torch.float64))
            continue
        s = scores[:, a:b]
        mx = s.max(dim=1).values
        p = torch.exp(s - mx[:, None])
        ms.append(mx), ls.append(p.sum(dim=1)), accs.append(p @ v[a:b])
    out = merge_splits(torch.stack(ms), torch.stack(ls), torch.stack(accs))
    assert torch.isfinite(out).all(), "empty splits produced NaN or inf"
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
print("Exercise 2 passed: merge_splits reproduces the softmax over all keys, empty splits too")

# %% [markdown]
# **Exercise 3 — bytes per call.** Write `decode_call_bytes(batch, ctx, num_heads,
# num_kv_heads, head_dim, elem_bytes)`: the bytes one paged decode-attention call must move
# (section 8: all keys and values, plus the queries read and the outputs written). The check
# compares it with rows the H200 benchmark recorded and with the sizes of the tensors themselves
# on random shapes.

# %% tags=["exercise"]
def decode_call_bytes(batch, ctx, num_heads, num_kv_heads, head_dim, elem_bytes):
    """Bytes of K, V, q and out that one decode-attention call reads or writes."""
    raise NotImplementedError("exercise 05.decode_call_bytes")


# %% tags=["check", "raises-exception"]
import random

import torch

# frozen: rows of figures/data/bench_decode_h200.json (Qwen3-0.6B's attention: 16 query heads,
# 8 KV heads, head_dim 128, bf16), as (batch, ctx) -> bytes
for (batch, ctx), recorded in {(1, 1024): 4_202_496, (64, 4096): 1_074_266_112,
                               (256, 4096): 4_297_064_448}.items():
    got = decode_call_bytes(batch, ctx, 16, 8, 128, 2)
    assert got == recorded, f"batch {batch} ctx {ctx}: {got} != {recorded} (recorded on the H200)"

# reference: the sizes of the tensors one call touches, made on the meta device (no memory)
rng = random.Random(503)
dtypes = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}
for _ in range(50):
    kv_heads = rng.randint(1, 8)
    heads = kv_heads * rng.randint(1, 8)
    dim, elem = rng.choice([16, 64, 128]), rng.choice([1, 2, 4])
    batch, ctx = rng.randint(1, 300), rng.randint(1, 9000)
    q = torch.empty(batch, heads, dim, dtype=dtypes[elem], device="meta")
    kv = torch.empty(batch, ctx, kv_heads, dim, dtype=dtypes[elem], device="meta")
    # q and out, K and V
    expected = 2 * q.numel() * q.element_size() + 2 * kv.numel() * kv.element_size()
    got = decode_call_bytes(batch, ctx, heads, kv_heads, dim, elem)
    assert got == expected, f"batch {batch} ctx {ctx} heads {heads}/{kv_heads} dim {dim} " \
        f"elem {elem}: {got} != {expected}"
print("Exercise 3 passed: decode_call_bytes matches the H200 record and the tensors' sizes")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/05.json` *before* measuring; then `make analysis CH=05 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("05")

# %% [markdown]
# ## Summary
#
# - Decode attention does about $2H/(H_{kv}e)$ operations per byte, two for Qwen3-0.6B in
#   bf16, far below an H200's compute/bandwidth balance (§1 prints the factor): it is
#   memory-bound, and a good kernel reads every KV byte exactly once while keeping the memory
#   busy.
# - **Paged gather + online softmax**: visit the sequence's blocks in block-table order and fold
#   each into a running `(m, ℓ, acc)`; no contiguous copy, padding entries never read.
# - **GQA**: one program per `(sequence, KV head)` handles the whole query group as a
#   `[group, d]` tile, so each block is read once instead of `group` times.
# - **Split-KV**: when `batch × num_kv_heads` programs cannot fill the GPU, cut each key range
#   into chunks and merge the partial states with the log-sum-exp rule
#   $o = \sum_s e^{m_s-M}a_s / \sum_s e^{m_s-M}\ell_s$; `choose_num_splits` decides from shapes
#   only, so the call can live in a CUDA graph.
# - The package's Triton kernels (`nanovllm/kernels/decode_attention.py`,
#   `nanovllm/kernels/store_kv.py`) agree with a float64 reference under the Triton interpreter
#   on this CPU, in fp32 and bf16, with and without splits, including empty padding rows; the
#   `triton` backend agrees with the `torch` backend on a full decode step.
# - Recorded on an H200: from batch 64 on the kernel streams the paged cache at 86–102% of the
#   copy bandwidth, within a few percent of cuDNN reading contiguous tensors; small batches are
#   latency-bound for everyone. Paging costs almost nothing.
#
# Next, chapter 06 decides *which* sequences share a step, and chapter 07 removes the cost that
# dominates once the kernels are this fast: launching them.

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
# # Chapter 03 — The KV cache
#
# A language model writes one token at a time. To choose token $n+1$ it needs the whole text so
# far, tokens $1 \dots n$, and the obvious way to give it that text is to run the model over all
# $n$ tokens again. That is what chapters 01 and 02 did, and it is hopelessly wasteful: almost
# everything computed for token $n+1$ was already computed, bit for bit, for token $n$.
#
# The fix is the **key–value cache**: keep, for every layer, the keys and values of all past
# tokens, and at each step compute only the newest token. This chapter
#
# 1. separates the two phases of generation, **prefill** and **decode**, and shows *why* past
#    keys and values can be kept (causality), by experiment on the real model;
# 2. builds a small contiguous KV cache in a few lines, then looks at the package's;
# 3. derives what the cache saves in FLOPs, **measures** time per generated token with and
#    without a cache on SmolLM2, and checks that both produce the same greedy tokens;
# 4. counts the **bytes per token** the cache costs, for SmolLM2-135M, Qwen3-0.6B and a
#    Llama-3-8B-shaped model, and how many tokens fit next to the weights in 80 GB;
# 5. measures the **waste** of the simplest cache layout, one contiguous buffer per request
#    reserved for `max_model_len`, against allocating in blocks of 16 tokens, on a benchmark
#    workload and a long-tailed one. That waste is the reason for chapter 04's paged cache.
#
# **Package modules taught here:** `nanovllm/models/model_config.py` (`kv_bytes_per_token`),
# `nanovllm/engine/kv_cache.py` (how the engine sizes and allocates its cache),
# `nanovllm/layers/attention.py` and `nanovllm/layers/torch_attention.py` (how attention writes
# and reads the cache), `nanovllm/context.py` (the per-step attention metadata; `None` means no
# cache), and `nanovllm/models/llama.py` (the model whose cache we build).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(3)

# %% [markdown]
# ## Setup
#
# The model runs on the accelerator when there is one (`device`), always in fp32 in this
# chapter, so that the token ids we print are the same on a CPU and on a GPU. On a CPU we let
# PyTorch use a single thread: the matrix products of this chapter are small (a decode step
# multiplies *one* row by each weight matrix), and on a small machine shared with other work,
# threads that wait for each other at every operation cost more than they save. On the shared
# 2-core machine that built this notebook, one thread made the model several times faster and
# its timings far steadier. (On a big idle CPU, remove that line to use all cores.)
# `show_source` renders the package's code (those cells are not compared by the notebook test:
# they show code that keeps evolving).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.context import attention_metadata
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.viz import BOOK_COLORS, figure, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":
    torch.set_num_threads(1)
torch.manual_seed(0)
use_book_style()


def sync() -> None:
    """Wait for the accelerator, so that a timer measures finished work."""
    if device == "cuda":
        torch.cuda.synchronize()


# %% [markdown]
# We start the engine once and use it for the whole chapter. Three options matter here:
# `dtype="float32"` (see above); `kv_cache_memory`, the number of bytes the engine may spend on
# its KV cache (section 3 explains how it turns bytes into blocks); and
# `enable_prefix_caching=False`, so that every request computes its own prompt (chapter 04 shows
# what that cache shares between requests). The model inside the engine,
# `llm.engine.runner.model`, is an ordinary `torch.nn.Module`, the one chapter 01 built: we will
# also call it directly, without the engine.

# %%
# NBVAL_IGNORE_OUTPUT
path = smollm2_path()  # SmolLM2-135M-Instruct, real weights (chapter 00)
start = time.perf_counter()
llm = LLM(path, dtype="float32", kv_cache_memory=256 * 2**20, enable_prefix_caching=False)
model = llm.engine.runner.model
cfg = model.config
tokenizer = llm.tokenizer
print(f"engine on {llm.config.device} ({llm.config.dtype}), "
      f"attention backend {llm.engine.runner.backend.name!r}, "
      f"started in {time.perf_counter() - start:.1f} s")

# %% [markdown]
# ## 1. Prefill and decode
#
# Generating a reply to a prompt of $n$ tokens happens in two phases.
#
# - **Prefill.** The model reads the whole prompt in one forward pass: $n$ tokens in, through
#   every layer. Attention is causal (token $t$ attends to tokens $0 \dots t$), all $n$ queries
#   at once. Only the *last* position's hidden state goes through the LM head, because only it
#   predicts a token we do not have yet: the first generated token.
# - **Decode.** Then, once per generated token: one token in (the one just sampled), one token
#   out. Its query attends to the keys and values of *every* earlier token plus its own.
#
# Prefill is a few large matrix products (`[n, hidden] @ [hidden, ...]`): lots of arithmetic per
# weight read, so for prompts of a few hundred tokens or more it is limited by compute. A decode
# step multiplies a single row by every
# weight matrix: it reads all the weights to do two FLOPs per weight, so it is limited by
# memory bandwidth. Serving engines treat the two phases differently for that reason
# (chapter 06 mixes them in one batch).
#
# Where do the keys and values of earlier tokens come from during decode? Without a cache,
# from recomputing them: each decode step would be a full prefill over prompt plus everything
# generated so far. With a cache, from memory.
#
# ### 1.1 Why past keys and values never change
#
# In layer $\ell$, token $t$'s key and value are linear functions of its hidden state,
# $k_t^{\ell} = W_K\,\mathrm{RMSNorm}(x_t^{\ell})$ (then rotated by RoPE at position $t$) and
# $v_t^{\ell} = W_V\,\mathrm{RMSNorm}(x_t^{\ell})$. And $x_t^{\ell}$ depends only on tokens
# $0 \dots t$: the embedding of token $t$ does, and every layer mixes positions only through
# causal attention, which for position $t$ reads positions $\le t$. By induction over the layers,
# **nothing in the computation of token $t$ looks at tokens after it.** Appending a token
# therefore changes no earlier key or value, in any layer. They can be computed once, stored,
# and reused at every later step.
#
# An experiment on the real model: run it over a prompt of $n$ tokens, then over the same prompt
# plus one more token, and capture the keys and values that every attention layer receives
# (a forward hook on each `Attention` module sees its inputs `q, k, v`). Under
# `attention_metadata(None)` (`nanovllm/context.py`) the attention layers have no cache to use
# and attend causally over exactly the tokens they are given; section 1.3 shows that branch.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.layers.attention import Attention

prompt = "The keys and values of past tokens can be stored because"
prompt_ids = tokenizer.encode(prompt)
attention_layers = [m for m in model.modules() if isinstance(m, Attention)]


@torch.inference_mode()
def keys_and_values(token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) as each attention layer receives them, for one forward pass without a cache."""
    seen = []
    hooks = [
        layer.register_forward_hook(lambda mod, args, out: seen.append((args[1], args[2])))
        for layer in attention_layers
    ]
    try:
        with attention_metadata(None):
            ids = torch.tensor(token_ids, device=device)
            model(ids, torch.arange(len(ids), device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


n = len(prompt_ids)
short = keys_and_values(prompt_ids)
longer = keys_and_values(prompt_ids + tokenizer.encode(" the"))
print(f"prompt: {n} tokens; k per layer {tuple(short[0][0].shape)} = [tokens, kv_heads, head_dim]")
diff = max(
    (a[:n] - b[:n]).abs().max().item()
    for (ka, va), (kb, vb) in zip(short, longer)
    for a, b in ((ka, kb), (va, vb))
)
assert diff <= 1e-4, diff
print(f"{len(short)} layers: keys and values of the first {n} tokens unchanged by a new token "
      f"(max |diff| <= 1e-4)")

# %% [markdown]
# They agree to fp32 rounding (the two passes multiply matrices of different heights, which may
# sum in a different order). So the $n$ rows can be kept; appending the new token's key and
# value makes the $n+1$ rows a later step needs.
#
# ### 1.2 A small KV cache
#
# The simplest cache for one request: for every layer, one buffer of keys and one of values,
# each `[max_len, kv_heads, head_dim]`, reserved up front for the longest sequence the request
# may reach, and a count of the rows filled so far. A forward pass over new tokens then does,
# in each layer, exactly what the model's own attention block does, with one change: it writes
# the new keys and values into the next free rows, and attends over *all* filled rows.
#
# We walk the package model's own submodules (`nanovllm/models/llama.py`: norms, packed q/k/v
# projection, rotary embedding, output projection, MLP), so the only new code is the cache.
# `causal_attention` (`nanovllm/layers/torch_attention.py`, chapter 02) attends queries that
# are the *last* $L_q$ of $L_k$ positions: a prefill ($L_q = L_k$) gets the usual causal mask,
# a decode ($L_q = 1$) sees every key.

# %%
from nanovllm.layers.torch_attention import causal_attention


class ContiguousKVCache:
    """One request's keys and values for every layer, reserved for max_len tokens up front."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # rows filled so far (the same in every layer)


def forward_with_cache(model, ids: torch.Tensor, cache: ContiguousKVCache) -> torch.Tensor:
    """Hidden states of the new tokens `ids`, which follow the `cache.length` cached ones."""
    start, end = cache.length, cache.length + len(ids)
    positions = torch.arange(start, end, device=ids.device)
    x = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([q_size, kv_size, kv_size], -1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        if attn.qk_norm:  # Qwen3 only
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rotary_emb(positions, q, k)
        cache.k[i, start:end], cache.v[i, start:end] = k, v  # store the new rows ...
        # ... and attend over all of them
        out = causal_attention(q, cache.k[i, :end], cache.v[i, :end], attn.attn.scale)
        x = x + attn.o_proj(out.flatten(1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length = end
    return model.model.norm(x)


# %% [markdown]
# Two generate loops, both greedy. `generate_no_cache` calls the package model over the whole
# sequence at every step, under `attention_metadata(None)`: no cache anywhere, every key and
# value recomputed. `generate_with_cache` runs one prefill over the prompt, then feeds only the
# newest token each step.

# %%
@torch.inference_mode()
def generate_no_cache(model, prompt_ids: list[int], n_new: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence for every new token."""
    ids = list(prompt_ids)
    with attention_metadata(None):
        for _ in range(n_new):
            x = torch.tensor(ids, device=device)
            hidden = model(x, torch.arange(len(ids), device=device))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt_ids):]


@torch.inference_mode()
def generate_with_cache(model, prompt_ids: list[int], n_new: int, max_len: int) -> list[int]:
    """Greedy decoding with a contiguous KV cache: one prefill, then one token per step."""
    cache = ContiguousKVCache(model.config, max_len, next(model.parameters()).dtype, device)
    new, feed = [], list(prompt_ids)  # prefill feeds the prompt, each decode the newest token
    for _ in range(n_new):
        hidden = forward_with_cache(model, torch.tensor(feed, device=device), cache)
        new.append(int(model.compute_logits(hidden[-1:]).argmax()))
        feed = new[-1:]
    return new


# %% [markdown]
# First a direct check of the cached forward pass: after a prefill of the prompt and a few
# decode steps, each step's hidden state must equal what a full forward pass over the same
# tokens computes at that position.

# %%
# NBVAL_CHECK_OUTPUT
with torch.inference_mode():
    extra = tokenizer.encode(" they never change")
    all_ids = torch.tensor(prompt_ids + extra, device=device)
    with attention_metadata(None):
        full = model(all_ids, torch.arange(len(all_ids), device=device))
    cache = ContiguousKVCache(cfg, max_len=64, device=device)
    steps = [forward_with_cache(model, all_ids[:n], cache)]  # prefill
    steps += [forward_with_cache(model, all_ids[t : t + 1], cache) for t in range(n, len(all_ids))]
    cached = torch.cat(steps)
worst = (cached - full).abs().max().item()
assert worst <= 1e-3, worst
print(f"prefill of {n} tokens + {len(extra)} decode steps: hidden states equal a full forward "
      f"pass (max |diff| <= 1e-3); cache holds {cache.length} of {cache.k.shape[1]} rows")

# %% [markdown]
# ### 1.3 The package's cache
#
# The engine does the same thing with two differences that later chapters explain: its cache is
# one tensor shared by *all* requests and cut into **blocks** of `block_size` tokens (a request
# owns a list of blocks, its *block table*, chapter 04), and each step packs many requests'
# tokens together. The attention layer (`nanovllm/layers/attention.py`) first stores the new
# keys and values, then attends over the cache. When no attention metadata is set, the branch
# our no-cache loop uses, it simply attends over the tokens it was given:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(Attention.forward)

# %% [markdown]
# The PyTorch backend's store is a scatter: `slot_mapping` gives, for every new token, its row
# in the flattened cache (`block * block_size + offset`; -1 means "do not store"). A decode step
# then gathers each sequence's blocks back into a contiguous run and attends over it
# (`nanovllm/layers/torch_attention.py`; chapter 05 replaces both with Triton kernels):

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers import torch_attention

show_source(torch_attention.store_kv, torch_attention.decode_attention)

# %% [markdown]
# The model runner allocates the whole cache once, at start-up (`nanovllm/engine/kv_cache.py`),
# as a single tensor `[2, layers, blocks, block_size, kv_heads, head_dim]`, and hands each
# attention layer its two slices:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.kv_cache import allocate_kv_cache

show_source(allocate_kv_cache)

# %%
# NBVAL_CHECK_OUTPUT
kv_cache = llm.engine.runner.kv_cache
print("engine KV cache shape:", tuple(kv_cache.shape), kv_cache.dtype)
print("layer 0 k_cache is a view into it:",
      attention_layers[0].k_cache.data_ptr() == kv_cache[0, 0].data_ptr())

# %% [markdown]
# ## 2. What the cache saves
#
# ### 2.1 FLOPs, derived
#
# Count the multiply–adds of one forward pass (2 FLOPs each). Per token and layer, the weight
# matrices cost
#
# $$F_{\text{proj}} = 2\,\bigl[\,D\,(H + 2H_{kv})\,d \;+\; H d\,D
#   \;+\; 3\,D\,D_{\text{ff}}\,\bigr]$$
#
# (packed q/k/v, output projection, gate/up and down of the MLP; $D$ hidden size, $H$ and
# $H_{kv}$ query and key/value heads, $d$ head dimension, $D_{\text{ff}}$ MLP width). Attention of
# a query at position $t$ over its $t+1$ keys costs $4 H d\,(t+1)$ per layer: $2Hd(t+1)$ for the
# scores $QK^\top$ and as much for the weighted sum of values. The LM head, $2\,D\,V$ FLOPs, runs
# once per step, for the last position only. With $N_{\text{layers}}$ layers (the book's notation
# keeps $L$ for a sequence length), producing the token after a sequence of $n$ tokens costs
#
# $$\text{without a cache:}\quad C_{\text{none}}(n) = n\,N_{\text{layers}} F_{\text{proj}}
#   + 4Hd\,N_{\text{layers}}\sum_{t=1}^{n} t
#   + 2DV = n\,N_{\text{layers}} F_{\text{proj}} + 2Hd\,N_{\text{layers}}\,n(n+1) + 2DV,$$
#
# $$\text{with a cache:}\quad C_{\text{cache}}(n) = N_{\text{layers}} F_{\text{proj}}
#   + 4Hd\,N_{\text{layers}}\,n + 2DV .$$
#
# Without a cache each step recomputes the whole prefix: the step cost grows linearly in $n$,
# so generating $n_{\text{out}}$ tokens costs $\sum_n C_{\text{none}}(n) = O(n_{\text{out}}^2)$
# projections (plus an $O(n_{\text{out}}^3)$ attention term). With the cache each step computes one
# token's projections, $O(n_{\text{out}})$ in total; what still grows is attention over the cached
# keys, $4Hd\,N_{\text{layers}}$ per token of context. For SmolLM2 that stays below
# $N_{\text{layers}} F_{\text{proj}}$ up to a few thousand tokens (the exact crossover is printed
# below), and it is mostly *memory traffic*: every decode step reads the whole cache of its
# sequence (chapter 05).

# %%
# NBVAL_CHECK_OUTPUT
def flop_terms(c: ModelConfig) -> tuple[int, int, int]:
    """(N_layers*F_proj, 4*H*d*N_layers, 2*D*V): projections per token, attention per key, LM
    head per step."""
    D, H, Hkv, d, layers = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    proj = 2 * layers * (D * (H + 2 * Hkv) * d + H * d * D + 3 * D * c.intermediate_size)
    return proj, 4 * H * d * layers, 2 * D * c.vocab_size


def step_flops(c: ModelConfig, n: int, cached: bool) -> int:
    """FLOPs of the forward pass that produces the token after a sequence of n tokens."""
    proj, attn, head = flop_terms(c)
    if cached:
        return proj + attn * n + head
    return n * proj + attn * n * (n + 1) // 2 + head


proj, attn, head = flop_terms(cfg)
proj_weights = sum(
    p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight")
)
assert proj == 2 * proj_weights  # the formula counts exactly the package model's matrices
print(f"SmolLM2 per token: projections L*F_proj = {proj / 1e6:.1f} MFLOP "
      f"(= 2 x {proj_weights:,} projection weights), LM head {head / 1e6:.1f} MFLOP, "
      f"attention {attn:,} FLOP per cached token")
print(f"attention over the cache costs as much as the projections at n = {proj / attn:,.0f} tokens")
n_weights = sum(p.numel() for p in model.parameters())
print(f"a decode step reads all {n_weights:,} weights once: {4 * n_weights / 1e6:.0f} MB in fp32, "
      f"for {(proj + head) / n_weights:.1f} FLOPs per weight")
print()
print(f"{'n':>6} {'no cache':>14} {'with cache':>14} {'ratio':>7}   (GFLOP for the next token)")
for n_ctx in (16, 128, 1024, 4096):
    none, with_cache = step_flops(cfg, n_ctx, False), step_flops(cfg, n_ctx, True)
    print(f"{n_ctx:>6} {none / 1e9:>14.2f} {with_cache / 1e9:>14.3f} {none / with_cache:>7.0f}x")
N = 1024
total_none = sum(step_flops(cfg, k, False) for k in range(1, N + 1))
total_cache = sum(step_flops(cfg, k, True) for k in range(1, N + 1))
print(f"\ngenerating {N} tokens from one: {total_none / 1e12:.1f} TFLOP without a cache, "
      f"{total_cache / 1e12:.2f} TFLOP with one ({total_none / total_cache:.0f}x less)")

# %% [markdown]
# Read the table: without a cache, the cost of the next token is proportional to the length
# (the ratio column grows like $n$). With a cache it grows only through attention over the
# cached keys, which for SmolLM2 catches up with the projections at the length printed above,
# so from 16 to 4,096 tokens the cost of a step merely doubles. Over a 1024-token generation
# the cache saves the factor printed last.
#
# ### 2.2 Same tokens, with or without a cache
#
# A cache is an optimisation only if it changes nothing. We generate 12 greedy tokens three
# ways: recomputing everything (`generate_no_cache`), with our contiguous cache
# (`generate_with_cache`), and with the engine, whose paged cache is read and written by the
# attention backend. The engine gets the same string and tokenizes it the same way.

# %%
N_NEW = 12
greedy = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
tokens_no_cache = generate_no_cache(model, prompt_ids, N_NEW)
tokens_small_cache = generate_with_cache(model, prompt_ids, N_NEW, max_len=n + N_NEW)
engine_out = llm.generate(prompt, greedy, use_tqdm=False)[0]
print(repr(prompt + tokenizer.decode(tokens_no_cache)))

# %%
# NBVAL_CHECK_OUTPUT
print("engine tokenized the same prompt:", engine_out.prompt_token_ids == prompt_ids)
print(f"{N_NEW} greedy tokens, no cache == our contiguous cache:",
      tokens_no_cache == tokens_small_cache)
print(f"{N_NEW} greedy tokens, no cache == engine (paged cache):",
      tokens_no_cache == engine_out.token_ids)

# %% [markdown]
# ### 2.3 Time per generated token
#
# Now the measurement. For each sequence length $n$ in `LENGTHS` we take a prompt of $n$ random
# token ids and measure
#
# - **no cache**: one step of `generate_no_cache`, i.e. one forward pass over all $n$ tokens
#   (the faster of two runs);
# - **with the cache**: a decode step of the engine at lengths $n+1 \dots n+5$. The engine
#   records the wall time of every step in `llm.engine.stats` (`nanovllm/engine/metrics.py`,
#   chapter 06), with how many prefill and decode tokens it ran; we take the fastest of the 5
#   decode steps;
# - **prefill**: the engine's first step for that request, one forward pass over the $n$ prompt
#   tokens that also fills the cache.
#
# Taking the fastest of several runs filters out moments when other programs had the
# processor. The timings are this machine's, so the cell is not compared by the notebook test.

# %%
# NBVAL_IGNORE_OUTPUT
LENGTHS = [16, 32, 64, 128, 256, 512]
rng = np.random.default_rng(0)
measured = {"no cache": [], "with cache": [], "prefill": []}
for length in LENGTHS:
    ids = rng.integers(0, 10_000, length).tolist()
    runs = []
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        generate_no_cache(model, ids, 1)
        sync()
        runs.append(time.perf_counter() - t0)
    first_step = llm.engine.stats.num_steps
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    steps = [s for s in llm.engine.stats.steps if s.step >= first_step]
    decodes = [s.wall_time for s in steps if s.num_prefill_tokens == 0]
    assert len(decodes) == 5 and steps[0].num_prefill_tokens == length
    measured["no cache"].append(min(runs))
    measured["with cache"].append(min(decodes))
    measured["prefill"].append(steps[0].wall_time)
print(f"{'n':>5} {'no cache':>11} {'with cache':>11} {'speed-up':>9} {'prefill':>11}"
      f"   (ms per token; prefill: ms for all n)   on {device}")
for i, length in enumerate(LENGTHS):
    row = {k: v[i] * 1e3 for k, v in measured.items()}
    print(f"{length:>5} {row['no cache']:>11.1f} {row['with cache']:>11.1f} "
          f"{row['no cache'] / row['with cache']:>8.1f}x {row['prefill']:>11.1f}")

# %% [markdown]
# Without a cache, time per token grows with the length, as section 2.1 predicts, while with the
# cache it stays roughly flat. Two details the FLOP count alone does not explain:
#
# - At the shortest lengths the two are closer than the FLOP ratio says. A decode step moves a
#   single token through every weight matrix, so it reads all the weights (the megabytes
#   printed in section 2.1) to do about two FLOPs per weight: its time is set by memory
#   bandwidth, not arithmetic. A forward pass over 16 tokens reads the same weights once and
#   does 16 times the arithmetic, almost for free.
# - The no-cache step and the prefill should take about the same time at each length: without
#   a cache *every* step is a prefill.
#
# Figure 3.1 puts the derived FLOPs (left) next to the measured times of one step (right):
# the next token without a cache (a forward pass over all $n$ tokens), the next token with it
# (one decode step), and, for comparison, the prefill step that fills the cache with $n$ tokens.

# %%
n_axis = np.unique(np.geomspace(1, 4096, 200).astype(int))
fig, (ax_flops, ax_time) = plt.subplots(1, 2, figsize=(11, 3.8))
ax_flops.plot(n_axis, [step_flops(cfg, int(k), False) / 1e9 for k in n_axis], label="no cache")
ax_flops.plot(n_axis, [step_flops(cfg, int(k), True) / 1e9 for k in n_axis], label="KV cache")
ax_flops.set(xscale="log", yscale="log", xlabel="sequence length n (tokens)",
             ylabel="GFLOP for the next token", title="Derived: SmolLM2-135M")
ax_flops.legend()
ax_time.plot(LENGTHS, np.array(measured["no cache"]) * 1e3, "o-", label="next token, no cache")
ax_time.plot(LENGTHS, np.array(measured["with cache"]) * 1e3, "o-",
             label="next token, KV cache (engine decode step)")
ax_time.plot(LENGTHS, np.array(measured["prefill"]) * 1e3, "x:", color=BOOK_COLORS[2],
             label="prefill of n tokens (engine)")
ax_time.set(xlabel="sequence length n (tokens)", ylabel="time of one step (ms)",
            title=f"Measured on {device}, fp32", ylim=(0, None))
ax_time.legend()
figure(fig, "03_kv_cache_cost",
       "The cost of the next token against the sequence length n, SmolLM2-135M: FLOPs derived from"
       f" the model's shapes (left) and the measured time of one step on {device}, fp32 (right),"
       " without a cache, with the KV cache, and for the prefill of n tokens. Without a cache"
       " the cost grows with n; with it, it stays nearly flat.")

# %% [markdown]
# ## 3. What the cache costs: bytes per token
#
# The cache trades compute for memory. Every token keeps, in every layer, one key and one value
# vector per key/value head:
#
# $$\text{KV bytes per token} = 2 \times N_{\text{layers}} \times H_{kv} \times d \times e,$$
#
# with $e$ bytes per element.
#
# The factor 2 is K and V. The query heads do not appear: with grouped-query attention
# (chapter 01) only the $H_{kv}$ shared heads are cached, which is why models adopted it. The
# package computes exactly this in `ModelConfig` (`nanovllm/models/model_config.py`):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(ModelConfig.kv_bytes_per_token)

# %% [markdown]
# Three models: SmolLM2-135M (this book's model), Qwen3-0.6B (the benchmark shape, shipped as a
# config in `nanovllm/configs/`), and a model shaped like Llama-3-8B, whose config we write here
# as a dictionary in `config.json` form. The weight count comes from building the package's
# model class on PyTorch's `meta` device, which creates every parameter's shape without
# allocating memory.

# %%
from nanovllm.configs import config_path

llama3_8b_shape = {  # the published Llama-3-8B architecture, written as a config.json
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
models = {
    "SmolLM2-135M": ModelConfig.from_pretrained(path),
    "Qwen3-0.6B": ModelConfig.from_pretrained(config_path("qwen3-0.6b")),
    "Llama-3-8B shape": ModelConfig.from_dict(llama3_8b_shape),
}


def count_parameters(c: ModelConfig) -> int:
    """Parameters of the package's model for config c (tied matrices counted once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in get_model_class(c.architecture)(c).parameters())


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
params = {name: count_parameters(c) for name, c in models.items()}
print(f"{'':18} {'N_layers':>8} {'Hkv':>4} {'d':>4} | KV bytes/token:"
      f"{'fp32':>8} {'bf16':>8} {'fp8':>7} | parameters")
for name, c in models.items():
    per_dtype = [c.kv_bytes_per_token(b) for b in DTYPE_BYTES.values()]
    print(f"{name:18} {c.num_layers:>8} {c.num_kv_heads:>4} {c.head_dim:>4} | {'':15}"
          + "".join(f"{b:>8,}" for b in per_dtype) + f" | {params[name] / 1e9:.3f} B")

# %% [markdown]
# A Llama-3-8B-shaped model keeps 131,072 bytes (128 KiB) per token in bf16; Qwen3-0.6B, with
# its 8 KV heads of 128 channels, almost as much, with less than a tenth of the parameters;
# SmolLM2's 3 small KV heads keep it light. fp8 halves the bf16 figure again (chapter 08).
#
# How much fits in the memory of one 80 GB GPU (80 GiB) once bf16 weights are loaded? (This
# ignores activations and the part of the GPU that `gpu_memory_utilization` leaves to others, so
# real figures are somewhat lower.) The last two columns put the cache in perspective: the number
# of tokens whose cache weighs as much as the model itself, and how many requests fit when each is
# given a contiguous buffer for 4,096 tokens up front (section 4).

# %%
GPU_BYTES = 80 * 2**30
MAX_MODEL_LEN = 4096
print(f"{'bf16 weights + bf16 KV':18} {'weights':>9} {'KV/token':>9} {'tokens in 80 GiB':>17}"
      f" {'KV = weights at':>16} {'4k buffers':>11}")
capacity = {}
for name, c in models.items():
    weight_bytes = 2 * params[name]
    per_token = c.kv_bytes_per_token(2)
    capacity[name] = (GPU_BYTES - weight_bytes) // per_token
    print(f"{name:18} {weight_bytes / 2**30:>7.2f} GiB {per_token / 1024:>5.1f} KiB "
          f"{capacity[name]:>17,} {weight_bytes // per_token:>10,} tokens "
          f"{capacity[name] // MAX_MODEL_LEN:>11,}")

# %% [markdown]
# Even the 8B-shaped model has room for several hundred thousand tokens next to its weights,
# and for the small models the cache, not the weights, is what fills the GPU: Qwen3-0.6B's
# weights weigh as much as the cache of about ten thousand tokens, a few long requests.
# Generation throughput comes from batching many requests (chapter 06), and the number of
# requests in a batch is bounded by how many caches fit. Every byte of cache wasted is batch
# size lost.
#
# The engine sizes its cache with the same formula, per **block** of `block_size` tokens. On a
# GPU the budget is the engine's share of the card (`gpu_memory_utilization` times its memory)
# less what the engine itself takes: the weights, a warm-up pass's activations, the CUDA graphs;
# on a CPU, or when `kv_cache_memory` is given, it is that number of bytes. The budget is
# rounded down to whole blocks:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.kv_cache import kv_budget_in_blocks, kv_bytes_per_block

show_source(kv_bytes_per_block, kv_budget_in_blocks)

# %%
# NBVAL_CHECK_OUTPUT
runner = llm.engine.runner
per_block = cfg.kv_bytes_per_token(4) * llm.config.block_size
print(f"SmolLM2 fp32: {cfg.kv_bytes_per_token(4):,} bytes per token x block_size "
      f"{llm.config.block_size} = {per_block:,} bytes per block;"
      f" engine says {runner.kv_bytes_per_block():,}")
print(f"budget {llm.config.kv_cache_memory:,} bytes // {per_block:,} = "
      f"{llm.config.kv_cache_memory // per_block} blocks; engine allocated {runner.num_kv_blocks} "
      f"blocks = {runner.num_kv_blocks * llm.config.block_size:,} tokens")
print("cache tensor bytes == blocks x bytes per block:",
      runner.kv_cache.numel() * runner.kv_cache.element_size() == runner.num_kv_blocks * per_block)

# %% [markdown]
# ## 4. The waste of contiguous per-request caches
#
# Our `ContiguousKVCache` reserved `max_len` rows before the request produced a single token.
# It has to: the output length is unknown until the model emits an end-of-sequence token, and
# a contiguous buffer cannot grow in place once other requests' buffers sit next to it. An
# engine built this way reserves `max_model_len` tokens for every request it admits, and a
# request that ends after 300 tokens leaves the rest of its buffer empty for its whole life.
# This was how early serving systems (and a plain `transformers` `generate` with a static
# cache) laid out memory.
#
# The alternative, chapter 04's subject: cut the cache into **blocks** of `block_size` tokens
# (16 here) and give a request a new block only when its last one is full. Its blocks need not
# be adjacent; a *block table* records where they are. The only waste left is inside each
# request's last block: at most `block_size - 1` tokens, *internal fragmentation*.
#
# We compare the two on two request mixes, both with `max_model_len` = 4,096:
#
# - **benchmark**: the 256 requests of the nano-vllm benchmark
#   (`nanovllm.benchmarks.workload.make_workload`, seed 0): prompts of 100–1,024 tokens and
#   outputs of 100–1,024 tokens, both uniform;
# - **long tail**: 256 chat-like requests, prompt and output lengths drawn from lognormal
#   distributions (seed 0; median prompt 300, median output 200 tokens), so most requests are
#   short and a few are very long, capped at the model length.

# %%
from nanovllm.benchmarks.workload import make_workload

BLOCK_SIZE = 16
bench = make_workload("nano-vllm", seed=0)
rng = np.random.default_rng(0)
tail_prompt = np.clip(rng.lognormal(np.log(300), 1.0, 256).astype(int), 4, MAX_MODEL_LEN // 2)
tail_output = np.clip(rng.lognormal(np.log(200), 1.0, 256).astype(int), 1, None)
tail_output = np.minimum(tail_output, MAX_MODEL_LEN - tail_prompt)
workloads = {
    "benchmark": (np.array([len(p) for p in bench.prompts]), np.array(bench.output_lens)),
    "long tail": (tail_prompt, tail_output),
}
for name, (p, o) in workloads.items():
    total = p + o
    print(f"{name:10} {len(total)} requests; final length (prompt + output) "
          f"median {int(np.median(total)):,}, p90 {int(np.percentile(total, 90)):,}, "
          f"max {total.max():,} tokens; mean {total.mean():,.0f}")

# %% [markdown]
# Two snapshots of memory, for each workload:
#
# - **at the end**: every request at its final length, the moment it holds the most. Used =
#   the sum of final lengths; contiguous = `max_model_len` per request; paged = each final length
#   rounded up to whole blocks. The package's block manager (`nanovllm/engine/block_manager.py`)
#   does that rounding in `blocks_needed`, which we call to be sure we count what it allocates.
# - **averaged over each request's life**: a request holds $p + k$ tokens while it generates its
#   $k$-th output token. Over its decode steps, used memory grows linearly; paged memory follows
#   it in steps of 16; contiguous memory is `max_model_len` throughout.

# %%
from nanovllm.engine.block_manager import BlockManager

blocks = BlockManager(num_blocks=1, block_size=BLOCK_SIZE)  # only its arithmetic is used here


def paged_tokens(lengths) -> np.ndarray:
    """Slots a paged cache reserves for sequences of these lengths: whole blocks."""
    return np.array([blocks.blocks_needed(int(n)) * BLOCK_SIZE for n in lengths])


waste = {}
for name, (p, o) in workloads.items():
    final = p + o
    used_end, paged_end = final.sum(), paged_tokens(final).sum()
    contiguous_end = len(final) * MAX_MODEL_LEN
    # over the life of each request: lengths p+1 .. p+o, one decode step each
    life = [np.arange(pi + 1, pi + oi + 1) for pi, oi in zip(p, o)]
    used_life = sum(x.sum() for x in life)
    paged_life = sum(paged_tokens(x).sum() for x in life)
    contiguous_life = o.sum() * MAX_MODEL_LEN
    per_request = paged_tokens(final) - final
    assert per_request.max() <= BLOCK_SIZE - 1
    waste[name] = {"used": used_end, "contiguous": contiguous_end, "paged": paged_end}
    print(f"{name}:")
    print(f"  at the end:    contiguous uses {used_end / contiguous_end:6.1%} of what it "
          f"reserves, paged {used_end / paged_end:6.2%}")
    print(f"  over the life: contiguous uses {used_life / contiguous_life:6.1%} of what it "
          f"reserves, paged {used_life / paged_life:6.2%}")
    print(f"  paging's internal fragmentation: {per_request.mean():.1f} tokens per request on "
          f"average, at most {per_request.max()} (bound: block_size - 1 = {BLOCK_SIZE - 1})")

# %% [markdown]
# Contiguous reservation leaves most of the memory empty: on the benchmark, where the longest
# request is about half of `max_model_len`, the requests use only the fraction printed above of
# their buffers even at their longest, and less over their lifetime, while they grow. On the
# long tail it is worse: most requests are short, and each of them still holds a 4,096-token
# buffer. Paging wastes only the unfilled end of each request's last block, on average about
# half a block, whatever the distribution.
#
# In bytes, for Qwen3-0.6B in bf16 with all 256 requests of each workload resident at their
# final length:

# %%
qwen_token_bytes = models["Qwen3-0.6B"].kv_bytes_per_token(2)
for name, w in waste.items():
    print(f"{name:10} used {w['used'] * qwen_token_bytes / 2**30:5.1f} GiB; reserved: "
          f"contiguous {w['contiguous'] * qwen_token_bytes / 2**30:6.1f} GiB, "
          f"paged {w['paged'] * qwen_token_bytes / 2**30:5.1f} GiB")

# %% [markdown]
# The contiguous layout needs more than an 80 GB GPU to hold 256 requests that actually use a
# fraction of that. Turned around: in a fixed budget, paging admits several times as many
# requests at once, and batch size is throughput.
#
# Figure 3.2 shows the two distributions against `max_model_len` (left), and the memory each
# layout reserves for them with the share actually used written on each bar (right); the dotted
# line is the 80 GiB of one large GPU.

# %%
fig, (ax_len, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.8),
                                     gridspec_kw={"width_ratios": [1.2, 1]})
bins = np.linspace(0, MAX_MODEL_LEN, 41)
for color, (name, (p, o)) in zip(BOOK_COLORS, workloads.items()):
    ax_len.hist(p + o, bins=bins, alpha=0.6, color=color, label=name)
ax_len.axvline(MAX_MODEL_LEN, color="black", linestyle="--", linewidth=1.5)
ax_len.text(MAX_MODEL_LEN - 60, ax_len.get_ylim()[1] * 0.5, "max_model_len: reserved per request",
            rotation=90, ha="right", va="center", fontsize=9)
ax_len.set(xlabel="request length, prompt + output (tokens)", ylabel="requests",
           title="256 requests per workload")
ax_len.legend(loc="upper center")
x = np.arange(len(waste))
gib = qwen_token_bytes / 2**30
for offset, layout, color in ((-0.2, "contiguous", BOOK_COLORS[3]), (0.2, "paged", BOOK_COLORS[2])):
    reserved = np.array([w[layout] for w in waste.values()]) * gib
    used = np.array([w["used"] for w in waste.values()]) * gib
    ax_mem.bar(x + offset, reserved, width=0.38, color=color, alpha=0.3,
               label=f"reserved, {layout}")
    ax_mem.bar(x + offset, used, width=0.38, color=color, label=f"used, {layout}")
    for xi, r, u in zip(x + offset, reserved, used):
        ax_mem.text(xi, r + 2, f"{u / r:.0%} used", ha="center", va="bottom", fontsize=9)
ax_mem.axhline(80, color="black", linestyle=":", linewidth=1.2)
ax_mem.text(x[-1] + 0.45, 81, "80 GiB", ha="right", va="bottom", fontsize=9)
ax_mem.set_xticks(x, list(waste))
ax_mem.set(ylabel="KV cache (GiB)", title="Qwen3-0.6B, bf16, all requests at full length",
           ylim=(0, 165))
ax_mem.legend(fontsize=9, ncol=2, loc="upper center")
figure(fig, "03_kv_cache_waste",
       f"Left: the lengths (prompt + output) of the {len(workloads)} workloads' requests against"
       f" max_model_len = {MAX_MODEL_LEN:,}, which a contiguous cache reserves for each. Right: the"
       " KV memory of Qwen3-0.6B (bf16) that each layout reserves, faint, and the part used,"
       f" solid, with all requests at full length; paging reserves whole blocks of {BLOCK_SIZE}"
       " tokens, so almost all of what it reserves is used.")

# %% [markdown]
# Why not blocks of one token, with no fragmentation at all? Because every block costs a
# block-table entry, and attention kernels read a sequence's keys block by block: larger blocks
# mean fewer, longer contiguous reads (chapter 05). Smaller blocks waste less. The trade-off,
# on the benchmark workload at full length:

# %%
p, o = workloads["benchmark"]
final = p + o
for size in (1, 8, 16, 32, 64, 256, 1024):
    reserved = (-(-final // size) * size).sum()
    print(f"block_size {size:>5}: {1 - final.sum() / reserved:6.2%} of the reserved slots empty, "
          f"{int(np.ceil(final / size).max()):>5} blocks in the longest block table")

# %% [markdown]
# 16 tokens wastes well under one percent here, with block tables that stay short; it is the
# engine's default (`EngineConfig.block_size`), as in vLLM.

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# these parts of the package yourself: the store of new keys and values into their cache slots,
# and batched decode attention over each sequence's cached tokens. Each function's docstring is
# the handout; the project's tests grade your code (`make check CHAPTERS=03` in your edition), and
# once they pass this notebook runs on your own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("03"))

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to write; the cell after it checks your version against values
# worked out once and frozen in the check, and against a reference written differently, on
# seeded random inputs; never against the package. The cells are self-contained: run them in
# any order.
#
# **Exercise 1 — bytes per token.** Write `kv_bytes_per_token(config, dtype_bytes)` for a
# `config.json` dictionary. Careful: `num_key_value_heads` may be missing (then every query
# head has its own KV head), and so may `head_dim` (then it is `hidden_size` divided by the
# number of attention heads).

# %% tags=["exercise"]
def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """Bytes of K and V that one token occupies in the cache, over all layers."""
    raise NotImplementedError("exercise 03.kv_bytes_per_token")


# %% tags=["check", "raises-exception"]
import math
import random

# frozen: real models' shapes (layers, KV heads, head_dim), worked out once by hand
frozen = [
    # SmolLM2-135M: no head_dim given, 576 / 9 heads = 64; 3 KV heads; bf16
    ({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
      "num_hidden_layers": 30}, 2, 2 * 30 * 3 * 64 * 2),  # 23,040
    ({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
      "num_hidden_layers": 30}, 4, 46_080),  # the same in fp32
    # Llama-3-8B: 4096 / 32 = 128, 8 KV heads; 128 KiB per token in bf16
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
      "num_hidden_layers": 32}, 2, 131_072),
    # Qwen3-0.6B: head_dim 128 is given and is not 1024 / 16 = 64
    ({"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "num_hidden_layers": 28}, 2, 114_688),
    # the first LLaMA-7B: no num_key_value_heads, so 32 KV heads, one per query head; fp16
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32}, 2, 524_288),
]
for config, dtype_bytes, expected in frozen:
    got = kv_bytes_per_token(config, dtype_bytes)
    assert got == expected, f"{config}, {dtype_bytes} bytes: got {got}, expected {expected}"

rng = random.Random(301)
for _ in range(200):
    heads = rng.choice([4, 8, 12, 16, 32, 40, 64])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": heads * rng.choice([32, 64, 80, 128]),
        "intermediate_size": 1024,
        "num_hidden_layers": rng.randint(1, 80),
        "num_attention_heads": heads,
    }
    if rng.random() < 0.7:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        config["num_key_value_heads"] = rng.choice(divisors)
    if rng.random() < 0.5:
        config["head_dim"] = rng.choice([64, 96, 128, 256])
    dtype_bytes = rng.choice([1, 2, 4])
    # reference: the elements one token adds to the cache, one K and one V row per layer
    kv_heads = config["num_key_value_heads"] if "num_key_value_heads" in config else heads
    head_dim = config["head_dim"] if "head_dim" in config else config["hidden_size"] // heads
    token_shape = (2, config["num_hidden_layers"], kv_heads, head_dim)  # (K/V, layer, head, dim)
    expected = math.prod(token_shape) * dtype_bytes
    got = kv_bytes_per_token(config, dtype_bytes)
    assert got == expected, f"{config}, {dtype_bytes} bytes: got {got}, expected {expected}"
print(f"Exercise 1 passed: kv_bytes_per_token on {len(frozen)} real model shapes and 200 random "
      "configs")

# %% [markdown]
# **Exercise 2 — how many tokens fit.** The engine allocates its cache in whole blocks. Write
# `max_tokens_in_budget(budget_bytes, config, dtype_bytes, block_size)`: the number of tokens
# whose keys and values fit in `budget_bytes` when memory is handed out in blocks of
# `block_size` tokens. The check compares with the caches the engine allocated for a few small
# models (frozen in the check), and with a reference that hands out blocks one at a time on
# random model shapes and budgets.

# %% tags=["exercise"]
def max_tokens_in_budget(budget_bytes: int, config: dict, dtype_bytes: int, block_size: int) -> int:
    """Tokens of KV cache that fit in budget_bytes, counting only whole blocks."""
    raise NotImplementedError("exercise 03.max_tokens_in_budget")


# %% tags=["check", "raises-exception"]
import random

# frozen: the engine, started with kv_cache_memory=budget on these small models, allocated
# this many tokens (blocks x block_size); worked out by hand too, e.g. the first:
# 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes = 512 B a token, 8,192 a block,
# 1,000,000 // 8,192 = 122 blocks = 1,952 tokens
frozen = [  # (config, dtype_bytes, block_size, budget, tokens)
    ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
      "num_hidden_layers": 2}, 4, 16, 1_000_000, 1952),
    ({"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3}, 2, 32, 777_777, 672),
    ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
      "num_hidden_layers": 1}, 2, 8, 200_000, 1560),
]
for config, dtype_bytes, block_size, budget, expected in frozen:
    got = max_tokens_in_budget(budget, config, dtype_bytes, block_size)
    assert got == expected, (f"{config}, {dtype_bytes} bytes, block_size {block_size}, "
                             f"budget {budget}: got {got}, expected {expected}")

rng = random.Random(302)
for _ in range(100):
    heads = rng.choice([2, 4, 8])
    config = {
        "hidden_size": heads * rng.choice([16, 64]),
        "num_hidden_layers": rng.randint(1, 4),
        "num_attention_heads": heads,
    }
    if rng.random() < 0.7:
        config["num_key_value_heads"] = rng.choice([1, heads // 2, heads])
    if rng.random() < 0.3:
        config["head_dim"] = rng.choice([32, 128])
    dtype_bytes = rng.choice([2, 4])
    block_size = rng.choice([1, 8, 16, 32])
    budget = rng.randint(0, 2_000_000)
    # reference: hand out whole blocks, one at a time, while the next one still fits
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    token_bytes = (2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads)
                   * head_dim * dtype_bytes)
    expected, used = 0, 0
    while used + block_size * token_bytes <= budget:
        used += block_size * token_bytes
        expected += block_size
    got = max_tokens_in_budget(budget, config, dtype_bytes, block_size)
    assert got == expected, (f"{config}, {dtype_bytes} bytes, block_size {block_size}, "
                             f"budget {budget}: got {got}, expected {expected}")
print(f"Exercise 2 passed: max_tokens_in_budget on {len(frozen)} frozen engine caches and 100 "
      "random budgets")

# %% [markdown]
# **Exercise 3 — waste.** Write `contiguous_waste(lengths, max_len)`: the fraction of reserved
# cache slots that hold no token when each request (of the given final lengths) gets `max_len`
# slots. It takes a list of ints and returns a float in [0, 1).

# %% tags=["exercise"]
def contiguous_waste(lengths: list[int], max_len: int) -> float:
    """Empty fraction of the slots reserved when each request gets max_len of them."""
    raise NotImplementedError("exercise 03.contiguous_waste")


# %% tags=["check", "raises-exception"]
import math
import random

# frozen, by hand: 4 requests x 128 slots = 512 reserved, 1 + 16 + 17 + 100 = 134 used
got = contiguous_waste([1, 16, 17, 100], 128)
assert math.isclose(got, 378 / 512, abs_tol=1e-12), f"got {got}, expected 378 / 512"
assert contiguous_waste([128, 128], 128) == 0, "full requests waste nothing"
rng = random.Random(303)
for _ in range(100):
    max_len = rng.choice([512, 2048, 4096])
    lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, 50))]
    # reference: count each request's empty slots one at a time
    empty = 0
    for n in lengths:
        empty += max_len - n
    expected = empty / (len(lengths) * max_len)
    got = contiguous_waste(lengths, max_len)
    case = f"{len(lengths)} requests, max_len {max_len}"
    assert math.isclose(got, expected, abs_tol=1e-12), f"{case}: {got} != {expected}"
print("Exercise 3 passed: contiguous_waste matches frozen values and a request-by-request "
      "reference")

# %% [markdown]
# **Exercise 4 — waste with paging.** Write `paged_waste(lengths, block_size)`: the same
# fraction when each request gets the fewest whole blocks of `block_size` slots that hold it.

# %% tags=["exercise"]
def paged_waste(lengths: list[int], block_size: int) -> float:
    """Empty fraction of the slots reserved when each request gets whole blocks."""
    raise NotImplementedError("exercise 03.paged_waste")


# %% tags=["check", "raises-exception"]
import math
import random

# frozen, by hand: blocks of 16 give 1 + 1 + 2 + 7 blocks = 176 slots for 134 tokens
got = paged_waste([1, 16, 17, 100], 16)
assert math.isclose(got, 42 / 176, abs_tol=1e-12), f"got {got}, expected 42 / 176"
assert paged_waste([16, 32, 48], 16) == 0, "lengths that fill whole blocks waste nothing"
assert paged_waste([5, 9, 300], 1) == 0, "blocks of one slot waste nothing"
rng = random.Random(304)
for _ in range(100):
    max_len = rng.choice([512, 2048, 4096])
    block_size = rng.choice([1, 8, 16, 64])
    lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, 50))]
    # reference: hand out blocks to each request until it fits, and count the empty slots
    empty = slots = 0
    for n in lengths:
        reserved = 0
        while reserved < n:
            reserved += block_size
        empty, slots = empty + reserved - n, slots + reserved
    got = paged_waste(lengths, block_size)
    case = f"{len(lengths)} requests, block_size {block_size}"
    assert math.isclose(got, empty / slots, abs_tol=1e-12), f"{case}: {got} != {empty / slots}"
    # paging never wastes more than reserving max_len (a multiple of block_size) for each
    assert got <= 1 - sum(lengths) / (len(lengths) * max_len) + 1e-12, f"{case}: {got}"
print("Exercise 4 passed: paged_waste matches frozen values and a block-by-block reference")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/03.json` *before* measuring; then `make analysis CH=03 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("03")

# %% [markdown]
# ## Summary
#
# - Generation has two phases. **Prefill** runs the prompt through the model in one pass
#   (compute-bound); each **decode** step runs one new token (memory-bound: it reads every
#   weight for two FLOPs per weight).
# - Attention is causal, so a token's keys and values depend only on the tokens before it and
#   never change afterwards. We checked it on SmolLM2: appending a token leaves every earlier
#   key and value of all 30 layers unchanged. The **KV cache** stores them once.
# - Without a cache, producing the next token after $n$ costs $n$ tokens' worth of projections
#   ($O(n_{\text{out}}^2)$ for $n_{\text{out}}$ tokens); with it, one token's worth
#   ($O(n_{\text{out}})$), plus attention over the cache. Measured on SmolLM2, time per token grows
#   with length without a cache and stays flat with one; both produce the same greedy tokens, and
#   so does the engine's paged cache.
# - The price is memory: $2 N_{\text{layers}} H_{kv} d$ elements per token
#   (`ModelConfig.kv_bytes_per_token`), e.g. 128 KiB per token for a Llama-3-8B shape in bf16. For
#   small models the cache, not the weights, fills the GPU. The model runner turns its byte budget
#   into whole blocks of `block_size` tokens and allocates one tensor for all of them.
# - Reserving `max_model_len` contiguous slots per request wastes most of that memory on real
#   request mixes; allocating in 16-token blocks wastes at most 15 tokens per request, a
#   fraction of a percent.
#
# Chapter 04 builds the **block manager** that makes paging work: block tables, the slot
# mapping that tells attention where each token's keys and values go, and prefix caching, which
# lets requests with a common prefix share blocks instead of recomputing them.

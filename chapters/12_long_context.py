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
# # Chapter 12 — Long context and new models
#
# A model is trained on sequences up to some length, its **trained length** (SmolLM2-135M:
# 8,192 tokens). Ask it about a longer document and the rotary position embedding of
# chapter 01 hands it rotation angles it has never seen. This chapter is about the two ways an
# inference engine copes with long inputs, and about the everyday job of supporting one more
# architecture:
#
# 1. **RoPE scaling** changes the rotation frequencies so that a longer sequence maps onto
#    angles the model knows: *linear* interpolation, Llama 3.1's *llama3* rule (chapter 11 §6),
#    *dynamic NTK* and *YaRN*. We build dynamic NTK and YaRN small, check them against the
#    package and against `transformers`, face the clash between dynamic NTK and a KV cache,
#    and measure perplexity by position past SmolLM2's trained length.
# 2. **Sliding-window attention** (Mistral) lets each query see only its last $w$ keys: the
#    cost per token stops growing with the context.
# 3. **Adding a model**, step by step: Qwen2 (a bias on the query/key/value projections) as
#    the worked example; Mistral's window and Phi-3 (fused checkpoint tensors) as your
#    assignments.
#
# Package modules taught here: `nanovllm/layers/rotary.py` (the scalings),
# `nanovllm/models/model_config.py` (reading `rope_scaling` / `rope_parameters` and
# `sliding_window`), `nanovllm/models/qwen2.py`, `nanovllm/models/mistral.py`,
# `nanovllm/models/phi3.py` with the loader's hook for fused tensors
# (`nanovllm/weights/loader.py`), `nanovllm/models/registry.py`, the window in
# `nanovllm/layers/torch_attention.py`, `nanovllm/layers/attention.py` and the Triton kernels
# (`kernels/prefill_attention.py`, `kernels/decode_attention.py`), the freeing of blocks behind the
# window (`nanovllm/engine/sliding_window.py`), and `nanovllm/benchmarks/long_context.py`
# (perplexity by position).
#
# The chapter runs on a 2-core CPU (its time: the book's runtime table): tiny random models for the parity
# checks, and the long-text perplexity from a record made with the package's own command
# (scoring 15,360 tokens takes minutes per variant on such a CPU, seconds on an H200).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(12)

# %% [markdown]
# **Builds on:** position interpolation {cite}`chen2023positional`, NTK-aware scaling
# {cite}`bloc97_2023ntk` and YaRN {cite}`peng2024yarn`. The references are collected in the book's
# bibliography.

# %% [markdown]
# ## Setup

# %%
import inspect
import json
import math
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import transformers
from IPython.display import Markdown, display
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.context import attention_metadata
from nanovllm.layers import rotary
from nanovllm.models import ModelConfig, get_model_class, supported_architectures
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style
from nanovllm.weights.loader import load_safetensors

torch.set_num_threads(1)  # tiny models: OpenMP threads on two shared cores only compete
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()  # save_pretrained's bar would differ by machine
use_book_style()
DATA = figures_dir() / "data"
SMOLLM2 = smollm2_path()
chapter_start = time.perf_counter()


# %% [markdown]
# ## 1. Why: angles never seen in training
#
# RoPE rotates channel pair $i$ of a query or key at position $m$ by the angle
# $m\,\omega_i$, with $\omega_i = \theta^{-2i/d}$ (chapter 01). Pair $i$ completes a
# turn every $\lambda_i = 2\pi/\omega_i$ positions, its **wavelength**. Fast pairs (small
# $i$) turn many times within the trained length $L_{\text{train}}$: every angle they can take was
# seen in training. Slow pairs have wavelengths longer than $L_{\text{train}}$: in training they
# only ever covered part of a turn, and past $L_{\text{train}}$ they reach angles the model never
# saw. How many pairs is that for SmolLM2?

# %%
# NBVAL_CHECK_OUTPUT
cfg = ModelConfig.from_pretrained(SMOLLM2)
L_train, d, base = cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta
omega = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # omega_i, per pair
wavelength = 2 * math.pi / omega
print(f"SmolLM2-135M: trained length {L_train}, head_dim {d}, base {base:g}")
print(f"{int((wavelength > L_train).sum())} of {d // 2} pairs have a wavelength longer than "
      f"{L_train}")
print(f"the slowest pair turns {L_train / wavelength[-1].item():.3f} times within {L_train} "
      "positions")

# %% [markdown]
# So the slowest pairs never complete a turn in training, and the slowest of all covers only
# a fraction of one. All the scalings below slow those pairs down by a factor
# $s$ so that $s\,L_{\text{train}}$ positions fit in the angles seen; they differ in what they do
# to the fast pairs, which carry the fine position information.
#
# ## 2. Four scalings, built small
#
# With factor $s$ and trained length $L_{\text{train}}$:
#
# - **linear** (position interpolation): $\omega_i / s$ for every pair. Simple, but nearby
#   positions become $s$ times harder to tell apart.
# - **llama3**: fast pairs (wavelength $< L_{\text{train}}/4$) kept, slow ones
#   (wavelength $> L_{\text{train}}$) divided by $s$, a smooth blend in between (chapter 11 §6).
# - **dynamic NTK** ("NTK-aware"): keep the formula, raise the base $\theta$. For a sequence
#   of $n > L_{\text{train}}$ tokens,
#   $\theta' = \theta\,\big(s\,n/L_{\text{train}} - (s-1)\big)^{d/(d-2)}$: the slowest pair
#   is slowed by exactly $s\,n/L_{\text{train}} - (s-1)$ while the fastest does not move. It
#   depends on $n$, which is where section 3's trouble comes from.
# - **YaRN** ("NTK-by-parts" plus a temperature): a pair that turns more than
#   $\beta_\text{fast} = 32$ times within $L_{\text{train}}$ keeps $\omega_i$; one that turns fewer
#   than $\beta_\text{slow} = 1$ times gets $\omega_i/s$; a linear ramp over the pair index in
#   between. And cos/sin are multiplied by an **attention factor** $0.1 \ln s + 1$, so every
#   attention logit grows by its square: longer contexts spread the softmax thinner, and the YaRN
#   paper's fit sharpens it back.
#
# Our own versions, written from these definitions:

# %%
def ntk_frequencies(d: int, base: float, s: float, L_train: int, n: int) -> torch.Tensor:
    n = max(n, L_train)  # within the trained length: the plain frequencies
    new_base = base * (s * n / L_train - (s - 1)) ** (d / (d - 2))
    return 1.0 / new_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


def yarn_frequencies(d: int, base: float, s: float, L_train: int, fast: float = 32,
                     slow: float = 1):
    plain = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    turns = L_train * plain / (2 * math.pi)  # full turns of each pair within the trained length
    # the ramp is linear in the pair index: find the (fractional) index of `fast` and `slow`
    index = lambda r: d * math.log(L_train / (r * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(index(fast)), 0), min(math.ceil(index(slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    assert bool(((turns > fast) <= (ramp == 0)).all())  # fast pairs: kept
    return plain * (1 - ramp) + plain / s * ramp, 0.1 * math.log(s) + 1


# %% [markdown]
# The package's versions (`nanovllm/layers/rotary.py`), and the attention factor with its two
# other spellings (an explicit `attention_factor`; DeepSeek's `mscale`/`mscale_all_dim`):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(rotary._dynamic_ntk, rotary._yarn, rotary.rope_attention_factor)

# %% [markdown]
# They must agree with ours, and both with `transformers`' `ROPE_INIT_FUNCTIONS`, on
# SmolLM2's shape with factor 2 (and on a second shape). The package reads the configuration
# exactly as a `config.json` would carry it, through `ModelConfig`:

# %%
# NBVAL_CHECK_OUTPUT
def hf_and_ours(scaling: dict, head_dim: int, rope_base: float, trained: int):
    """transformers' (inv_freq, factor) and the package's, for one config."""
    hf = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=trained, architectures=["LlamaForCausalLM"],
        rope_parameters={**scaling, "rope_theta": rope_base})
    ours = ModelConfig.from_dict(hf.to_dict())
    # dynamic: the frequencies of the engine's maximum length (section 3 says why)
    seq_len = ours.max_position_embeddings if scaling["rope_type"] == "dynamic" else None
    expected = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu", seq_len=seq_len)
    got = (rotary.rope_inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling,
                                           ours.max_position_embeddings),
           rotary.rope_attention_factor(ours.rope_scaling))
    return expected, got, ours


for head_dim, rope_base, trained in ((64, 1e5, 8192), (128, 1e6, 32768)):
    s = 2.0
    (hf_yarn, hf_gain), (pkg_yarn, pkg_gain), _ = hf_and_ours(
        {"rope_type": "yarn", "factor": s}, head_dim, rope_base, trained)
    small_yarn, small_gain = yarn_frequencies(head_dim, rope_base, s, trained)
    (hf_ntk, _), (pkg_ntk, _), ours = hf_and_ours(
        {"rope_type": "dynamic", "factor": s}, head_dim, rope_base, trained)
    small_ntk = ntk_frequencies(head_dim, rope_base, s, trained, ours.max_position_embeddings)
    print(f"head_dim {head_dim}, base {rope_base:g}, trained {trained}, factor {s:g}:")
    print("  YaRN: ours = package = transformers:",
          torch.allclose(small_yarn.float(), pkg_yarn, rtol=1e-6, atol=0)
          and torch.allclose(pkg_yarn, hf_yarn, rtol=1e-6, atol=0),
          f"| attention factor {small_gain:.4f} = {pkg_gain:.4f} = {hf_gain:.4f}")
    print(f"  dynamic NTK at n = {ours.max_position_embeddings}: ours = package = transformers:",
          torch.allclose(small_ntk.float(), pkg_ntk, rtol=1e-6, atol=0)
          and torch.allclose(pkg_ntk, hf_ntk, rtol=1e-6, atol=0))

# %% [markdown]
# `tests/test_rope_scaling.py` checks the same for every type and a few parameter sets
# (`beta_fast`, `mscale`, `truncate`, an explicit `attention_factor`), in both spellings
# of a config: transformers 4's `rope_scaling` + `rope_theta` and 5's `rope_parameters`.
# `ModelConfig` also derives the length the scaled model serves, as vLLM does: trained
# length times $s$ for linear, dynamic and YaRN (a llama3 config already states it). The
# engine then accepts prompts that long.
#
# What each scaling does to SmolLM2's 32 wavelengths (Figure 12.1):

# %%
def wavelengths(scaling: dict | None) -> torch.Tensor:
    freqs = rotary.rope_inverse_frequencies(d, base, scaling, 2 * L_train)
    return 2 * math.pi / freqs.double()


SCALINGS = {
    "no scaling": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic NTK (n = 2L)": {"rope_type": "dynamic", "factor": 2.0,
                             "original_max_position_embeddings": L_train},
    "YaRN": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": L_train},
}
fig, ax = plt.subplots(figsize=(7.5, 4))
styles = ["-", "--", "-.", "-"]
for (name, scaling), color, style in zip(SCALINGS.items(), BOOK_COLORS, styles):
    ax.plot(range(d // 2), wavelengths(scaling), style, color=color, label=name)
ax.axhline(L_train, color="grey", linestyle=":", lw=1)
ax.text(0.5, L_train * 1.3, f"trained length ({L_train:,})", fontsize=8, color="grey")
ax.set(yscale="log", xlabel="channel pair i", ylabel="wavelength 2π/θ_i (positions)",
       title="SmolLM2's RoPE wavelengths under each scaling, factor 2")
ax.legend(loc="upper left")
figure(fig, "12_long_context_wavelengths",
       f"The wavelength of each of SmolLM2's {d // 2} RoPE channel pairs without scaling and under"
       " linear, dynamic NTK and YaRN scaling by a factor of 2, computed by the package's"
       " rope_inverse_frequencies; the dotted line is the trained length. Look at which pairs"
       " each scaling moves: the fast ones (left) or only the slow ones (right).")

# %% [markdown]
# Linear stretches every pair, the fast ones included. Dynamic NTK stretches the slowest
# pair about twice and the fastest not at all, smoothly in between. YaRN keeps the fast
# pairs exactly, halves the slow ones, and ramps over the pairs in between.
#
# ## 3. Dynamic NTK and the KV cache
#
# Dynamic NTK recomputes the frequencies from the current length $n$. `transformers` does
# that on every forward call, from the largest position in the call. A serving engine cannot:
# each key was rotated **once**, when its token was processed, and sits rotated in the paged
# KV cache. If step 1 (prefill, $n_1$ tokens) rotated the keys with $\theta(n_1)$ and a
# later decode step rotates its query with $\theta(n_2)$, the score
# $q_m \cdot k_j$ no longer depends only on $m - j$: the query and the key turn at different
# speeds. Re-rotating the whole cache every step would cost a pass over it per token.
#
# So nanovllm does what vLLM does: **one set of frequencies, those of the maximum length
# the engine serves** ($n = s\,L_{\text{train}}$), for every sequence and every step. Keys and
# queries always agree; the price is that short sequences, too, run with stretched frequencies,
# while `transformers` would use the plain ones up to $L_{\text{train}}$. The difference, measured
# on a tiny random Llama (trained length 32, factor 4, so the engine's length is 128): our logits
# against `transformers`' for prompts of several lengths.

# %%
# NBVAL_CHECK_OUTPUT
def tiny_llama(scaling: dict, path, trained: int = 32):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=trained, rope_parameters={**scaling, "rope_theta": 1e4},
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        initializer_range=0.2)  # larger random weights than usual: logits of order 10
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def ours_from(path):
    model_cfg = ModelConfig.from_pretrained(path)
    model = get_model_class(model_cfg.architecture)(model_cfg)
    load_safetensors(model, path)
    return model.eval()


work = Path(tempfile.mkdtemp(prefix="nanovllm_ch12_"))  # the tiny models' folders
hf_dynamic = tiny_llama({"rope_type": "dynamic", "factor": 4.0}, work / "dynamic")
ours_dynamic = ours_from(work / "dynamic")
ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(0))
print("engine's maximum length:", ours_dynamic.config.max_position_embeddings)
for n in (16, 40, 96, 128):
    with torch.no_grad(), attention_metadata(None):
        ours_logits = ours_dynamic.compute_logits(ours_dynamic(ids[:n], torch.arange(n)))
        hf_logits = hf_dynamic(ids[None, :n]).logits[0]
    gap = (ours_logits - hf_logits).abs().max().item()
    same = (ours_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item()
    print(f"n = {n:3d}: max |logit gap| {'< 1e-4' if gap < 1e-4 else f'{gap:.1f}'}, "
          f"same top-1 token at {same:.0%} of positions")

# %% [markdown]
# Equal at $n = 128$, the engine's length, where both use the same frequencies
# (`tests/test_rope_scaling.py` checks it); different below it. Neither is "right":
# transformers' choice is itself inconsistent once it has a KV cache, since its cached keys
# keep the rotation of the call that computed them. If you want the plain frequencies for
# short inputs, serve the model without scaling (at most $L_{\text{train}}$ tokens); if you want
# long inputs, the fixed stretched frequencies are the consistent choice.
#
# ## 4. Perplexity past the trained length
#
# Does scaling work on a real model? `nanovllm/benchmarks/long_context.py` feeds the first tokens
# (10,240 in the CPU record, 15,360 in the H200 one) of the public-domain text shipped with the
# package (*Alice in Wonderland*, chapters I–V, 15,701 SmolLM2 tokens; `nanovllm/data/README.md`)
# to the engine as **one** prompt, with `prompt_logprobs=0` (chapter 01) and chunked prefill, and
# keeps every token's negative log-likelihood; the perplexity of each run of 512 positions shows
# how well the model predicts at that distance into the text. Four variants of SmolLM2-135M, factor
# 2, that differ only in their `config.json`: no scaling (the RoPE tables simply extended past
# 8,192), linear, dynamic NTK (fixed at $n = 16{,}384$) and YaRN. Scoring that many tokens costs
# minutes per variant on a CPU, so the chapter plots a record made with the package's command
# (seconds on a GPU; the H200 record, `12_long_context_h200.json`, is used when present, else the
# shorter CPU one):

# %%
# NBVAL_CHECK_OUTPUT
records = [DATA / "12_long_context_h200.json", DATA / "12_long_context_cpu.json"]
record = json.loads(next(p for p in records if p.exists()).read_text())
print(f"device: {record['device']}")
print(f"recorded on {record['date']}: {record['command']}")
print(f"{record['tokens']} tokens, bins of {record['bin_size']}, trained length "
      f"{record['trained_length']}")

# %% [markdown]
# First, the record's first bin is recomputed live for two variants (a 512-token forward each,
# a few seconds), so Figure 12.2 below is tied to the package as it is now:

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.benchmarks import long_context

text_ids = long_context.text_ids(SMOLLM2)
head = text_ids[: record["bin_size"] + 1]
for name in ("no scaling", "YaRN"):
    scaling = long_context.variants(L_train)[name]
    folder = long_context.scaled_model_dir(SMOLLM2, scaling, len(head) + 1, work / name)
    nll = long_context.token_nll(folder, head, device="cpu")
    live = long_context.binned_perplexity(nll, record["bin_size"])[0]
    recorded = record["variants"][name]["perplexity_by_bin"][0]
    print(f"{name}: first-bin perplexity live = recorded within 0.5%:",
          abs(live - recorded) <= 0.005 * recorded)

# %%
bins = record["bin_size"]
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for (name, result), color, style in zip(record["variants"].items(), BOOK_COLORS, styles):
    ppl = result["perplexity_by_bin"]
    centers = [bins * (i + 0.5) for i in range(len(ppl))]
    ax.plot(centers, ppl, style, marker="o", ms=3, color=color, label=name)
ax.axvline(record["trained_length"], color="grey", linestyle=":", lw=1)
ax.text(record["trained_length"] * 1.01, ax.get_ylim()[1] * 0.8, "trained length",
        fontsize=8, color="grey")
ax.set(yscale="log", xlabel="position in the text (tokens)",
       ylabel=f"perplexity of each {bins}-token bin",
       title="SmolLM2-135M on Alice I–V: perplexity by position (recorded)")
ax.legend(loc="upper left")
figure(fig, "12_long_context_perplexity",
       f"Recorded perplexity of SmolLM2-135M by position in one long text, in bins of {bins}"
       f" tokens, without RoPE scaling and under each scaling (factor 2), on {record['device']};"
       f" the dotted line is the trained length, {record['trained_length']:,} tokens. Compare the"
       " curves inside the trained length and past it.")

# %%
# NBVAL_CHECK_OUTPUT
trained_bins = record["trained_length"] // bins
print(f"{'variant':<12} {'< L_train/2':>12} {'L_train/2..':>12} {'past L_train':>12}")
summary = {}
for name, result in record["variants"].items():
    ppl = result["perplexity_by_bin"]
    parts = (ppl[: trained_bins // 2], ppl[trained_bins // 2 : trained_bins], ppl[trained_bins:])
    summary[name] = [math.exp(sum(map(math.log, p)) / len(p)) for p in parts]
    print(f"{name:<12} " + " ".join(f"{v:12.1f}" for v in summary[name]))

# %% [markdown]
# The table gives the geometric mean of the bins' perplexities in three ranges: the first half
# of the trained length, its second half, and past it. Relative to no scaling:

# %%
# NBVAL_CHECK_OUTPUT
plain = summary["no scaling"]
for name, values in summary.items():
    if name != "no scaling":
        print(f"{name:<12} " + " ".join(f"{v / p - 1:+12.1%}" for v, p in zip(values, plain)))
past = record["tokens"] / record["trained_length"]
print(f"no scaling past L_train vs before it: {plain[2] / plain[1] - 1:+.1%} "
      f"(the record reaches {past:.2f} L_train)")

# %% [markdown]
# What this record says, and what it does not:
#
# - Inside the trained length, where the model was trained with the plain frequencies, what a
#   scaling costs depends on the range (the middle table): YaRN, which keeps the fast pairs,
#   stays closest to plain RoPE; linear, which also slows them, moves furthest from it, and
#   not always for the worse: in this record it does better than plain RoPE in part of the
#   trained range. Read the table, not a rule.
# - Past $L_{\text{train}}$, plain RoPE breaks down: read the last line above, the perplexity of
#   the unscaled model past $L_{\text{train}}$ against the second half of the trained range (a
#   passage every variant finds easy). Dynamic NTK and YaRN keep it far lower past
#   $L_{\text{train}}$ (the middle table's last column), for the small cost inside; linear, in this
#   record, pays the most inside and gains nothing past $L_{\text{train}}$.
# - So the advice this book set out to check (dynamic NTK "beyond 50% of the training
#   length", one of the claims chapter 13 §9 lists) does not hold for SmolLM2 as stated: in
#   the first half of $L_{\text{train}}$ every scaling costs perplexity, in the second half the
#   cost depends on the scaling (linear even gains there); scaling pays **past**
#   $L_{\text{train}}$, and there YaRN and dynamic NTK pay well. One model, one text and factor 2:
#   a claim about this record, not a law.
# - In an engine the frequencies are fixed per deployment (section 3): scale when requests
#   are longer than $L_{\text{train}}$, and accept the in-range cost on the shorter ones. A
#   long-context fine-tune after scaling (as in YaRN's paper) would close most of that gap.
#
# ## 5. Sliding-window attention
#
# Mistral 7B (v0.1) lets query position $p$ attend to keys $p - w < j \le p$ only, with
# $w = 4{,}096$: the **sliding window**. Each layer still sees only $w$ tokens back, but
# information travels $w$ further per layer, so 32 layers reach about 131k tokens back.
# What it buys an engine: attention per token costs $O(w)$, not $O(n)$, and keys older than
# $w$ are never read again, so their blocks can be freed (end of this section).
#
# The mask, drawn for 12 positions, window 4 in Figure 12.3 (`sliding_window_mask`, your
# assignment below):

# %%
from nanovllm.layers import torch_attention

fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.6))
for ax, (title, mask) in zip(axes, (
        ("causal", torch.ones(12, 12).tril().bool()),
        ("causal, window 4", torch_attention.sliding_window_mask(12, 12, 4)))):
    ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.4)
    ax.set(title=title, xlabel="key position j", ylabel="query position p")
figure(fig, "12_long_context_window_mask",
       "Which keys j each query p may attend to (blue) for 12 positions: the causal mask, and the"
       " causal mask with a sliding window of 4 (the package's sliding_window_mask).")

# %% [markdown]
# In the package the window is one optional argument that travels from the model's config
# to the attention layer and into each backend:
#
# - `ModelConfig.sliding_window` comes from `config.json` (`null` in Mistral v0.2 and later;
#   Qwen2 configs carry a window they switch off with `use_sliding_window: false`, which is
#   honoured; Qwen2's per-layer windows, when switched on, are refused with a clear error);
# - `Attention(..., sliding_window=W)` calls its backend's `attend(..., window=W)`; layers
#   without a window call it exactly as before;
# - the torch backend runs `windowed_paged_attention`: each sequence gathers only the last
#   $w + q - 1$ keys that some query of the step can see;
# - the Triton prefill kernel takes a compile-time `HAS_WINDOW` switch: its key loop starts at
#   the first tile inside the window and applies both masks; the decode kernel starts each
#   sequence's key range at $n - w$ and divides that among its splits. With the switch off the
#   compiled kernels are the ones of chapters 02 and 05.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(torch_attention.windowed_attention, torch_attention.windowed_paged_attention)

# %% [markdown]
# A tiny random Mistral with window 12, against `transformers`, with prompts up to 60 tokens
# (five windows), with whole-prompt prefill and with chunks of 16 tokens (a chunk then sees
# part of the window in the cache and part in itself):

# %%
# NBVAL_CHECK_OUTPUT
def tiny_hf(arch: str, path, **extra):
    config_cls = {"MistralForCausalLM": transformers.MistralConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "Phi3ForCausalLM": transformers.Phi3Config}[arch]
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                        pad_token_id=None, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # random biases, so a missing one cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


gen = torch.Generator().manual_seed(2)
prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 33, 60)]
greedy = SamplingParams(temperature=0, max_tokens=10)
hf_mistral = tiny_hf("MistralForCausalLM", work / "mistral", sliding_window=12)
expected = [hf_greedy(hf_mistral, p, 10) for p in prompts]
print("window read from config.json:", ModelConfig.from_pretrained(work / "mistral").sliding_window)
for chunk in (64, 16):
    llm = LLM(work / "mistral", block_size=16, max_num_batched_tokens=chunk, dtype="float32",
              num_kv_blocks=64)
    got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print(f"max_num_batched_tokens {chunk}: greedy tokens equal transformers':", got == expected)

# %% [markdown]
# `tests/test_models_new.py` adds preemption (a KV budget too small for the batch) with and
# without prefix caching; `tests/kernels/test_window_kernels.py` checks both Triton kernels
# with windows of 1, 7, 33 and 200 keys against a float64 reference (under the interpreter on
# a CPU, natively on a GPU) and the engine's triton backend against its torch backend.
#
# ### Freeing the blocks behind the window
#
# A query at position $p$ never reads a key below $p - w + 1$, and later queries sit further
# right. So once a sequence's next query is at $c$ (its computed tokens: the next prompt
# chunk's first token, or the next decode), its first $\lfloor (c - w + 1)/b \rfloor$ blocks
# are dead weight. Exercise 3 keeps the last $w$ cached keys, one more than needed: the next
# query's own key is not in the cache yet, so only $w - 1$ cached keys are still visible.
# `SlidingWindowBlockManager` (`nanovllm/engine/sliding_window.py`) gives them back at the
# start of every `schedule()`, before allocating, so they serve the step being scheduled:
#
# - a released slot keeps its place in the block table (kernels read token $t$ at
#   `block_table[t // B]`) and holds the **null block**, block 0, reserved at start-up and
#   never written: the torch backend gathers its zeros and slices them off, the Triton decode
#   kernel never loads it, and a prefill tile that starts before the window loads it masked
#   (weights exactly 0, times finite zeros: nothing leaks, where stale data could hold a NaN);
# - a released block keeps its prefix-cache hash: its keys are still right for its prefix, so
#   it waits in the free list like any freed cached block and a later request can adopt it;
# - the engine's admission, preemption and KV-usage metric count released blocks as free.
#
# Only models with a window on *every* layer free blocks; configs that window some layers are
# refused (see above). The module's docstring argues why releasing at schedule time is safe
# under async scheduling, where the previous step may still be running.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine import sliding_window

show_source(sliding_window.num_blocks_outside_window,
            sliding_window.SlidingWindowBlockManager.release_outside_window)

# %% [markdown]
# On the live engine: one 200-token prompt in chunks of 32, then 40 decodes, with the window
# manager, and with chapter 04's manager put in its place (it frees nothing before the end).
# After each step we count the blocks the sequence holds (null slots excluded):

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.engine.block_manager import BlockManager


def blocks_held_per_step(free_window: bool, prompt: list[int], n: int) -> tuple:
    # float32 with a fixed cache and async scheduling off: the same steps on every device
    llm = LLM(work / "mistral", block_size=16, max_num_batched_tokens=32, dtype="float32",
              num_kv_blocks=64, async_scheduling=False)
    engine = llm.engine
    if not free_window:  # chapter 04's manager, same size: frees a sequence when it ends
        bm = engine.block_manager
        engine.block_manager = engine.scheduler.block_manager = BlockManager(
            len(bm.blocks), bm.block_size, bm.enable_prefix_caching)
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=n))
    seq, null = engine.requests["long"], engine.block_manager.null_block
    tokens, held, out = [], [], []
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
        if seq.block_table:  # the last step frees everything as the request ends
            tokens.append(seq.num_computed_tokens)
            held.append(sum(1 for b in seq.block_table if b != null))
    return tokens, held, out


long_prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
runs = {free: blocks_held_per_step(free, long_prompt, 40) for free in (True, False)}
print("same tokens with and without freeing, equal to transformers':",
      runs[True][2] == runs[False][2] == hf_greedy(hf_mistral, long_prompt, 40))
print(f"{'tokens computed':>16} {'blocks held: window manager':>28} {'chapter 04 manager':>19}")
for i, tokens in enumerate(runs[True][0]):
    if tokens <= 200 or tokens % 10 == 0:  # every prefill chunk, then every 10th decode
        print(f"{tokens:>16} {runs[True][1][i]:>28} {runs[False][1][i]:>19}")
print("peak:", max(runs[True][1]), "vs", max(runs[False][1]), "blocks; ceil(w / b) + 1 =",
      math.ceil(12 / 16) + 1)

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for free, label, color in ((False, "chapter 04 manager", BOOK_COLORS[1]),
                           (True, "window manager (w = 12)", BOOK_COLORS[0])):
    ax.step(runs[free][0], runs[free][1], where="post", label=label, color=color)
ax.set(xlabel="tokens computed", ylabel="KV blocks held (b = 16)",
       title="One Mistral sequence: blocks held after each step")
ax.legend()
figure(fig, "12_long_context_window_freeing",
       "The KV blocks (16 tokens each) one sequence of the tiny Mistral model (window 12) holds"
       f" after each engine step, a {len(long_prompt)}-token prompt then 40 decode steps, with the"
       " chapter 04 block manager and with the window manager, which frees blocks that slide out"
       " of the window.")

# %% [markdown]
# In Figure 12.4, during the prefill a step holds the window plus its 32-token chunk (the peak
# above); once decoding, at most $\lceil w/b \rceil + 1$ blocks: the window and the block the next
# token goes to (one block when both fit in it, as $w < b$ allows here). The plain manager grows one
# block per 16 tokens. What that buys is concurrency: the same KV budget fits many more long Mistral
# sequences at once. `tests/test_sliding_window_engine.py` runs six at once where the plain manager
# decodes fewer, with preemptions; it also checks chunked prefill, preemption, prefix caching and
# async scheduling against `transformers`, and fills every released block with NaN, on the torch and
# the Triton backend: no token changes, while one block released too early changes them.
#
# ## 6. How to add a model: Qwen2, step by step
#
# Our models are variations of one decoder (`nanovllm/models/llama.py`). To add an
# architecture, find what differs from it, and carry only that. For Qwen2 and Qwen2.5:
#
# **Step 1 — the config.** Read the `config.json` of a real checkpoint and transformers'
# configuration class, and list the fields our `ModelConfig` does not read or reads
# differently. Qwen2 has no `attention_bias` field, though its q/k/v projections carry a bias
# (o_proj does not): the bias belongs to the architecture, not to the config. It also ships
# a `sliding_window` with `use_sliding_window: false`.

# %%
# NBVAL_CHECK_OUTPUT
qwen2_config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2)  # small: only names matter
print("attention_bias in Qwen2's config:", hasattr(qwen2_config, "attention_bias"))
print("use_sliding_window:", qwen2_config.use_sliding_window)
print("q/k/v/o biases in transformers' Qwen2 attention:", [
    getattr(transformers.models.qwen2.modeling_qwen2.Qwen2Attention(qwen2_config, 0),
            name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")])

# %% [markdown]
# **Step 2 — the layers.** Find where the difference lives in our decoder. The QKV projection
# is one packed `QKVParallelLinear` whose bias is `ModelConfig.qkv_bias` (by default the
# config's `attention_bias`, which also sets o_proj's bias, as in Llama). Qwen2 needs the
# first without the second, so its class sets `qkv_bias=True` and inherits everything else:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.models import mistral, qwen2

show_source(qwen2)

# %% [markdown]
# **Step 3 — the weight names.** The loader maps each checkpoint tensor onto our parameters;
# `packed_modules_mapping` says which checkpoint names are parts of a packed parameter (q, k and
# v of `qkv_proj`; gate and up of `gate_up_proj`). Compare the names a Qwen2 checkpoint holds
# with ours:

# %%
# NBVAL_CHECK_OUTPUT
hf_qwen2 = tiny_hf("Qwen2ForCausalLM", work / "qwen2", tie_word_embeddings=True)
qwen2_cfg = ModelConfig.from_pretrained(work / "qwen2")
ours_qwen2 = get_model_class(qwen2_cfg.architecture)(qwen2_cfg)
mapping = ours_qwen2.packed_modules_mapping


def our_name(checkpoint_name: str) -> str:
    for fragment, (packed, _) in mapping.items():
        if f".{fragment}." in checkpoint_name:
            return checkpoint_name.replace(fragment, packed)
    return checkpoint_name


ours_names = set(dict(ours_qwen2.named_parameters()))
theirs = [n for n in hf_qwen2.state_dict() if n != "lm_head.weight"]  # tied to the embedding
print("checkpoint tensors of layer 0:", [n for n in theirs if ".layers.0.self_attn" in n])
print("every checkpoint tensor has a home:", all(our_name(n) in ours_names for n in theirs))
print("every parameter of ours is fed:", ours_names <= {our_name(n) for n in theirs})

# %% [markdown]
# Nothing new is needed: `q_proj.bias` goes to the q part of `qkv_proj.bias` as `q_proj.weight`
# goes to the q part of the weight. (An architecture with other names, say `attn.c_attn`,
# would add entries to its class's `packed_modules_mapping`, or a small renaming.)
#
# **Step 4 — the registry.** `nanovllm/models/registry.py` maps the `architectures[0]` of a
# `config.json` to our class; `LLM(path)` looks it up there:

# %%
# NBVAL_CHECK_OUTPUT
print(supported_architectures())

# %% [markdown]
# **Step 5 — the parity test.** A tiny random model of the architecture, built and saved by
# `transformers`, loaded by us: logits equal within fp32 noise and greedy tokens equal through
# the engine. Random biases and norms make a forgotten parameter visible.

# %%
# NBVAL_CHECK_OUTPUT
load_safetensors(ours_qwen2, work / "qwen2")
ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(1))


def check_parity(label: str, ours, hf_model, folder) -> None:
    """The parity test of a new architecture: logits of one forward, then the engine's tokens."""
    with torch.no_grad(), attention_metadata(None):
        gap = (ours.compute_logits(ours(ids, torch.arange(len(ids))))
               - hf_model(ids[None]).logits[0]).abs().max().item()
    print(f"{label} logits within 1e-4 of transformers':", gap < 1e-4)
    llm = LLM(folder, block_size=16, dtype="float32", num_kv_blocks=64)
    got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print(f"{label} greedy tokens equal transformers':",
          got == [hf_greedy(hf_model, p, 10) for p in prompts])


check_parity("Qwen2", ours_qwen2, hf_qwen2, work / "qwen2")

# %% [markdown]
# Mistral takes the same five steps: the config's `sliding_window` (step 1), the window in the
# attention backends (step 2, section 5), Llama's weight names (step 3), one registry line
# (step 4), and `tests/test_models_new.py` (step 5). Its class is empty:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(mistral)

# %% [markdown]
# ### Your turn: Phi-3
#
# Phi-3 (`Phi3ForCausalLM`: Phi-3-mini and -medium) is Llama's decoder once more — RMSNorm,
# RoPE, grouped-query attention, SwiGLU — so steps 1, 2 and 4 are short: `ModelConfig` reads
# its `config.json` as it is (and refuses what we do not support: its `longrope` scaling of
# the 128k models, and a `partial_rotary_factor` below 1); its `sliding_window`, when set,
# means what Mistral's does in transformers' Phi-3. What differs is step 3: its checkpoints
# store the projections **fused**, one `qkv_proj` tensor (the rows of q, then k, then v) and
# one `gate_up_proj` (gate, then up):

# %%
# NBVAL_CHECK_OUTPUT
hf_phi3 = tiny_hf("Phi3ForCausalLM", work / "phi3")
print({name: tuple(t.shape) for name, t in hf_phi3.state_dict().items()
       if ".layers.0." in name and "proj" in name})

# %% [markdown]
# Our `qkv_proj` packs the same rows, and on one rank a plain copy of the fused tensor would
# fill it. On several ranks it would not: each rank of `QKVParallelLinear` (chapter 09) holds
# *its* heads of q, of k and of v, so its rows are three slices taken from three places of
# the fused tensor, not one block of it. For the tiny model above at two ranks:

# %%
# NBVAL_CHECK_OUTPUT
phi3_cfg = ModelConfig.from_pretrained(work / "phi3")
q_rows, kv_rows = (phi3_cfg.num_heads * phi3_cfg.head_dim,
                   phi3_cfg.num_kv_heads * phi3_cfg.head_dim)
for rank in range(2):
    starts = (0, q_rows, q_rows + kv_rows)
    sizes = (q_rows // 2, kv_rows // 2, kv_rows // 2)
    needed = [f"{s + rank * n}:{s + (rank + 1) * n}" for s, n in zip(starts, sizes)]
    block = (q_rows + 2 * kv_rows) // 2
    print(f"rank {rank} needs fused rows {needed}; its block of the fused tensor would be "
          f"{rank * block}:{(rank + 1) * block}")

# %% [markdown]
# So the loader must see q, k and v apart, each with its shard id, as it does for a Llama
# checkpoint. A model class may define `split_fused_tensor(name, tensor)`; the loader calls
# it on every checkpoint tensor and loads the pieces it returns under Llama's names
# (`q_proj`, `k_proj`, ...), through `packed_modules_mapping` and each parameter's
# `weight_loader`, which takes the rank's slice:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.weights import loader

show_source(loader._load_tensor)

# %% [markdown]
# `Phi3ForCausalLM.split_fused_tensor` (`nanovllm/models/phi3.py`) is your assignment: split by
# the whole model's sizes from `ModelConfig`, not by one rank's parameter shapes. With the
# package's solution, step 5 — the parity test:

# %%
# NBVAL_CHECK_OUTPUT
ours_phi3 = get_model_class(phi3_cfg.architecture)(phi3_cfg)
load_safetensors(ours_phi3, work / "phi3")
check_parity("Phi-3", ours_phi3, hf_phi3, work / "phi3")

# %% [markdown]
# One rank cannot tell a split from a copy. `tests/test_phi3.py` also loads the checkpoint
# at two simulated ranks and checks each rank's q, k, v, gate and up rows, and runs an engine
# at `tensor_parallel_size=2` (two CPU processes, gloo) against `transformers`' tokens.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"chapter run time so far: {time.perf_counter() - chapter_start:.0f} s")

# %% [markdown]
# ## Assignments
#
# In the course edition (`make student`; see the README's *Start here*) you write two pieces:
#
# - Mistral's window mask, `sliding_window_mask` in `nanovllm/layers/torch_attention.py`
#   (section 5): the torch backend's windowed attention is built on it, so the Mistral parity
#   tests against `transformers` (whole prompts, chunked prefill, preemption) and a unit test
#   grade it.
# - Phi-3, by writing `Phi3ForCausalLM.split_fused_tensor` in `nanovllm/models/phi3.py`
#   (section 6, "Your turn"): graded by Phi-3 parity with `transformers` at one rank and at
#   two (simulated ranks and a gloo engine, where a copy of the fused tensor fails), and by a
#   unit test on hand-made tensors.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("12"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — YaRN's frequencies.** Write `yarn_inv_freq(d, base, factor, trained,
# beta_fast=32, beta_slow=1)`: YaRN's $d/2$ inverse frequencies as float64 (section 2): the
# pair index where a pair turns `beta_fast` times within `trained` positions (rounded down)
# and where it turns `beta_slow` times (rounded up), clamped to $[0, d-1]$; a linear ramp
# between them from 0 to 1; $\omega_i$ kept where the ramp is 0, $\omega_i/s$ where it is 1,
# blended in between. The check compares with `transformers`.

# %% tags=["exercise"]
import math

import torch


def yarn_inv_freq(d: int, base: float, factor: float, trained: int, beta_fast: float = 32,
                  beta_slow: float = 1) -> torch.Tensor:
    """YaRN's inverse frequencies, float64 [d // 2]."""
    raise NotImplementedError("exercise 12.yarn_inv_freq")


# %% tags=["check", "raises-exception"]
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

for d, base, factor, trained, fast, slow in [(64, 1e5, 2.0, 8192, 32, 1),
                                             (128, 1e6, 4.0, 32768, 32, 1),
                                             (32, 1e4, 8.0, 64, 16, 2)]:
    config = transformers.LlamaConfig(
        hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=trained,
        rope_parameters={"rope_type": "yarn", "factor": factor, "rope_theta": base,
                         "beta_fast": fast, "beta_slow": slow})
    expected, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got = yarn_inv_freq(d, base, factor, trained, fast, slow)
    assert got.dtype == torch.float64 and got.shape == (d // 2,), (got.dtype, got.shape)
    assert torch.allclose(got.float(), expected, rtol=1e-5, atol=0), (d, base, factor)
print("Exercise 1 passed: yarn_inv_freq equals transformers' YaRN frequencies")

# %% [markdown]
# **Exercise 2 — the NTK base.** Write `ntk_base(base, d, factor, trained, n)`: dynamic NTK's
# base for a sequence of `n` tokens (section 2), `base` itself for `n <= trained`. The check
# compares the frequencies it implies with `transformers`' at several lengths, and tests the
# property that makes it "NTK-aware": the fastest pair keeps its frequency, the slowest is
# slowed by exactly `factor * n / trained - (factor - 1)` (work out why from the exponent).

# %% tags=["exercise"]
def ntk_base(base: float, d: int, factor: float, trained: int, n: int) -> float:
    """Dynamic NTK's RoPE base for a sequence of n tokens."""
    raise NotImplementedError("exercise 12.ntk_base")


# %% tags=["check", "raises-exception"]
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

d, base, factor, trained = 64, 1e5, 2.0, 8192
config = transformers.LlamaConfig(
    hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=trained,
    rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": base})
for n in (100, 8192, 9000, 16384, 50000):
    new_base = ntk_base(base, d, factor, trained, n)
    freqs = 1.0 / new_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=n)
    assert torch.allclose(freqs.float(), expected, rtol=1e-5, atol=0), n
    plain = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert freqs[0] == plain[0]
    slowdown = (plain[-1] / freqs[-1]).item()
    assert abs(slowdown - (factor * max(n, trained) / trained - (factor - 1))) < 1e-9, n
print("Exercise 2 passed: ntk_base gives transformers' dynamic NTK frequencies")

# %% [markdown]
# **Exercise 3 — blocks behind the window.** A sequence holds `n` cached keys in blocks of
# `block_size` (block $i$ holds keys $ib .. ib + b - 1$); with a window of `window`, only its
# last `window` keys will ever be read again. Write `blocks_outside_window(n, window,
# block_size)`: how many leading blocks hold **only** keys that are no longer needed (so
# could be freed). The check compares with a key-by-key count.

# %% tags=["exercise"]
def blocks_outside_window(n: int, window: int, block_size: int) -> int:
    """Leading blocks of a sequence whose every key lies before its last `window` keys."""
    raise NotImplementedError("exercise 12.blocks_outside_window")


# %% tags=["check", "raises-exception"]
def by_counting(n, window, block_size):
    needed = set(range(max(0, n - window), n))
    count = 0
    for block in range(-(-n // block_size)):
        keys = range(block * block_size, min((block + 1) * block_size, n))
        if any(k in needed for k in keys):
            break
        count += 1
    return count


for n in range(0, 70):
    for window in (1, 5, 16, 40, 100):
        for block_size in (1, 4, 16):
            got = blocks_outside_window(n, window, block_size)
            assert got == by_counting(n, window, block_size), (n, window, block_size, got)
print("Exercise 3 passed: blocks_outside_window counts the freeable blocks")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/12.json` *before* measuring; then `make analysis CH=12 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("12")

# %% [markdown]
# ## Summary
#
# - Past its trained length $L_{\text{train}}$ a RoPE model meets rotation angles it never saw, on
#   its slow channel pairs, those whose wavelength exceeds $L_{\text{train}}$ (section 1 counts
#   them for SmolLM2).
# - **Scalings** slow those pairs by a factor $s$: linear (all pairs), llama3 and YaRN (slow
#   pairs only, a blend between), dynamic NTK (a larger base, growing with the length). YaRN
#   also multiplies cos/sin by $0.1\ln s + 1$; nanovllm folds that factor into its cos/sin
#   tables, so the fused Triton RoPE kernel applies it too. All four equal `transformers`'
#   `ROPE_INIT_FUNCTIONS`, read from `rope_scaling` or `rope_parameters`.
# - **Dynamic NTK in an engine**: cached keys keep the rotation they were stored with, so
#   frequencies that change with the length break the distance-only property of RoPE.
#   nanovllm, like vLLM, uses the frequencies of the maximum served length ($s\,L_{\text{train}}$)
#   for every sequence: consistent, equal to `transformers` at that length, different below it.
# - **Perplexity by position** (section 4, the record's tables) measures what scaling costs
#   inside the trained length and what it buys past it, on the shipped text. In the H200
#   record (to $1.88\,L_{\text{train}}$) no scaling beat plain RoPE in both halves of
#   $L_{\text{train}}$ (the middle table; linear won in the second half only), and SmolLM2 without
#   scaling broke down past it, where YaRN and dynamic NTK kept the perplexity far lower and linear
#   did not help.
# - **Sliding windows** (Mistral) bound the keys each query reads; the window is an optional
#   argument of the attention layer, the torch backend and both Triton kernels (compiled
#   unchanged without it). The blocks the window has passed go back to the pool each step
#   (their slots hold a never-written null block), so a long sequence holds about
#   $\lceil w/b \rceil + 1$ blocks, not $\lceil n/b \rceil$.
# - **Adding a model** is five steps: the config's differences, the layer that carries them,
#   the weight names, a registry entry, and a parity test against `transformers` on a tiny
#   random model. Qwen2 took one class attribute; Mistral's class is empty; Phi-3's splits
#   its fused checkpoint tensors, so that each tensor-parallel rank gets its own q, k and v.

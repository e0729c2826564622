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
# # Chapter 16 — Mixture of experts
#
# The open models people serve today are mostly **mixtures of experts** (MoE): Qwen3-30B-A3B,
# Qwen3-235B-A22B {cite}`qwen2025qwen3`, Mixtral {cite}`jiang2024mixtral`, DeepSeek, gpt-oss;
# the Switch Transformer {cite}`fedus2022switch` had shown that routing each token to a single
# expert trains stably at a trillion parameters. In each layer the dense MLP is replaced by
# $E$ smaller MLPs, the *experts*, and a *router* that sends every token to only $k$ of them.
# The model holds the parameters of all $E$ experts but computes with $k$: Qwen3-30B-A3B has
# 30B parameters and spends the FLOPs of about 3B per token.
#
# That changes what an engine must do well. This chapter:
#
# 1. counts parameters against FLOPs per token (why experts);
# 2. builds the router small (softmax, top-$k$, renormalization);
# 3. runs the experts one at a time, the naive way, and checks Qwen3-MoE and Mixtral against
#    `transformers`;
# 4. measures why that is slow: launches, tiny GEMMs, and the uneven load per expert;
# 5. builds the fix small in PyTorch: sort the token->expert assignments, pad each expert's
#    group to whole blocks (`moe_align_block_size`), and run one **grouped GEMM** over blocks;
# 6. shows the package's Triton kernel (vLLM's design) and measures it on the H200, where it
#    is slower than torch's own grouped GEMM at every batch size measured (section 6 prints
#    the ratio per size from the record);
# 7. works out memory: total against active parameters, and what is left for the KV cache;
# 8. splits the experts for tensor parallelism.
#
# Package modules taught here: `nanovllm/layers/router.py`, `nanovllm/kernels/moe_align.py`,
# `nanovllm/layers/fused_moe.py` (stacked expert weights and the per-expert reference),
# `nanovllm/kernels/fused_moe.py` (the Triton kernel), `nanovllm/models/moe.py`,
# `nanovllm/models/qwen3_moe.py`, `nanovllm/models/mixtral.py`,
# `nanovllm/models/moe_config.py` and `nanovllm/benchmarks/moe.py`.
#
# The chapter runs on a 2-core CPU (its time: the book's runtime table): tiny random models, the Triton
# kernel under its interpreter, and the H200 measurement of one layer from a record made with
# the package's own command (`tests/gpu/moe_h200.sh`).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(16)

# %% [markdown]
# ## Setup

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import json
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import transformers

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks import moe as moe_bench
from nanovllm.configs import config_path
from nanovllm.context import attention_metadata
from nanovllm.kernels import moe_align
from nanovllm.kernels.fused_moe import fused_moe
from nanovllm.layers import fused_moe as fused_moe_layer
from nanovllm.layers import router
from nanovllm.layers.fused_moe import moe_reference
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style
from nanovllm.weights.loader import load_safetensors

torch.set_num_threads(1)  # tiny models: OpenMP threads on two shared cores only compete
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
use_book_style()
DATA = figures_dir() / "data"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
chapter_start = time.perf_counter()


def record(name: str) -> dict | None:
    """A recorded measurement from figures/data, or None where it has not been made yet."""
    path = DATA / name
    return json.loads(path.read_text()) if path.exists() else None


# %% [markdown]
# ## 1. Why experts: parameters against FLOPs per token
#
# A decoder layer's MLP is SwiGLU: `down(silu(gate(x)) * up(x))`, $3 D D_{\text{ff}}$ weights
# for hidden size $D$ and width $D_{\text{ff}}$, and $2 \cdot 3 D D_{\text{ff}}$ FLOPs per
# token. A MoE layer holds $E$ such MLPs, each of a smaller width $D_e$, and a router
# ($E \times D$), and runs $k$ of them per token:
#
# $$N_{\text{params}} \propto E \cdot 3 D D_e, \qquad
#   \text{FLOPs per token} \approx 2 \cdot k \cdot 3 D D_e .$$
#
# The parameters (what the model *knows*) grow with $E$, the cost per token with $k$. The
# shipped configs (`nanovllm/configs/`) give the numbers for Qwen3-30B-A3B beside dense Qwen3
# models; "active" counts what one token computes with (its $k$ experts, attention, router,
# and the LM head).

# %%
# NBVAL_CHECK_OUTPUT
def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of a Llama-style config, dense or MoE."""
    h = cfg.hidden_size
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * \
        cfg.head_dim * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    head = cfg.vocab_size * h  # the LM head: every token's logits read all of it
    if cfg.moe is None:
        mlp = 3 * h * cfg.intermediate_size
        total = cfg.num_layers * (attention + mlp) + embeddings
        return total, cfg.num_layers * (attention + mlp) + head
    m = cfg.moe
    expert = 3 * h * m.intermediate_size
    per_layer = [attention + h * m.num_experts + (m.num_experts * expert if sparse else
                 3 * h * cfg.intermediate_size) for sparse in m.sparse_layers]
    active = [attention + h * m.num_experts + (m.top_k * expert if sparse else
              3 * h * cfg.intermediate_size) for sparse in m.sparse_layers]
    return sum(per_layer) + embeddings, sum(active) + head


shapes = {name: ModelConfig.from_pretrained(config_path(name))
          for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen3-moe-small", "qwen3-30b-a3b")}
print(f"{'shape':16s} {'experts':>9s} {'total':>8s} {'active':>8s}  GFLOP/token")
for name, cfg in shapes.items():
    total, active = parameter_counts(cfg)
    experts = f"{cfg.moe.top_k}/{cfg.moe.num_experts}" if cfg.moe else "-"
    print(f"{name:16s} {experts:>9s} {total / 1e9:7.2f}B {active / 1e9:7.2f}B  "
          f"{2 * active / 1e9:6.1f}")

# %% [markdown]
# Qwen3-30B-A3B holds about as many parameters as Qwen3-32B but computes per token like a
# model a tenth that size. The catch for inference: all 30B must sit in GPU memory (section
# 7), and a step's batch touches many experts, so reading weights, not computing, bounds a
# decode step (section 6).

# %% [markdown]
# ## 2. The router, built small
#
# The router is one linear layer, `gate`: a score per expert for each token,
# `logits = x @ gate.T`, $[n, E]$ for $n$ tokens. Qwen3-MoE and Mixtral both turn the scores into
# probabilities with a softmax over the $E$ experts, keep each token's $k$ largest, and weigh
# each chosen expert's output by its probability. Mixtral, and Qwen3-MoE where its config sets
# `norm_topk_prob`, **renormalize** the $k$ kept probabilities to sum to 1; without it a token's
# weights sum to less than 1 (the mass of the experts it skipped is lost). The order matters
# for parity: the softmax first (in float32), then the top-$k$, as `transformers` does it.

# %%
import math


def route_token(scores: list[float], k: int, renormalize: bool) -> list[tuple[int, float]]:
    """One token's routing in plain Python: its k experts and their weights, heaviest first."""
    # softmax over the E experts; subtracting the largest score keeps exp() from overflowing
    largest = max(scores)
    exps = [math.exp(s - largest) for s in scores]
    total = sum(exps)
    probability = [x / total for x in exps]
    # rank the (probability, expert) pairs: the most probable first and, on an exact tie,
    # the lower expert number first
    ranked = sorted(((p, e) for e, p in enumerate(probability)), key=lambda pe: (-pe[0], pe[1]))
    chosen = [(e, p) for p, e in ranked[:k]]
    if renormalize:  # Mixtral, Qwen3-MoE with norm_topk_prob: the k kept shares sum to 1
        kept = sum(p for _, p in chosen)
        chosen = [(e, p / kept) for e, p in chosen]
    return chosen


# %% [markdown]
# One token, four experts, $k = 2$: the softmax gives experts 0 and 1 most of the mass, and
# without renormalization their two weights keep only the share they had (the rest belonged to
# experts 2 and 3, which do not run).

# %%
# NBVAL_CHECK_OUTPUT
scores = [2.0, 1.0, 0.5, -1.0]
for renormalize in (False, True):
    chosen = route_token(scores, 2, renormalize)
    print(f"renormalize={renormalize!s:5s}: experts {[e for e, _ in chosen]}, weights "
          f"{[round(w, 4) for _, w in chosen]}, sum {round(sum(w for _, w in chosen), 4)}")

# %% [markdown]
# `route_token` is the *meaning* of routing, and deliberately not how an engine computes it: a
# Python loop over one token's $E$ scores, in float64, and a sort of $E$ pairs, token after
# token. The engine routes a whole step at once: a float32 softmax over the $[T, E]$ logits
# ($T$ tokens; $T$ may be 0), the top $k$ of every row in one tensor operation, largest first,
# and the optional renormalization of every row. That batched version is `route` in
# `nanovllm/layers/router.py`, and writing it is **assignment `16.route`**: its docstring is the
# handout (shown here with the body elided). One difference to mind: `route_token` breaks an
# exact tie by the lower expert number, a rule of our own; `torch.topk` promises no order among
# equal values, and the handout asks for `torch.topk`'s order, because it is the one Hugging
# Face's models get. Random float scores do not tie, so the comparison below never meets one.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(router.route)

# %% [markdown]
# The comparison: `route_token`, token by token, against the package's `route` on random
# batches (in the course edition, `router.route` is your code; until you write it, the cell says
# that it is still the stub).

# %%
# NBVAL_CHECK_OUTPUT
def compare_with_route(cases, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    for tokens, experts, k in cases:
        for renormalize in (True, False):
            logits = torch.randn(tokens, experts, generator=gen)
            weights, ids = router.route(logits, k, renormalize)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int64
            assert weights.shape == ids.shape == (tokens, k), (weights.shape, ids.shape)
            for t in range(tokens):
                chosen = route_token(logits[t].tolist(), k, renormalize)
                assert ids[t].tolist() == [e for e, _ in chosen], (tokens, experts, k, t)
                assert torch.allclose(weights[t], torch.tensor([w for _, w in chosen])), t
    return (f"route_token, token by token, equals nanovllm's route on {2 * len(cases)} random "
            "batches (two of them empty)")


try:
    print(compare_with_route([(1, 8, 2), (7, 64, 8), (33, 128, 8), (0, 16, 4)]))
except NotImplementedError:  # the course edition, before assignment 16.route is written
    print("not compared: nanovllm's route is still the stub of assignment 16.route; write it in "
          "nanovllm/layers/router.py (its docstring is the handout) and run this cell again")

# %% [markdown]
# **Hints for assignment `16.route`** (try without them first):
#
# 1. `route_token` above is the meaning; the assignment is the same for every row of `[T, E]`
#    at once, with no Python loop over tokens. Read the handout's order of operations twice:
#    which dtype the softmax runs in, and whether the cut comes before or after it.
# 2. PyTorch has one operation that returns the k largest entries of each row with their
#    indices, largest first, breaking ties the way the handout asks.
# 3. Renormalizing divides each row by its own sum; mind the shapes so that it broadcasts,
#    and do not modify anything the caller still holds.

# %% [markdown]
# ## 3. The experts, one at a time
#
# Each expert is a SwiGLU MLP. Hugging Face checkpoints store every expert's three matrices
# separately (`mlp.experts.{e}.gate_proj.weight`, Mixtral: `block_sparse_moe.experts.{e}.w1`);
# the package stacks them at load time into `w13` $[E, 2D_e, D]$ (each expert's gate rows, then
# its up rows) and `w2` $[E, D, D_e]$ (`nanovllm/layers/fused_moe.py`,
# `StackedExpertWeight.weight_loader`; `MoeForCausalLM` maps the names). The simplest layer
# loops over the experts: gather the tokens routed to expert $e$, run its MLP, add the
# weighted result back to those tokens.

# %%
def moe_naive(x, w13, w2, topk_weights, topk_ids):
    out = torch.zeros(x.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)  # the tokens that chose e, and which choice
        if len(token) == 0:
            continue
        gate, up = (x[token] @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out


# %% [markdown]
# The package's reference path does the same over the assignments sorted by expert (the order
# the fused kernel uses), and is what the engine runs on a CPU:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(fused_moe_layer.moe_reference)

# %%
# NBVAL_CHECK_OUTPUT
def random_layer(tokens, experts, k, hidden, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = router.route(torch.randn(tokens, experts, generator=g), k, True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


for case in [(5, 4, 2, 32, 16), (40, 16, 4, 64, 24), (1, 128, 8, 64, 16)]:
    args = random_layer(*case, seed=sum(case))
    assert torch.allclose(moe_naive(*args), moe_reference(*args), atol=1e-5)
print("moe_naive equals nanovllm's moe_reference on 3 random layers")


# %% [markdown]
# Now whole models. A tiny random Qwen3-MoE (8 experts, 2 per token, its middle layer dense as
# `mlp_only_layers` allows) and a tiny Mixtral (4 experts), saved by `transformers` with
# `save_pretrained` in Hugging Face's per-expert layout; the router weights are drawn larger
# than `transformers`' initialization so no token sits on a near-tie between two experts.
# The logits must agree, and the engine's greedy tokens must be `transformers'`. Each engine
# lives in a `with` block, which shuts it down at the block's end (chapter 00): on a GPU an
# engine takes 90% of the memory by default, so the next one could not be built beside it.

# %%
def tiny_moe(arch: str, path: Path, seed: int = 0):
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  num_experts_per_tok=2, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    if arch == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=32,
                                             intermediate_size=96, norm_topk_prob=True,
                                             mlp_only_layers=[1])
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=4, intermediate_size=48)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


workdir = Path(tempfile.mkdtemp())
tiny = {arch: (tiny_moe(arch, workdir / arch), str(workdir / arch))
        for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")}

# %%
# NBVAL_CHECK_OUTPUT
gen = torch.Generator().manual_seed(2)
prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40)]
for arch, (hf, path) in tiny.items():
    cfg = ModelConfig.from_pretrained(path)
    ours = get_model_class(arch)(cfg)
    load_safetensors(ours, path)
    ids = torch.tensor(prompts[2])
    with torch.no_grad(), attention_metadata(None):
        gap = (ours.compute_logits(ours(ids, torch.arange(len(ids)))) - hf(ids[None]).logits[0])
    with LLM(path, block_size=16) as llm:  # shut down at the end: the next engine needs the GPU
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10),
                            use_tqdm=False)
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                            attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):]
                .tolist() for p in prompts]
    print(f"{arch}: logits within 1e-4: {gap.abs().max().item() < 1e-4}; "
          f"greedy tokens equal transformers': {[o.token_ids for o in outs] == expected}")

# %% [markdown]
# ## 4. Why one expert at a time is slow
#
# Three reasons, each visible in the loop above.
#
# - **Launches.** Per layer and expert the loop gathers, multiplies twice, applies the
#   activation, scales and scatters: about eight kernels. Qwen3-30B-A3B has 48 layers of 128
#   experts; a decode step of 256 tokens touches nearly all of them.
# - **Tiny GEMMs.** A batch of $n$ tokens makes $nk$ assignments spread over $E$ experts:
#   $nk/E$ rows per expert on average. A GPU GEMM needs rows by the hundred to use its
#   tensor cores; at decode sizes each expert gets a handful.
# - **Imbalance.** The router does not spread tokens evenly, and the slowest expert sets the
#   pace of a loop or of a kernel that gives each expert its own work.

# %%
# NBVAL_CHECK_OUTPUT
cfg30 = shapes["qwen3-30b-a3b"]
m30 = cfg30.moe
print(f"Qwen3-30B-A3B: {cfg30.num_layers} MoE layers x {m30.num_experts} experts, "
      f"k = {m30.top_k}")
for t in (1, 16, 64, 256):
    touched = m30.num_experts * (1 - (1 - m30.top_k / m30.num_experts) ** t)
    print(f"  batch {t:3d}: {t * m30.top_k / m30.num_experts:6.2f} rows per expert on average, "
          f"{touched:6.1f} experts touched (uniform routing), "
          f"~{8 * cfg30.num_layers * round(touched)} kernels per step in a per-expert loop")

# %% [markdown]
# The load per expert, measured: hooks on the tiny Qwen3-MoE's routers count the assignments
# to each expert over a prefill of random prompts (`nanovllm.benchmarks.moe.expert_load`).
# With perfectly even routing every expert would get the mean; Figure 16.1 shows how far the
# real counts are from it.

# %%
# NBVAL_CHECK_OUTPUT
hf_qwen, path_qwen = tiny["Qwen3MoeForCausalLM"]
gen = torch.Generator().manual_seed(3)
load_prompts = [torch.randint(0, 256, (64,), generator=gen).tolist() for _ in range(16)]
with LLM(path_qwen, block_size=16) as llm:
    load = moe_bench.expert_load(llm, load_prompts)
print(f"assignments per MoE layer: {[sum(c) for c in load]} (16 prompts x 64 tokens x k=2)")

# %%
# NBVAL_IGNORE_OUTPUT
# (Which expert wins a near-tie depends on the dtype: a GPU routes in bf16, this CPU in fp32.)
summary = moe_bench.load_summary(load)
print("busiest expert / mean, per layer:",
      [round(r, 2) for r in summary["max_over_mean_per_layer"]])

# %%
fig, axes = plt.subplots(1, len(load), figsize=(9, 2.8), sharey=True)
for layer, (ax, counts) in enumerate(zip(axes, load)):
    ax.bar(range(len(counts)), counts, color=BOOK_COLORS[0])
    ax.axhline(sum(counts) / len(counts), color=BOOK_COLORS[1], ls="--", label="even load")
    ax.set_title(f"MoE layer {layer + 1}", fontsize=9)
    ax.set_xlabel("expert")
axes[0].set_ylabel("assignments")
axes[0].legend(fontsize=8)
figure(fig, "16_expert_load", "Assignments per expert in each MoE layer of the tiny random "
       "Qwen3-MoE over a prefill of 16 random prompts (1,024 tokens, 2 experts each); dashed: "
       "the mean, what an even router would give every expert.")

# %% [markdown]
# A random tiny model is not a trained one, but the lesson carries: the counts are uneven,
# so a kernel must not assume equal work per expert. (The benchmark's `workload` mode counts
# the same on the Qwen3-30B-A3B shape; no record of that run is committed, section 6.)

# %% [markdown]
# ## 5. Sort, align, and one grouped GEMM
#
# The fix is vLLM's `fused_moe`. Number the $nk$ assignments as *slots*
# $s = i\cdot k + j$ (token $i$'s $j$-th expert). Sort the slots by expert, and pad each
# expert's group to a multiple of the kernel's tile height $B_M$ with a sentinel ($nk$). Now
# every block of $B_M$ consecutive entries belongs to one expert, so a single kernel launch can
# give each program one block: it gathers its $B_M$ tokens' hidden rows, multiplies them by
# its expert's weights, and writes each row back to its slot. All experts, one launch, and
# each program's GEMM is $B_M$ rows tall whatever the routing. The padding is the price.
# Built small:

# %%
def align_small(topk_ids: torch.Tensor, num_experts: int, block: int):
    flat = topk_ids.flatten().tolist()
    n = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        group = [s for s in range(n) if flat[s] == e]
        group += [n] * (-len(group) % block)  # pad to whole blocks with the sentinel
        sorted_ids += group
        expert_ids += [e] * (len(group) // block)
    return sorted_ids, expert_ids


topk_ids = torch.tensor([[3, 0], [3, 0], [3, 1], [3, 0], [3, 5]])
sorted_ids, expert_ids = align_small(topk_ids, 6, 4)
print("slots by expert, padded:", sorted_ids)
print("expert of each block:   ", expert_ids)

# %% [markdown]
# The package's `moe_align_block_size` (`nanovllm/kernels/moe_align.py`) computes the same
# with tensor operations on **fixed-size** outputs: a GPU must not wait to learn how many
# blocks there are (that would be a host sync, and a CUDA graph cannot even contain one,
# chapter 07). So the buffers are sized for the worst case, `aligned_capacity`, and a third
# output says how much of them is used; the blocks past it carry expert $-1$ and the kernel
# skips them.

# %%
# NBVAL_CHECK_OUTPUT
got_sorted, got_experts, used = moe_align.moe_align_block_size(topk_ids, 6, 4)
n_used = int(used)
print("package, used part:", got_sorted[:n_used].tolist())
print("expert per block:  ", got_experts.tolist())
print(f"used {n_used} of {len(got_sorted)} entries (aligned_capacity)")
gen = torch.Generator().manual_seed(4)
for tokens, k, experts, block in [(9, 2, 8, 4), (64, 8, 128, 16), (50, 3, 5, 32)]:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    small_sorted, small_experts = align_small(ids, experts, block)
    pkg_sorted, pkg_experts, pkg_used = moe_align.moe_align_block_size(ids, experts, block)
    assert pkg_sorted[: int(pkg_used)].tolist() == small_sorted
    assert pkg_experts[pkg_experts >= 0].tolist() == small_experts
print("align_small equals moe_align_block_size on 3 random routings")

# %% [markdown]
# Figure 16.2 draws that layout for a random batch: each column a block, colored by its
# expert, the padding grey.

# %%
gen = torch.Generator().manual_seed(5)
demo_ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(14)])
demo_sorted, demo_experts, demo_used = moe_align.moe_align_block_size(demo_ids, 6, 4)
fig, ax = plt.subplots(figsize=(9, 2.2))
n_slots = demo_ids.numel()
for i, slot in enumerate(demo_sorted[: int(demo_used)].tolist()):
    block = i // 4
    color = "0.85" if slot == n_slots else BOOK_COLORS[int(demo_experts[block]) %
                                                        len(BOOK_COLORS)]
    ax.add_patch(plt.Rectangle((block, 3 - i % 4), 0.92, 0.92, color=color))
    ax.text(block + 0.46, 3 - i % 4 + 0.46, "pad" if slot == n_slots else f"t{slot // 2}",
            ha="center", va="center", fontsize=7)
for block, e in enumerate(demo_experts[demo_experts >= 0].tolist()):
    ax.text(block + 0.46, 4.2, f"E{e}", ha="center", fontsize=8)
ax.set_xlim(-0.1, int(demo_used) // 4 + 0.1)
ax.set_ylim(-0.2, 4.7)
ax.axis("off")
figure(fig, "16_align_blocks", "A diagram, not a measurement: the layout that the package's "
       "`moe_align_block_size` computes for a random routing of 14 tokens, 2 of 6 "
       "experts each, block size 4: every column is one program of the grouped GEMM, one "
       "expert's rows (tN: the token whose hidden state the row gathers); grey: padding.")

# %% [markdown]
# **Hints for assignment `16.align`**:
#
# 1. Count first: how many slots each expert has, then how long each padded group is, then
#    where each group starts (a cumulative sum).
# 2. A *stable* sort of the flat ids gives the slots in expert order; a slot's position inside
#    its group is its position in the sorted order minus where its expert's slots begin there.
# 3. `scatter_add_` counts without `bincount` (whose output size depends on the data);
#    `torch.searchsorted` on the groups' ends tells which group a block start falls in.

# %% [markdown]
# The grouped GEMM itself, built small in PyTorch: one loop iteration per block, the body of
# one kernel program. The gate/up product and the activation come together (the kernel keeps
# both accumulators and stores `silu(gate) * up`), the down product scales each row by its
# router weight, and the $k$ rows of each token are summed at the end.

# %%
def grouped_gemm_small(x, w13, w2, topk_weights, topk_ids, block=4):
    n, k = topk_ids.numel(), topk_ids.shape[1]
    sorted_ids, expert_ids, used = moe_align.moe_align_block_size(topk_ids, w13.shape[0], block)
    inter = w13.shape[1] // 2
    activated = torch.zeros(n, inter)
    down = torch.zeros(n, w2.shape[1])
    for b in range(int(used) // block):  # one program per block
        slots = sorted_ids[b * block:(b + 1) * block]
        slots = slots[slots < n]  # drop the padding
        e = int(expert_ids[b])
        gate_up = x[slots // k] @ w13[e].T
        activated[slots] = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    for b in range(int(used) // block):  # the second launch, same blocks
        slots = sorted_ids[b * block:(b + 1) * block]
        slots = slots[slots < n]
        down[slots] = activated[slots] @ w2[int(expert_ids[b])].T * \
            topk_weights.flatten()[slots, None]
    return down.view(-1, k, w2.shape[1]).sum(1)


# %%
# NBVAL_CHECK_OUTPUT
for case in [(9, 8, 2, 32, 16), (30, 4, 3, 48, 24)]:
    args = random_layer(*case, seed=7 + sum(case))
    assert torch.allclose(grouped_gemm_small(*args), moe_reference(*args), atol=1e-5)
print("grouped_gemm_small equals moe_reference on 2 random layers")

# %% [markdown]
# How much the padding costs depends on the rows per expert. With $B_M = 16$ and Qwen3-30B-A3B's
# 128 experts, $k = 8$: at batch 1 each touched expert holds one real row in a block of 16.
# Even at batch 256, where an expert gets 16 rows on average, fewer than half of the blocks are
# full (the cell's last lines count them): an expert's rows fill whole blocks only when their
# count is an exact multiple of $B_M$, and the counts scatter around the mean, so most groups
# end in a partly filled block. The kernel picks $B_M$ from the mean rows per expert
# (`pick_block_m`: 16 up to 16 rows, 32 up to 48, then 64).

# %%
# NBVAL_CHECK_OUTPUT
gen = torch.Generator().manual_seed(6)
print("tokens  block  padded rows / real rows  full blocks / blocks")
full_at = {}
for t in (1, 16, 64, 256, 1024):
    logits = torch.randn(t, 128, generator=gen)
    _, ids = router.route(logits, 8, True)
    for block in (16, 64):
        slots, _, used = moe_align.moe_align_block_size(ids, 128, block)
        blocks = slots[: int(used)].view(-1, block)
        full = int((blocks < ids.numel()).all(dim=1).sum())  # no padding sentinel in the block
        full_at[t, block] = full, len(blocks)
        print(f"{t:6d} {block:6d}  {int(used) / ids.numel():22.2f}  {full:8d} / {len(blocks)}")
full, total = full_at[256, 16]
print(f"at 256 tokens and block 16: {full} of {total} blocks full ({full / total:.0%}), "
      f"{256 * 8 / 128:.0f} rows per expert on average")

# %% [markdown]
# ## 6. The package's Triton kernel
#
# `nanovllm/kernels/fused_moe.py` is the grouped GEMM as one Triton kernel, launched twice
# (gate/up with the activation fused; down with the router weights), over the blocks of
# `moe_align_block_size`. A program loads its block's slot ids, masks the padding, gathers
# the token rows (`slot // k` for the first launch), and walks the reduction dimension in
# tiles of 64, accumulating in float32. The grid is sized by `aligned_capacity`, so nothing
# waits for the device, and the layer works inside the decode CUDA graphs.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.kernels import fused_moe as fused_moe_kernel  # noqa: E402

show_source(fused_moe_kernel._grouped_gemm_kernel, fused_moe_kernel.fused_moe)

# %% [markdown]
# On a CPU it runs under Triton's interpreter (slowly, but exactly the same program), so we can
# check it against the reference here; `tests/kernels/test_fused_moe.py` does so on more shapes
# and in bf16, and the engine switches it on with the GPU backends' fused kernels
# (`FusedMoE.fused_kernel`, chapter 11's switch).

# %%
# NBVAL_CHECK_OUTPUT
for case in [(7, 8, 2, 64, 32), (20, 4, 2, 64, 48)]:
    args = random_layer(*case, seed=11 + sum(case))
    args = tuple(a.to(DEVICE) for a in args)
    gap = (fused_moe(*args) - moe_reference(*args)).abs().max().item()
    print(f"tokens {case[0]:2d}, {case[1]} experts: fused kernel within 1e-5 of the reference: "
          f"{gap < 1e-5}")

# %% [markdown]
# **How fast it is: slower than torch's grouped GEMM, at every size measured.** On the H200, on
# one layer of Qwen3-30B-A3B's shape in bf16, our fused Triton kernel takes longer than torch's
# own grouped GEMM (`torch.nn.functional.grouped_mm` over the expert-sorted tokens;
# `moe_grouped_mm` in `nanovllm/benchmarks/moe.py`) at each of the record's batch sizes. The
# cell below prints by how much at each size (the ratio column: our time over torch's), read
# from `moe_layer_h200.json`, beside the share of the H200's copy bandwidth each reaches: the
# bytes a layer must read (the touched experts' weights, the activations in and out) over its
# time, against the copy rate of `peaks_h200.json`. The per-expert loop of section 3 is the
# third column; the fused kernel does beat that.

# %%
# NBVAL_CHECK_OUTPUT
layer_rec, peaks = record("moe_layer_h200.json"), record("peaks_h200.json")
if layer_rec is None or peaks is None:
    print("no H200 record yet: moe_layer_h200.json (tests/gpu/moe_h200.sh) and peaks_h200.json "
          "(nanovllm/benchmarks/peaks.py) are both needed")
else:
    copy_rate = peaks["copy_bytes_per_s"]
    by = {(r["method"], r["tokens"]): r for r in layer_rec["rows"]}
    sizes = sorted({t for _, t in by})
    ratio = {t: by["fused", t]["seconds"] / by["grouped", t]["seconds"] for t in sizes}
    slower = [t for t in sizes if ratio[t] > 1]
    print(f"{layer_rec['device']}, {layer_rec['date'][:10]} (moe_layer_h200.json): ours is "
          f"slower than torch's grouped GEMM at {len(slower)} of {len(sizes)} sizes: "
          + ", ".join(f"{ratio[t]:.2f}x the time at {t} token{'s' * (t > 1)}" for t in sizes))
    print(f"\n{'tokens':>6s} {'ours ms':>8s} {'torch ms':>9s} {'ours/torch':>10s} "
          f"{'ours % BW':>9s} {'torch % BW':>10s} {'loop ms':>8s}")
    for t in sizes:
        ours, torch_gg, loop = by["fused", t], by["grouped", t], by["loop", t]
        print(f"{t:6d} {ours['seconds'] * 1e3:8.3f} {torch_gg['seconds'] * 1e3:9.3f} "
              f"{ratio[t]:9.2f}x {ours['bytes_per_s'] / copy_rate:9.1%} "
              f"{torch_gg['bytes_per_s'] / copy_rate:10.1%} {loop['seconds'] * 1e3:8.3f}")
    print(f"(% BW: the layer's bytes per second over the copy rate, "
          f"{copy_rate / 1e12:.2f} TB/s, peaks_h200.json)")

    def growth(method: str, field: str) -> float:
        return by[method, sizes[-1]][field] / by[method, sizes[0]][field]

    print(f"from {sizes[0]} to {sizes[-1]} tokens the bytes grow {growth('fused', 'bytes'):.1f}x, "
          f"our time {growth('fused', 'seconds'):.2f}x, "
          f"torch's {growth('grouped', 'seconds'):.2f}x")

# %% [markdown]
# Two things are plain in the table. Ours loses to torch's grouped GEMM at every size, and
# neither reaches half of the copy rate at any size: at one token our kernel uses the smallest
# share of the bandwidth in the table. And the times hardly move from 1 to 256 tokens while
# the bytes grow many times over (the last line): at small batches a cost that does not depend
# on the bytes sets the time. The record does not take that cost apart (each method runs
# eagerly, a call at a time, timed with CUDA events); finding and removing it is the open work
# on this kernel, and until then torch's grouped GEMM is the faster layer.
#
# Is a larger batch compute-bound, as a dense GEMM eventually is? The roofline of chapter 11
# answers: a computation of $F$ FLOPs over $Q$ bytes is bound by the bandwidth while its
# intensity $F/Q$ is below the ridge point, the bf16 matmul rate over the copy rate (both from
# `peaks_h200.json`). With every expert touched, a layer reads all $E$ experts' weights (2
# bytes each in bf16) and does 2 FLOPs per weight for each of its $T k$ rows, so its intensity
# is about $T k / E$ FLOP per byte; the cell computes it from the record's own FLOPs and bytes.

# %%
# NBVAL_CHECK_OUTPUT
if layer_rec is None or peaks is None:
    print("no H200 record yet")
else:
    ridge = peaks["bf16_matmul_flops_per_s"] / copy_rate
    print(f"H200 ridge point: {ridge:.0f} FLOP/byte (peaks_h200.json: bf16 matmul "
          f"{peaks['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s over copy "
          f"{copy_rate / 1e12:.2f} TB/s)")
    for t in sizes:
        intensity = by["fused", t]["flops"] / by["fused", t]["bytes"]
        bound = "bandwidth" if intensity < ridge else "compute"
        print(f"{t:4d} token{'s' * (t > 1):1s}: {intensity:5.1f} FLOP/byte, the ridge / this = "
              f"{ridge / intensity:5.1f}x: {bound}-bound")
    shape = layer_rec["shape"]
    print(f"T k / E reaches the ridge at T = {ridge * shape['num_experts'] / shape['top_k']:,.0f}"
          f" tokens per step (E = {shape['num_experts']}, k = {shape['top_k']})")

# %% [markdown]
# So a MoE layer at the batch sizes of decoding does not become a GEMM bound by arithmetic:
# at 256 tokens per step it is still an order of magnitude left of the ridge, and it would
# reach it only at thousands of tokens per step (the last line), the size of a large prefill,
# which the record does not measure. At every size measured, the layer's roof is the bandwidth,
# and what matters is how much of it a kernel uses. Figure 16.3 plots the three methods.

# %%
# NBVAL_IGNORE_OUTPUT
if layer_rec is None:
    print("no H200 record yet (tests/gpu/moe_h200.sh); measured here instead, on a tiny layer")
    rows = moe_bench.layer_benchmark(16, 2, 64, 32, [1, 16, 64], torch.float32, DEVICE, reps=3)
    if DEVICE == "cpu":  # the interpreter's time says nothing about the kernel's
        rows = [r for r in rows if r["method"] != "fused"]
    source = f"measured on this machine ({DEVICE}), a tiny layer (16 experts, hidden 64)"
else:
    rows = layer_rec["rows"]
    source = (f"measured on the {layer_rec['device']} (moe_layer_h200.json, "
              f"{layer_rec['date'][:10]}), one layer of Qwen3-30B-A3B's shape in bf16")
names = {"fused": "fused (ours, Triton)", "grouped": "torch grouped GEMM",
         "loop": "one expert at a time"}
fig, ax = plt.subplots(figsize=(6, 3.4))
for i, method in enumerate(sorted({r["method"] for r in rows})):
    mine = [r for r in rows if r["method"] == method]
    ax.plot([r["tokens"] for r in mine], [r["seconds"] * 1e6 for r in mine], "o-",
            color=BOOK_COLORS[i], label=names[method])
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens per step")
ax.set_ylabel("µs per layer")
ax.legend()
figure(fig, "16_layer_speed", f"One MoE layer, three ways, {source}: µs per call of our fused "
       "Triton kernel, of one expert at a time, and of torch's grouped GEMM (lower is faster).")

# %% [markdown]
# What this means for a whole decode step. A dense model's step reads all its weights; a MoE
# step reads the dense part and, in each layer, only the experts its batch touches:
# $E\,(1 - (1 - k/E)^B)$ of them for a batch of $B$ under even routing (section 4 counts them).
# As requests finish and the batch drains, that falls toward $k$. The engine's bandwidth bound
# for a MoE model sums those bytes over a workload's steps (`moe_bound_bytes` in
# `nanovllm/benchmarks/moe.py`), and the benchmark's `workload` mode measures the engine
# against it; but no record of that run is committed (on the H200 it was cut off by its time
# limit, as the note in `moe_layer_h200.json` says), so this chapter reports no whole-engine
# speed for a MoE model.

# %% [markdown]
# ## 7. Memory: total against active parameters
#
# Experts save FLOPs, not memory: every expert must be resident, since the next token may
# pick any of them. What is left of the GPU for the KV cache is what the *total* parameters
# leave, while the KV cache per token depends only on the attention (layers, KV heads,
# head_dim). On one H200 (its memory from a record of chapter 13), at the engine's default
# 90% share, in bf16:

# %%
# NBVAL_CHECK_OUTPUT
h200_bytes = record("troubleshooting_h200.json")["stages"]["start"]["device_total_gib"] * 2**30
print(f"H200: {h200_bytes / 2**30:.1f} GiB; 90% share, bf16 weights")
for name in ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"):
    cfg = shapes[name]
    total, active = parameter_counts(cfg)
    free_bytes = 0.9 * h200_bytes - 2 * total
    kv = cfg.kv_bytes_per_token(2)
    print(f"{name:14s} weights {2 * total / 2**30:5.1f} GiB, active {active / 1e9:5.2f}B, "
          f"KV {kv // 1024:3d} KiB/token -> {free_bytes / kv / 1e6:5.2f}M tokens of cache")

# %% [markdown]
# Qwen3-30B-A3B leaves a little more room for the cache than Qwen3-32B, and its KV cache per
# token is smaller (4 KV heads against 8), so it holds several times as many tokens (the last
# column); but it is no smaller in memory than a dense model of as many parameters, and its
# decode steps at large batch read nearly all of it (section 4 counts the experts touched).

# %% [markdown]
# ## 8. Tensor parallelism for experts
#
# nanovllm splits each expert the way chapter 09 splits a dense MLP: rank $r$ of $N$ holds
# rows $r D_e/N .. (r+1) D_e/N$ of every expert's gate and up projections and the same columns of
# its down projection. Each rank runs the whole router and all the experts on its slice; the
# partial outputs add up, as after a row-parallel layer, in one all-reduce per layer. Every
# rank's GEMMs shrink by $N$, the routing is computed everywhere (it is tiny), and the load
# per rank is even by construction. With two simulated ranks:

# %%
# NBVAL_CHECK_OUTPUT
x, w13, w2, weights, ids = random_layer(12, 8, 2, 32, 24, seed=12)
inter, ranks = 24, 2
partials = []
for r in range(ranks):
    mine = slice(r * inter // ranks, (r + 1) * inter // ranks)
    w13_r = torch.cat([w13[:, :inter][:, mine], w13[:, inter:][:, mine]], dim=1)
    partials.append(moe_reference(x, w13_r, w2[:, :, mine], weights, ids))
print("sum of the two ranks' partial outputs equals one rank's:",
      torch.allclose(sum(partials), moe_reference(x, w13, w2, weights, ids), atol=1e-5))

# %% [markdown]
# `StackedExpertWeight.weight_loader` takes each rank's slice at load time, and
# `tests/test_moe_tensor_parallel.py` runs two CPU processes (gloo) against one, and against
# `transformers`. The other way to split is **expert parallelism**: each rank holds whole
# experts ($E/N$ of them) and tokens travel to their experts' ranks and back (two all-to-all
# exchanges per layer). It keeps each expert's GEMM whole, which helps when experts are many
# and small, but a hot expert's rank becomes everyone's wait; nanovllm does not implement it.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"chapter run time so far: {time.perf_counter() - chapter_start:.0f} s")

# %% [markdown]
# ## Assignments
#
# In the course edition you write two pieces:
#
# - `route` in `nanovllm/layers/router.py` (section 2): softmax, top-$k$, renormalization.
#   Graded by unit tests against a float64 reference and by Qwen3-MoE and Mixtral parity with
#   `transformers` (logits and engine greedy tokens, with and without `norm_topk_prob`).
# - `moe_align_block_size` in `nanovllm/kernels/moe_align.py` (section 5): the sorted, padded
#   slots and the expert of each block, with fixed output shapes. Graded exactly against a
#   plain-Python grouping on random and skewed routings.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table  # noqa: E402

print(assignment_table("16"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — experts touched.** Write `expected_touched(num_experts, k, batch)`: the
# expected number of distinct experts a batch of `batch` tokens touches when each token picks
# `k` distinct experts uniformly at random (section 4). The check compares with a simulation.

# %% tags=["exercise"]
def expected_touched(num_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts touched by `batch` tokens of `k` uniform random experts."""
    raise NotImplementedError("exercise 16.expected_touched")


# %% tags=["check", "raises-exception"]
import torch

gen = torch.Generator().manual_seed(0)
for experts, k, batch in [(8, 2, 1), (8, 2, 5), (128, 8, 16), (64, 6, 40)]:
    trials = [len({e for _ in range(batch)
                   for e in torch.randperm(experts, generator=gen)[:k].tolist()})
              for _ in range(300)]
    simulated = sum(trials) / len(trials)
    got = expected_touched(experts, k, batch)
    assert abs(got - simulated) < 0.05 * experts ** 0.5 + 0.02 * simulated, (got, simulated)
print("Exercise 1 passed: expected_touched agrees with the simulation")

# %% [markdown]
# **Exercise 2 — the worst case of padding.** Write `worst_case_rows(n, num_experts, block)`:
# the most rows the aligned layout of section 5 can take for `n` assignments over
# `num_experts` experts, over every possible routing (each group padded to whole blocks of
# `block`). The package allocates `aligned_capacity`, a simpler bound: compare the two.

# %% tags=["exercise"]
def worst_case_rows(n: int, num_experts: int, block: int) -> int:
    """The most rows n assignments over num_experts experts can take, padded to blocks."""
    raise NotImplementedError("exercise 16.worst_case_rows")


# %% tags=["check", "raises-exception"]
import itertools


def by_enumeration(n, experts, block):
    best = 0
    for counts in itertools.product(range(n + 1), repeat=experts):
        if sum(counts) == n:
            best = max(best, sum(-(-c // block) * block for c in counts))
    return best


for n, experts, block in itertools.product((0, 1, 3, 7, 12), (1, 2, 4), (1, 2, 4, 16)):
    got = worst_case_rows(n, experts, block)
    assert got == by_enumeration(n, experts, block), (n, experts, block, got)
print("Exercise 2 passed: worst_case_rows is the largest padded layout")

# %% [markdown]
# **Exercise 3 — active parameters.** Qwen3-235B-A22B has 94 layers, hidden 4096, 64 query
# heads over 4 KV heads of 128, 128 experts of width 1536, 8 per token, vocabulary 151,936 and
# separate embedding and LM head. Write `qwen3_235b_counts()` returning (total, active)
# parameters as section 1 counts them, and check that the name is honest.

# %% tags=["exercise"]
def qwen3_235b_counts() -> tuple[int, int]:
    """(total, active per token) parameters of Qwen3-235B-A22B."""
    raise NotImplementedError("exercise 16.qwen3_235b_counts")


# %% tags=["check", "raises-exception"]
total, active = qwen3_235b_counts()
assert 234e9 < total < 236e9, total
assert 21e9 < active < 23e9, active
print(f"Exercise 3 passed: {total / 1e9:.1f}B total, {active / 1e9:.1f}B active")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/16.json` *before* measuring; then `make analysis CH=16 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("16")

# %% [markdown]
# ## Summary
#
# - A MoE layer holds $E$ experts and runs $k$ per token: parameters grow with $E$, FLOPs per
#   token with $k$ (section 1: Qwen3-30B-A3B against dense Qwen3).
# - The **router** is a linear layer, a float32 softmax, the top $k$, and for Mixtral and
#   Qwen3-MoE's `norm_topk_prob` a renormalization; that order is what makes the greedy
#   tokens equal `transformers'` (section 3 checks both architectures, logits and engine).
# - Running experts **one at a time** costs launches, leaves each expert a tiny GEMM, and
#   waits on the busiest expert: the load per expert is uneven (Figure 16.1).
# - **Sort and align**: order the $nk$ assignments by expert and pad each group to whole
#   blocks (`moe_align_block_size`, fixed-size outputs, no host sync: CUDA graphs keep
#   working); then one **grouped GEMM** launch gives every block to its expert, with the
#   activation fused into the gate/up launch and the router weights into the down launch.
#   The padding is the price, large at small batches (section 5).
# - The package's Triton kernel is that design (vLLM's). On the H200 it is **slower than
#   torch's grouped GEMM at every batch size measured** (section 6 prints the ratio per size
#   from the record), though faster than the per-expert loop; both use well under the
#   copy bandwidth at small batches. At decode sizes a MoE layer stays far left of the ridge
#   point, bound by bandwidth, not arithmetic. No whole-engine MoE record is committed yet.
# - **Memory** follows the total parameters, not the active ones: every expert stays
#   resident, and the KV budget is what they leave (section 7).
# - **Tensor parallelism** slices every expert's width across ranks, like a dense MLP: one
#   all-reduce per layer, even work per rank (section 8).

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
# # Chapter 11 — Performance
#
# Ten chapters built the engine piece by piece, and each measured what its piece buys. This
# chapter measures the whole: how many tokens per second the engine produces on a standard
# workload, how that compares with `transformers`, and, more usefully, how it compares with the
# **fastest the hardware allows**. The gap between the two is where the next improvements are,
# so we account for it step by step and say honestly what we can explain and what we cannot.
# Then the knobs a user turns to trade throughput, latency and memory, measured live on
# SmolLM2; how the engine reaches long contexts (RoPE scaling); and how to run the benchmark
# yourself.
#
# Package modules used: `nanovllm/bench.py` (the benchmark, `make_workload`,
# `bandwidth_bound_seconds`, `decode_step_benchmark`), `nanovllm/config.py` (the knobs),
# `nanovllm/engine/metrics.py` (per-step statistics), `nanovllm/engine/model_runner.py` (the
# KV-cache budget) and `nanovllm/layers/rotary.py` (RoPE scaling).

# %% [markdown]
# ## Setup

# %%
import dataclasses
import inspect
import json
import math
import random
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.bench import bandwidth_bound_seconds, make_workload
from nanovllm.configs import config_path
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.viz import BOOK_COLORS, figures_dir, save_figure, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
use_book_style()
DATA = figures_dir() / "data"


def show_source(*objects) -> None:
    """Render the source of package objects as one highlighted code block."""
    source = "\n".join(inspect.getsource(obj) for obj in objects)
    display(Markdown(f"```python\n{source}```"))


def load_record(name: str) -> dict:
    """A result recorded on a GPU, from figures/data/."""
    return json.loads((DATA / name).read_text())


# %% [markdown]
# ## 1. The benchmark
#
# The workload is the one nano-vllm publishes numbers for, so results are comparable: 256
# requests, prompts of 100 to 1024 random token ids, each asked for 100 to 1024 new tokens,
# with `ignore_eos` so that every request generates exactly what it asked for (random weights
# would otherwise stop at random places). `make_workload("nano-vllm")` draws it with seed 0, in
# the same order as nano-vllm's script, so the requests are exactly theirs:

# %%
# NBVAL_CHECK_OUTPUT
work = make_workload("nano-vllm")
prompt_lens = [len(p) for p in work.prompts]
print(f"requests: {len(work.prompts)}")
print(f"prompt tokens: {sum(prompt_lens):,} (from {min(prompt_lens)} to {max(prompt_lens)})")
print(f"output tokens: {work.output_tokens:,} (from {min(work.output_lens)} to "
      f"{max(work.output_lens)} per request)")

# %% [markdown]
# `python -m nanovllm.bench` ran this workload on an H200 with Qwen3-0.6B's architecture and
# random bf16 weights, then ran transformers' continuous batching (its paged-attention
# generation loop) as the peer. The peer is slow, so it ran on the first 32 requests only, and
# our engine ran the same 32 again, so that the ratio compares equal work. Here is the record:

# %%
bench = load_record("bench_h200.json")
print(f"{bench['device']}, {bench['date']}, torch {bench['torch']}")
print(f"command: {bench['command']}")
print(f"nanovllm, all {bench['requests']} requests: {bench['output_tokens']:,} tokens in "
      f"{bench['nanovllm_seconds']:.1f} s = {bench['nanovllm_tok_s']:,.0f} tok/s "
      f"(attention backend {bench['attention_backend']}, CUDA graphs {bench['cuda_graphs']})")
print(f"first {bench['subset_requests']} requests ({bench['subset_output_tokens']:,} tokens): "
      f"nanovllm {bench['nanovllm_subset_tok_s']:,.0f} tok/s, transformers "
      f"{bench['hf_tok_s']:,.0f} tok/s -> {bench['speedup']:.1f}x")

# %% [markdown]
# About 17 times transformers on equal work. (The subset is slower for us than the full
# workload because 32 requests make a small batch: most of each decode step's cost is fixed,
# as we will see, and fewer requests share it.) An earlier run of the same command on the same
# machine is also recorded, with a note:

# %%
run1 = load_record("bench_h200_run1.json")
print(f"earlier run: {run1['nanovllm_tok_s']:,.0f} tok/s ({run1['nanovllm_seconds']:.1f} s); "
      f"later run: {bench['nanovllm_tok_s']:,.0f} tok/s ({bench['nanovllm_seconds']:.1f} s), "
      f"{1 - bench['nanovllm_tok_s'] / run1['nanovllm_tok_s']:.0%} fewer tokens per second")
print("note:", run1["note"])

# %% [markdown]
# The later run produced about a quarter fewer tokens per second. Between the two, the
# scheduler changed (it now ranks running and waiting requests together) and the engine
# started recording per-step statistics;
# we have no repeated runs to separate a real regression from run-to-run variation, so treat
# the difference as an open question. For scale, numbers published by others on the same
# workload (different GPUs, so only a rough guide):

# %%
published = {  # output tok/s on this workload, as published (not measured here)
    "nano-vllm, A100-40GB (its README)": 8961,
    "vLLM, A100 (nano-vllm's comparison, range)": "7,484-9,530",
    "nano-vllm, RTX 4070 laptop (its README)": 1434,
}
for name, value in published.items():
    print(f"  {name:44s} {value:>12}" if isinstance(value, str) else
          f"  {name:44s} {value:>12,}")

# %% [markdown]
# ## 2. The fastest the hardware allows
#
# Comparing with another engine says who is faster, not how fast one *could* be. For that we
# need a bound. In the decode phase every step reads all the model's weights once (shared by
# all sequences in the batch) and every sequence's KV cache so far; both are much more bytes
# than the arithmetic done on them (chapters 03 and 05), so the step can be no faster than
# bytes / memory bandwidth. `bandwidth_bound_seconds` adds this up over the workload,
# optimistically assuming all requests decode together from the first step (then the weights
# are read once per step for `max(output_lens)` steps) and ignoring the prefill's arithmetic:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(bandwidth_bound_seconds)

# %% [markdown]
# A request with a `p`-token prompt that generates `n` tokens reads `p` cached tokens for its
# first new token, `p + 1` for its second, and so on: `p·n + n(n−1)/2` token reads in all.
# Each token read is `kv_bytes_per_token` bytes: a key and a value per KV head per layer.
# The weights come from the shipped Qwen3-0.6B config; we count the parameters on PyTorch's
# `meta` device (shapes, no memory), and use the copy bandwidth measured in the same run:

# %%
# NBVAL_CHECK_OUTPUT
qwen3 = ModelConfig.from_pretrained(config_path("qwen3-0.6b"))
with torch.device("meta"):
    n_params = sum(p.numel() for p in get_model_class(qwen3.architecture)(qwen3).parameters())
weight_bytes = n_params * 2  # bf16
kv_token_reads = sum(p * n + n * (n - 1) // 2 for p, n in zip(prompt_lens, work.output_lens))
print(f"Qwen3-0.6B: {n_params:,} parameters = {weight_bytes / 1e9:.3f} GB in bf16; "
      f"{qwen3.kv_bytes_per_token(2):,} KV bytes per token")
print(f"KV reads over the workload: {kv_token_reads:,} token reads = "
      f"{kv_token_reads * qwen3.kv_bytes_per_token(2) / 1e12:.2f} TB")
print(f"weight reads: {max(work.output_lens)} steps x {weight_bytes / 1e9:.3f} GB = "
      f"{max(work.output_lens) * weight_bytes / 1e12:.2f} TB")

# %%
bandwidth = bench["copy_bandwidth_gb_s"] * 1e9
bound_s = bandwidth_bound_seconds(work, qwen3, weight_bytes, 2, bandwidth)
print(f"copy bandwidth measured in the run: {bandwidth / 1e12:.2f} TB/s")
print(f"bound: {bound_s:.2f} s = {work.output_tokens / bound_s:,.0f} output tok/s")
print(f"measured: {bench['nanovllm_seconds']:.1f} s -> {bound_s / bench['nanovllm_seconds']:.0%} "
      "of the bound")

# %%
# NBVAL_CHECK_OUTPUT
print("our bound equals the one the benchmark recorded:",
      math.isclose(work.output_tokens / bound_s, bench["bound_tok_s"], rel_tol=1e-9))
print("and the recorded fraction of the bound:",
      math.isclose(bound_s / bench["nanovllm_seconds"], bench["fraction_of_bound"], rel_tol=1e-9))

# %% [markdown]
# The KV reads (about 13.9 TB) dwarf the weight reads (about 1.2 TB): with 256 long requests,
# the workload is mostly attention reading caches. At the H200's bandwidth that takes 3.7 s;
# the engine took 24.4 s, **15% of the bound**. Chapter 05 showed that the attention kernel
# itself reads at nearly the copy bandwidth on large batches (section 4.1 shows it again), so
# the kernels are not where the other 85% goes. Before taking the time apart, a picture of
# where the work sits.
#
# ## 3. The roofline of the workload
#
# A **roofline** plots performance (FLOP/s) against arithmetic intensity (FLOPs per byte
# moved). A computation of intensity $I$ can run at most at $\min(P, I\cdot B)$, with $P$ the
# peak arithmetic rate and $B$ the memory bandwidth: a slanted memory roof, then a flat compute
# roof, meeting at the *ridge* $P/B$. For the H200 we use the two measurements of the book:
# 780 TFLOP/s for a large bf16 matrix multiply (the practical compute roof) and the copy
# bandwidth of the run.
#
# We place on it the parts of the workload, with their FLOPs counted as 2 per parameter per
# token for the matrix multiplies and $4\,H d$ per (query, key) pair per layer for attention:
#
# * **decode matmuls at batch B**: all weights read once per step for B tokens: intensity ≈ B;
# * **decode attention**: 2 FLOPs per byte at every batch size (chapter 05); its recorded
#   H200 measurements;
# * **prefill attention**: the recorded H200 measurement of the Triton prefill kernel on the
#   workload's prompts (chapter 02): high intensity, compute-bound;
# * **the whole workload**: all its FLOPs over all the bytes of the bound, at the measured
#   speed of our engine and of transformers (on its 32-request subset), and at the bound.

# %%
H200_PEAK = 780e12  # FLOP/s, measured on the H200: bf16 8192^3 matmul (2026-11-29)


def workload_flops(prompt_lens, output_lens, cfg, params):
    """Matmul FLOPs (2 per parameter per processed token) + attention FLOPs (4·H·d per pair)."""
    tokens = sum(prompt_lens) + sum(output_lens)
    pairs = sum(p * (p + 1) // 2 + p * n + n * (n - 1) // 2
                for p, n in zip(prompt_lens, output_lens))
    return 2 * params * tokens + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * pairs


def workload_bytes(prompt_lens, output_lens, cfg, wbytes):
    reads = sum(p * n + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens))
    return reads * cfg.kv_bytes_per_token(2) + max(output_lens) * wbytes


flops = workload_flops(prompt_lens, work.output_lens, qwen3, n_params)
nbytes = workload_bytes(prompt_lens, work.output_lens, qwen3, weight_bytes)
k = bench["subset_requests"]
sub_flops = workload_flops(prompt_lens[:k], work.output_lens[:k], qwen3, n_params)
sub_bytes = workload_bytes(prompt_lens[:k], work.output_lens[:k], qwen3, weight_bytes)
points = {  # name: (intensity FLOP/byte, achieved FLOP/s)
    "workload at the bound": (flops / nbytes, flops / bound_s),
    "workload, nanovllm (measured)": (flops / nbytes, flops / bench["nanovllm_seconds"]),
    f"workload, transformers ({k} requests)": (sub_flops / sub_bytes,
                                                sub_flops / bench["hf_seconds"]),
}
for name, (i, f) in points.items():
    roof = min(H200_PEAK, i * bandwidth)
    print(f"{name:38s} intensity {i:6.1f} FLOP/byte, {f / 1e12:6.2f} TFLOP/s "
          f"= roof / {roof / f:5.1f}")
print(f"ridge point: {H200_PEAK / bandwidth:.0f} FLOP/byte")

# %%
decode_rec = load_record("bench_decode_h200.json")
prefill_rec = load_record("prefill_kernel_h200.json")
shape = decode_rec["shape"]
att_pts = [(4 * r["batch"] * shape["num_heads"] * r["ctx"] * shape["head_dim"] / r["bytes"],
            4 * r["batch"] * shape["num_heads"] * r["ctx"] * shape["head_dim"] / (r["us"] * 1e-6),
            r["batch"]) for r in decode_rec["rows"] if r["block_size"] == 16 and r["ctx"] == 1024]
pw = prefill_rec["workload"]
prefill_run = next(r for r in prefill_rec["runs"]
                   if r["name"] == "triton_prefill_paged" and r["block_size"] == 16)
# bytes of the prefill: q, k, v read once and the output written, bf16
prefill_bytes = pw["total_tokens"] * (2 * pw["num_heads"] + 2 * pw["num_kv_heads"]) \
    * pw["head_dim"] * 2
prefill_pt = (pw["flops"] / prefill_bytes, prefill_run["tflops"] * 1e12)

fig, ax = plt.subplots(figsize=(8, 5))
xs = np.logspace(-1, 4, 200)
ax.plot(xs, np.minimum(H200_PEAK, xs * bandwidth) / 1e12, color="black", lw=2,
        label=f"H200 roof ({bandwidth / 1e12:.2f} TB/s, {H200_PEAK / 1e12:.0f} TFLOP/s)")
for b in (1, 16, 64, 256):  # decode matmuls: intensity ~ batch (2 FLOPs per 2-byte weight)
    ax.plot(b, min(H200_PEAK, b * bandwidth) / 1e12, "o", color=BOOK_COLORS[4], ms=6,
            markerfacecolor="none")
    ax.annotate(f"B={b}", (b, min(H200_PEAK, b * bandwidth) / 1e12), textcoords="offset points",
                xytext=(6, -12), fontsize=8, color=BOOK_COLORS[4])
ax.plot([], [], "o", color=BOOK_COLORS[4], markerfacecolor="none",
        label="decode matmuls at batch B (attainable)")
ax.plot([p[0] for p in att_pts], [p[1] / 1e12 for p in att_pts], "s", color=BOOK_COLORS[1],
        label="decode attention, B=1..256 (recorded)")
ax.plot(*prefill_pt[:1], prefill_pt[1] / 1e12, "D", color=BOOK_COLORS[2],
        label="prefill attention kernel (recorded)")
markers = {"workload at the bound": ("*", BOOK_COLORS[6]),
           "workload, nanovllm (measured)": ("*", BOOK_COLORS[0]),
           f"workload, transformers ({k} requests)": ("*", BOOK_COLORS[3])}
for name, (i, f) in points.items():
    ax.plot(i, f / 1e12, markers[name][0], color=markers[name][1], ms=14, label=name)
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
       ylabel="performance (TFLOP/s)", ylim=(0.05, 2000),
       title=f"Roofline of the benchmark workload, Qwen3-0.6B on {bench['device']} (recorded)")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
save_figure(fig, "11_performance_roofline")
plt.show()

# %% [markdown]
# Everything the workload does in the decode phase sits on the slanted, memory-bound part of
# the roof: the attention at 2 FLOP/byte, the matmuls up to about the batch size in FLOP/byte,
# which even at batch 256 stays left of the ridge. Only the prefill is compute-bound, and it is
# a small share of the work. The whole workload sits at about 25 FLOP/byte, far left of the
# ridge: its bound is a *bandwidth* bound. Our engine's star sits a factor of about 6.6 below
# the roof at that intensity, transformers' about 130 below.
#
# ## 4. Where the time goes
#
# ### 4.1 One decode step, from the records
#
# `python -m nanovllm.bench --decode-step` timed single decode steps of Qwen3-0.6B at context
# 1024 (chapter 07), and `python -m nanovllm.kernels.bench_decode` timed the attention kernel
# alone at the same shapes (chapter 05). Together they take one step apart:

# %%
graphs_rec = load_record("cuda_graphs_h200.json")
att_us = {r["batch"]: r["us"] for r in decode_rec["rows"]
          if r["ctx"] == 1024 and r["block_size"] == 16}
weights_ms = weight_bytes / decode_rec["copy_bytes_per_s"] * 1e3
print(f"records: {graphs_rec['device']} {graphs_rec['date']} `{graphs_rec['command']}`; "
      f"{decode_rec['device']} {decode_rec['date'][:10]} `{decode_rec['command']}`")
att_frac = {r["batch"]: r["frac_copy"] for r in decode_rec["rows"]
            if r["ctx"] == 1024 and r["block_size"] == 16}
print("batch  step ms   attention: ms per layer x 28 = ms (% of copy bw)   weights ms  rest ms")
rest_ms = {}
for r in graphs_rec["rows"]:
    b = r["batch"]
    attention_ms = qwen3.num_layers * att_us[b] / 1e3
    rest_ms[b] = r["graphs_ms"] - attention_ms - weights_ms
    print(f"{b:5d} {r['graphs_ms']:8.1f}   {att_us[b] / 1e3:21.3f} x 28 = {attention_ms:5.2f} "
          f"({att_frac[b]:4.0%}) {weights_ms:17.2f} {rest_ms[b]:8.1f}")

# %% [markdown]
# At batch 256 the step takes about 13 ms; the attention kernel accounts for 7.2 ms of it
# (0.26 ms per layer × 28 layers, at 98% of the copy bandwidth) and one read of the weights for
# 0.28 ms. The rest, 5.8 ms, is neither. At batch 1 the step takes 4.1 ms, of which attention
# and weights are half a millisecond: 3.6 ms of the same "rest". That rest is a **fixed cost
# per step** of a few milliseconds, growing slowly with the batch. What is it?
#
# It is not the scheduler or the Python that prepares the inputs, at least not at small batches. We
# can measure that part on any machine, because it does not touch the model: replace the
# model runner's forward pass by a stand-in that only prepares the step's inputs and returns
# token 0 for every sequence, and run the real scheduler, block manager and bookkeeping on the
# real workload. (The model is a tiny random one; only its config matters, and with the
# runner's forward replaced it never runs.)

# %%
def null_engine(**options) -> LLM:
    """An engine whose forward pass is skipped: inputs are prepared, every token is 0.

    Everything else (scheduler, block manager, prefix cache, bookkeeping) is the real engine.
    Per step it records (sequences, decode-only?, KV tokens attended, time in prepare).
    """
    tiny = {**json.loads((config_path("qwen3-0.6b") / "config.json").read_text()),
            "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 1,
            "vocab_size": 16384}
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(tiny))
    llm = LLM(folder, load_format="dummy", device="cpu", **options)
    runner = llm.engine.runner
    runner.step_log = []

    def prepare_only(batch):
        start = time.perf_counter()
        step = runner.prepare(batch)
        runner.step_log.append((len(batch), step.meta.num_decodes == len(batch),
                                sum(step.meta.seq_lens_k_host), time.perf_counter() - start))
        return [0 if row >= 0 else None for row in step.logit_rows]

    runner.run = prepare_only
    return llm


def run_workload(llm, work, max_tokens_cap=None):
    params = [SamplingParams(max_tokens=min(n, max_tokens_cap or n), ignore_eos=True)
              for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


# NBVAL_CHECK_OUTPUT
null = null_engine(num_kv_blocks=20_000, max_model_len=4096)
host_s, outs = run_workload(null, work)
log = null.engine.runner.step_log
stats = null.engine.stats
print(f"generated {sum(len(o.outputs[0].token_ids) for o in outs):,} tokens in "
      f"{stats.num_steps} steps: {sum(1 for s in log if s[1])} decode-only, "
      f"{sum(1 for s in log if not s[1])} with prompt tokens; preemptions: "
      f"{null.engine.scheduler.num_preemptions}")

# %% [markdown]
# The scheduler's decisions do not depend on the device, so these are exactly the steps the
# H200 ran (its KV budget was large enough that nothing was preempted there either). Now the
# host time they took here, per step, by batch size (this CPU, so the numbers are only
# indicative for the H200's host, and not checked by the tests):

# %%
# NBVAL_IGNORE_OUTPUT
print(f"whole workload without the model: {host_s:.2f} s on this CPU "
      f"({host_s / stats.num_steps * 1e3:.2f} ms per step on average)")
wall = {s.step: s.wall_time for s in stats.steps}
for lo, hi in ((1, 1), (2, 64), (65, 255), (256, 256)):
    sel = [(w, p) for (n, dec, _, p), w in zip(log, wall.values()) if dec and lo <= n <= hi]
    if sel:
        print(f"decode steps with {lo:3d}-{hi:3d} sequences: {len(sel):4d} steps, "
              f"{np.mean([w for w, _ in sel]) * 1e3:6.2f} ms per step, "
              f"of which prepare {np.mean([p for _, p in sel]) * 1e3:5.2f} ms")
host_loop_s = host_s - sum(s[3] for s in log)  # scheduling + bookkeeping, without prepare

# %% [markdown]
# Well under a millisecond per step at small batches, a few milliseconds at batch 256 on this
# (slow, shared) CPU. So the 3.6 ms "rest" at batch 1 does not come from the Python
# around the model. What remains at batch 1 is the replay of the CUDA graph itself, the LM head
# and the sampler (run eagerly after the graph), and one synchronisation to bring the token
# back. How many kernels does the graph replay? As in chapter 07, we count the non-view
# operations of one forward pass of Qwen3-0.6B's structure (with tiny widths, which do not
# change the count):
#
# %%
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm.context import attention_metadata


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view  # views change metadata only: no kernel
        return func(*args, **(kwargs or {}))


tiny_cfg = dataclasses.replace(qwen3, hidden_size=64, intermediate_size=128, num_heads=4,
                               num_kv_heads=2, head_dim=16, vocab_size=1024)
tiny_model = get_model_class(tiny_cfg.architecture)(tiny_cfg).eval()
with torch.inference_mode(), attention_metadata(None), CountOps() as count:
    tiny_model.compute_logits(tiny_model(torch.tensor([1]), torch.tensor([0])))
print(f"operations in one forward pass of {tiny_cfg.num_layers} layers: {count.n} "
      f"({count.n / tiny_cfg.num_layers:.0f} per layer)")
print(f"rest at batch 1 per operation: {rest_ms[1] * 1e3 / count.n:.1f} µs")

# %% [markdown]
# About 1,400 kernels, and the fixed rest divided among them comes to a few microseconds each:
# the order of the time a GPU needs to run even a tiny kernel after the one before it. Our best
# explanation, to be confirmed with a GPU profiler, is therefore the **number of kernels**: the
# norms, rotary embeddings, activations and residual adds are each a separate small kernel.
# Fusing them (one kernel for residual add + RMSNorm, one for q/k norm + RoPE, one for
# SiLU × up) is the next optimisation this engine needs.
#
# ### 4.2 The whole run, accounted
#
# With the exact sequence of steps from the null engine we can add up a model of the H200 run:
#
# * every decode-only step costs its bytes (weights + the KV tokens it attends) at the copy
#   bandwidth, plus the per-step "rest" measured above at the same batch size (interpolated
#   between batch 1, 64 and 256);
# * a step with prompt tokens runs eagerly, without graphs (chapter 07), so it costs at least
#   the recorded eager step time at its batch size;
# * the scheduling and bookkeeping between steps is the null engine's host time (measured on
#   this CPU, without its `prepare`, which the recorded step times already include).

# %%
# NBVAL_IGNORE_OUTPUT
batches = [r["batch"] for r in graphs_rec["rows"]]
rest = [rest_ms[b] for b in batches]
eager = [r["eager_ms"] for r in graphs_rec["rows"]]
kv_per_token = qwen3.kv_bytes_per_token(2)
model = {"bytes at the copy bandwidth": 0.0, "fixed per-step rest (graphs)": 0.0,
         "eager steps with prompt tokens": 0.0}
for n, decode_only, kv_tokens, _ in log:
    moved = (weight_bytes + kv_tokens * kv_per_token) / bandwidth
    if decode_only:
        model["bytes at the copy bandwidth"] += moved
        model["fixed per-step rest (graphs)"] += np.interp(n, batches, rest) / 1e3
    else:
        model["eager steps with prompt tokens"] += max(moved, np.interp(n, batches, eager) / 1e3)
model["scheduling + bookkeeping (this CPU)"] = host_loop_s
explained = sum(model.values())
model["not explained"] = bench["nanovllm_seconds"] - explained
for name, seconds in model.items():
    print(f"{name:38s} {seconds:6.1f} s")
print(f"{'measured on the H200':38s} {bench['nanovllm_seconds']:6.1f} s "
      f"(the model explains {explained / bench['nanovllm_seconds']:.0%})")

# %%
fig, ax = plt.subplots(figsize=(8, 2.2))
left = 0.0
for (name, seconds), color in zip(model.items(), BOOK_COLORS[:4] + ["#BBBBBB"]):
    ax.barh(0, seconds, left=left, color=color, label=f"{name}: {seconds:.1f} s")
    left += seconds
ax.axvline(bound_s, color="black", linestyle=":", label=f"bandwidth bound: {bound_s:.1f} s")
ax.set(yticks=[], xlabel="seconds", xlim=(0, left * 1.02),
       title=f"Where the {bench['nanovllm_seconds']:.1f} s of the H200 run go (a model)")
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
save_figure(fig, "11_performance_time_budget")
plt.show()

# %% [markdown]
# The model explains less than half of the measured time (the percentage printed above). The
# bytes themselves, at full bandwidth, are the bound (the blue bar is close to it: the real
# batches are nearly the optimistic "all together" schedule). The fixed per-step cost, paid on
# each of the ~1,000 decode steps, is the largest known item: the kernel count of section 4.1.
# The steps with prompt tokens, run without graphs, and the Python between steps are small. The grey
# remainder is real time we cannot place from these records; suspects are batch sizes and
# contexts the decode-step benchmark did not cover (it measured context 1024 at batch 1, 64 and
# 256 only), the eager LM head and temperature sampling (the decode-step benchmark sampled
# greedily), and variation between runs (the two recorded runs differ by a quarter). The engine
# now records every step's wall time (`llm.engine.stats.steps`, `nanovllm/engine/metrics.py`);
# saving those with the benchmark on the next GPU run would settle it.
#
# The lesson is the usual one of performance work: the kernels are at the roofline, and the
# remaining time is in everything around them. Making a single kernel faster would not move
# this benchmark; fewer kernels per step, fewer steps with prompt tokens outside graphs, and
# less host work per step would.
#
# ## 5. Tuning knobs
#
# Four options of `EngineConfig` (`nanovllm/config.py`) decide most of the performance a user
# sees:
#
# | knob | default | what it trades |
# |---|---|---|
# | `max_num_seqs` | 256 | sequences per step: throughput vs latency and KV memory |
# | `max_num_batched_tokens` | 4096 | tokens per step: prefill chunks, first-token time |
# | `block_size` | 16 | tokens per KV block: waste in last blocks, prefix granularity |
# | `gpu_memory_utilization` | 0.9 | GPU memory share; what weights leave is KV cache |
#
# We measure the first two live, on SmolLM2 with its real weights, on this machine (on a GPU,
# there). Loading an engine takes a few seconds, so we load one and change the two scheduler
# settings between runs; that is exactly what passing them to `LLM(...)` would set. Prefix
# caching is off, or the second run would find the first run's prompts in the cache. The
# workload is tiny: 4 requests of 24 prompt tokens, 4 new tokens each.

# %%
# NBVAL_IGNORE_OUTPUT
start = time.perf_counter()
llm = LLM(smollm2_path(), enable_prefix_caching=False)
print(f"SmolLM2 engine ready in {time.perf_counter() - start:.1f} s on {llm.config.device}")

# %%
rng = random.Random(0)
small_prompts = [[rng.randint(0, 10_000) for _ in range(24)] for _ in range(4)]
small_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm.generate(small_prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up


def measure(**knobs) -> dict:
    """Run the small workload with scheduler knobs set; steps, tok/s, mean time to 1st token."""
    scheduler = llm.engine.scheduler
    for name, value in knobs.items():
        setattr(scheduler, name, value)
    first_step = llm.engine.stats.num_steps
    start = time.perf_counter()
    outs = llm.generate(small_prompts, small_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {"knobs": knobs, "steps": llm.engine.stats.num_steps - first_step,
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "ttft_ms": 1e3 * sum(ttft) / len(ttft),
            "token_ids": [o.outputs[0].token_ids for o in outs]}


results = [measure(max_num_seqs=1, max_num_batched_tokens=4096),
           measure(max_num_seqs=4, max_num_batched_tokens=4096),
           measure(max_num_seqs=4, max_num_batched_tokens=24)]
for r in results:
    print(f"{r['knobs']}: {r['steps']:3d} steps")
print("same tokens under every setting:",
      all(r["token_ids"] == results[0]["token_ids"] for r in results))

# %%
# NBVAL_IGNORE_OUTPUT
for r in results:
    print(f"{str(r['knobs']):50s} {r['tok_s']:7.1f} tok/s, mean time to first token "
          f"{r['ttft_ms']:7.0f} ms")

# %% [markdown]
# Read the step counts first (they are the same on every machine). With `max_num_seqs=1`
# requests run one after another: 4 × (1 prefill + 3 decode) steps. With 4, one prefill step
# and 3 decode steps serve everyone: the weights are read once per step for all of them, which
# is the whole point of batching (chapters 03 and 06), and throughput rises accordingly.
# Because every row is computed independently, the tokens do not depend on the batch: on a CPU
# in fp32 the check above prints `True`. (On a GPU, matrix products of different shapes may
# round differently, and a rare near-tie between two tokens could flip one.) A budget of 24
# tokens per step lets the four 24-token prompts in about one per step, each step also
# carrying the decodes already running, so the batch takes more steps. On a GPU such a budget
# keeps the running requests' decode steps short while long prompts arrive (chapter 06), at the
# cost of more steps, each paying the fixed per-step cost of section 4. The timings (not
# checked) show the trade on this machine; on a shared or slow CPU they are noisy.
#
# **`block_size`** changes two things that we can compute exactly. A sequence's last block is
# partly empty, wasting on average about half a block per sequence; and prefix caching shares
# only *whole* blocks, so a shared prefix is reused up to its last full block. For the
# benchmark's 256 requests at their final lengths, and a 100-token shared system prompt:

# %%
final_lens = [p + n for p, n in zip(prompt_lens, work.output_lens)]
print("block size   KV slots allocated   wasted in last blocks   cached of a 100-token prefix")
for bs in (16, 32, 64, 128, 256):
    allocated = sum(-(-n // bs) * bs for n in final_lens)
    waste = allocated - sum(final_lens)
    print(f"{bs:10d} {allocated:20,} {waste:14,} ({waste / allocated:5.1%}) {100 // bs * bs:18d}")
by_shape = {(r["batch"], r["ctx"], r["block_size"]): r["us"] for r in decode_rec["rows"]}
diff = max(abs(by_shape[(b, c, 256)] / by_shape[(b, c, 16)] - 1)
           for b, c, size in by_shape if size == 16)
print(f"recorded H200 decode kernel, block size 256 vs 16: times differ by at most {diff:.1%}")

# %% [markdown]
# Bigger blocks waste more memory and cache less of a shared prefix; smaller blocks mean longer
# block tables and more, smaller reads for the kernel; yet the recorded H200 kernel times for
# block size 16 and 256 barely differ (printed above), and the decode kernel requires a power
# of two of at least 16: 16 is the default for good reason.
#
# **`gpu_memory_utilization`** sets how much GPU memory the engine may fill. After loading the
# weights the runner runs one forward pass of the largest step to measure the activations, and
# gives the KV cache what is left of the allowed share (`ModelRunner._kv_budget_in_blocks`):

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.model_runner import ModelRunner

show_source(ModelRunner._kv_budget_in_blocks)

# %% [markdown]
# On a CPU the budget is `kv_cache_memory` (1 GiB by default) or `num_kv_blocks`. On an H200
# (about 141 GB; we assume 1 GB of activations and that only the weights are loaded), with
# Qwen3-0.6B in bf16, the share decides how many tokens fit in the cache, and so how many of
# the benchmark's requests can run at once:

# %%
total_gb, activations_gb = 141.0, 1.0
mean_len = sum(final_lens) / len(final_lens)
for util in (0.3, 0.5, 0.9):
    free = total_gb - weight_bytes / 1e9
    budget = (free - (1 - util) * total_gb - activations_gb) * 1e9
    tokens = budget / qwen3.kv_bytes_per_token(2)
    print(f"gpu_memory_utilization {util}: {budget / 1e9:5.1f} GB of KV cache = "
          f"{tokens:9,.0f} tokens = {tokens / mean_len:5.0f} requests of the mean final length")
print(f"the benchmark's 256 requests at their final lengths: {sum(final_lens):,} tokens")

# %% [markdown]
# The benchmark used 0.5, ample for its 256 requests even at their final lengths. When the
# cache is too small, the scheduler must
# **preempt**: free a running request's blocks and recompute it later (chapter 06), which
# costs steps. The null engine shows it on the first 64 requests of the benchmark, capped at
# 128 new tokens each, with an ample and with a tight KV budget:

# %%
# NBVAL_CHECK_OUTPUT
sub = dataclasses.replace(work, prompts=work.prompts[:64], output_lens=work.output_lens[:64])
need_blocks = sum(-(-(len(p) + min(n, 128)) // 16) for p, n in zip(sub.prompts, sub.output_lens))
print(f"blocks needed if all 64 requests run at once: {need_blocks}")
for blocks in (need_blocks + 100, need_blocks // 2):
    engine_ = null_engine(num_kv_blocks=blocks, max_model_len=4096)
    run_workload(engine_, sub, max_tokens_cap=128)
    s = engine_.engine.stats
    print(f"num_kv_blocks={blocks:5d}: {s.num_steps:4d} steps, "
          f"{engine_.engine.scheduler.num_preemptions:3d} preemptions, "
          f"{s.num_prefill_tokens:,} prompt tokens computed")

# %% [markdown]
# With half the blocks it needs, the engine still finishes every request, but it preempts and
# recomputes prompts (the prompt tokens computed exceed the workload's), and takes more steps.
# On a GPU, leave `gpu_memory_utilization` high unless something else shares the GPU.
#
# ## 6. Long context: RoPE scaling
#
# A model trained on sequences of up to $L$ tokens has seen RoPE rotation angles
# $m\,\theta_i$ only for positions $m < L$ (chapter 01). Beyond $L$, the *slow* channel pairs
# (long wavelengths $2\pi/\theta_i$) reach angles never seen in training, and quality collapses.
# Long-context models rescale the frequencies. The simplest way, **linear** scaling
# (position interpolation), divides every frequency by a factor $s$: positions up to $sL$ then
# map onto angles seen in training, but nearby tokens also become harder to tell apart. Llama
# 3.1's **llama3** scaling is more careful: pairs whose wavelength is short compared with $L$
# (they cycle many times within the training length) are kept as they are; pairs whose
# wavelength is longer than $L$ are divided by $s$; in between, it blends the two smoothly. A
# model's `config.json` carries the rule in `rope_scaling` (or `rope_parameters`), and
# `nanovllm/layers/rotary.py` applies it:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.layers import rotary

show_source(rotary._llama3_scaled, rotary.rope_inverse_frequencies)

# %% [markdown]
# Llama 3.1 8B's published settings: head_dim 128, $\theta$ = 500,000, scaled by 8 from an
# original 8,192-token context (to 131,072), with low/high frequency factors 1 and 4. We compute
# the frequencies with and without scaling and check the three bands:

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.layers.rotary import rope_inverse_frequencies

llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
base = rope_inverse_frequencies(128, 500_000.0, None)
scaled = rope_inverse_frequencies(128, 500_000.0, llama3)
linear = rope_inverse_frequencies(128, 500_000.0, {"rope_type": "linear", "factor": 8.0})
wavelength = 2 * math.pi / base
old = llama3["original_max_position_embeddings"]
high = wavelength < old / llama3["high_freq_factor"]  # short wavelengths: unchanged
low = wavelength > old / llama3["low_freq_factor"]  # longer than the old context: divided by 8
mid = ~high & ~low
print(f"{int(high.sum())} fast pairs unchanged:", torch.equal(scaled[high], base[high]))
print(f"{int(low.sum())} slow pairs divided by 8:", torch.allclose(scaled[low], base[low] / 8))
ratio = (base / scaled)[mid]
print(f"{int(mid.sum())} pairs in between, scaled by factors strictly between 1 and 8:",
      bool(((ratio > 1) & (ratio < 8)).all()))
print("linear scaling divides all 64 by 8:", torch.allclose(linear, base / 8))

# %%
fig, ax = plt.subplots(figsize=(7.5, 4))
pairs = torch.arange(len(base))
for freqs, name, color, style in ((base, "no scaling", BOOK_COLORS[6], "-"),
                                  (linear, "linear, factor 8", BOOK_COLORS[1], "--"),
                                  (scaled, "llama3, factor 8", BOOK_COLORS[0], "-")):
    ax.plot(pairs, 2 * math.pi / freqs, style, color=color, label=name)
for level, text in ((old / llama3["high_freq_factor"], "old context / high_freq_factor"),
                    (old, "original context (8,192)")):
    ax.axhline(level, color="grey", linestyle=":", lw=1)
    ax.text(1, level * 1.3, text, fontsize=8, color="grey")
ax.set(yscale="log", xlabel="channel pair i", ylabel="wavelength 2π/θ_i (positions)",
       title="RoPE wavelengths of Llama 3.1 (head_dim 128, θ = 500,000)")
ax.legend(loc="upper left")
save_figure(fig, "11_performance_rope_scaling")
plt.show()

# %% [markdown]
# The fast pairs (left) keep their wavelengths, so the model still resolves nearby positions as
# in training; the slow pairs (right) are stretched eight times, so positions up to 131,072 map
# onto angles seen during training.
#
# Long contexts are also a memory and bandwidth question. A Qwen3-0.6B token occupies
# `kv_bytes_per_token` bytes of cache; a decode step of a sequence must read all of them:

# %%
for ctx in (8_192, 32_768, 131_072):
    kv = ctx * qwen3.kv_bytes_per_token(2)
    print(f"context {ctx:7,}: {kv / 1e9:6.2f} GB of KV cache per sequence; reading it takes "
          f"{kv / bandwidth * 1e3:5.2f} ms per decode step at {bandwidth / 1e12:.2f} TB/s")

# %% [markdown]
# At 131k tokens one sequence's cache is 15 GB and a single decode step of that sequence needs
# almost 4 ms of the H200's bandwidth: long-context serving is bandwidth-bound attention, and
# the place for KV-cache quantization (chapter 08) and split-KV (chapter 05).
#
# ## 7. Run the benchmark yourself
#
# `python -m nanovllm.bench` (or `make bench BENCH_ARGS="..."`) picks its defaults from the
# device: on a CPU, SmolLM2 with its real weights and the small `cpu` workload; on a GPU,
# Qwen3-0.6B with random weights and the nano-vllm workload.

# %%
cpu_work = make_workload("cpu")
print(f"cpu workload: {len(cpu_work.prompts)} requests, {sum(map(len, cpu_work.prompts)):,} "
      f"prompt tokens, {cpu_work.output_tokens:,} output tokens")
print()
print("on a CPU (a few minutes):")
print("  python -m nanovllm.bench                   # SmolLM2, cpu workload")
print("  python -m nanovllm.bench --peer hf         # + transformers' padded generate")
print("on a GPU:")
print(f"  {bench['command'].replace(' --out /root/out/bench_h200.json', ' --out bench.json')}")
print(f"  {graphs_rec['command']} --out cuda_graphs.json")
print(f"  {decode_rec['command'].replace('/root/out/', '')}")
print("options: --enforce-eager (no CUDA graphs), --max-num-seqs N, --max-num-batched-tokens N,")
print("         --num-requests N, --workload {nano-vllm,cpu}, --model PATH_OR_SHIPPED_CONFIG")

# %% [markdown]
# On a GPU, this cell runs a short version live: the first 32 requests of the nano-vllm
# workload, capped at 128 new tokens, on Qwen3-0.6B with random weights, and reports the
# fraction of the bandwidth bound it reaches on your GPU.

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    from nanovllm.bench import copy_bandwidth, free, run_nanovllm

    short = dataclasses.replace(work, prompts=work.prompts[:32],
                                output_lens=[min(n, 128) for n in work.output_lens[:32]])
    seconds, gpu_llm = run_nanovllm(str(config_path("qwen3-0.6b")), "dummy", short)
    bw = copy_bandwidth("cuda")
    bound = bandwidth_bound_seconds(short, qwen3, weight_bytes, 2, bw)
    print(f"{torch.cuda.get_device_name()}: {short.output_tokens / seconds:,.0f} tok/s, "
          f"{bound / seconds:.0%} of the bandwidth bound ({bw / 1e12:.2f} TB/s copy)")
    free(gpu_llm)
else:
    print("no GPU here: the recorded H200 results above stand in for a live run")

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — the bandwidth bound.** Write `bound_seconds(prompt_lens, output_lens,
# kv_bytes_per_token, weight_bytes, bandwidth)`: the least time to run a workload if every
# decode step reads all weights once and each sequence's whole KV cache so far, with all
# requests decoding together (section 2).

# %% tags=["exercise"]
def bound_seconds(prompt_lens, output_lens, kv_bytes_per_token, weight_bytes, bandwidth):
    """Bandwidth-bound seconds of a workload (weights once per step, all KV reads)."""
    # BEGIN SOLUTION
    reads = sum(p * n + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens))
    return (reads * kv_bytes_per_token + max(output_lens) * weight_bytes) / bandwidth
    # END SOLUTION


# %% tags=["check"]
import math
import random

from nanovllm.bench import Workload, bandwidth_bound_seconds
from nanovllm.configs import config_path
from nanovllm.models import ModelConfig

rng = random.Random(1101)
cfg = ModelConfig.from_pretrained(config_path("qwen3-0.6b"))
for _ in range(5):
    n = rng.randint(1, 50)
    prompts = [[0] * rng.randint(1, 2000) for _ in range(n)]
    outs = [rng.randint(1, 2000) for _ in range(n)]
    wbytes, bw, elem = rng.randint(10**8, 10**10), rng.uniform(1e11, 5e12), rng.choice([1, 2, 4])
    expected = bandwidth_bound_seconds(Workload(prompts, outs), cfg, wbytes, elem, bw)
    got = bound_seconds([len(p) for p in prompts], outs, cfg.kv_bytes_per_token(elem), wbytes, bw)
    assert math.isclose(got, expected, rel_tol=1e-12), f"{got} != {expected}"
print("Exercise 1 passed: bound_seconds equals nanovllm.bench.bandwidth_bound_seconds")

# %% [markdown]
# **Exercise 2 — llama3 RoPE scaling.** Write `llama3_inv_freq(inv_freq, factor, low_freq_factor,
# high_freq_factor, original_max_positions)`: keep the frequencies whose wavelength
# $2\pi/\theta$ is below `original / high_freq_factor`, divide by `factor` those whose
# wavelength is above `original / low_freq_factor`, and in between blend
# $(1-\sigma)\,\theta/\text{factor} + \sigma\,\theta$ with
# $\sigma = (\text{original}/\text{wavelength} - \text{low}) / (\text{high} - \text{low})$.

# %% tags=["exercise"]
import math

import torch


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_positions):
    """Llama 3.1's rescaling of RoPE inverse frequencies."""
    # BEGIN SOLUTION
    wavelength = 2 * math.pi / inv_freq
    sigma = (original_max_positions / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = (1 - sigma) * inv_freq / factor + sigma * inv_freq
    out = torch.where(wavelength > original_max_positions / low_freq_factor,
                      inv_freq / factor, blended)
    return torch.where(wavelength < original_max_positions / high_freq_factor, inv_freq, out)
    # END SOLUTION


# %% tags=["check"]
import torch

from nanovllm.layers.rotary import rope_inverse_frequencies

for head_dim, theta, factor, low, high, old in [(128, 500_000.0, 8.0, 1.0, 4.0, 8192),
                                                (64, 10_000.0, 4.0, 1.0, 4.0, 2048),
                                                (128, 1e6, 32.0, 2.0, 8.0, 4096)]:
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old}
    base = rope_inverse_frequencies(head_dim, theta, None)
    expected = rope_inverse_frequencies(head_dim, theta, scaling)
    got = llama3_inv_freq(base, factor, low, high, old)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
print("Exercise 2 passed: llama3_inv_freq matches nanovllm.layers.rotary")

# %% [markdown]
# **Exercise 3 — how many requests fit?** Write `max_concurrent(num_kv_blocks, block_size,
# seq_len)`: how many sequences of `seq_len` tokens can hold their KV cache at once in a
# cache of `num_kv_blocks` blocks of `block_size` tokens (no prefix sharing). The check fills
# the package's block manager until it refuses.

# %% tags=["exercise"]
def max_concurrent(num_kv_blocks: int, block_size: int, seq_len: int) -> int:
    """Sequences of seq_len tokens that fit in num_kv_blocks blocks of block_size tokens."""
    # BEGIN SOLUTION
    return num_kv_blocks // -(-seq_len // block_size)
    # END SOLUTION


# %% tags=["check"]
import random

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence

rng = random.Random(1103)
for _ in range(6):
    blocks, bs, length = rng.randint(1, 300), rng.choice([16, 32, 256]), rng.randint(1, 700)
    manager = BlockManager(blocks, bs, enable_prefix_caching=False)
    fitted = 0
    while manager.allocate(Sequence(list(range(length)), SamplingParams()), length):
        fitted += 1
    got = max_concurrent(blocks, bs, length)
    assert got == fitted, f"{blocks} blocks of {bs}, length {length}: {got} != {fitted}"
print("Exercise 3 passed: max_concurrent agrees with nanovllm's BlockManager")

# %% [markdown]
# ## Summary
#
# - On the nano-vllm workload (256 requests, 133,966 output tokens), the engine produced about
#   5,500 tok/s on an H200 with Qwen3-0.6B, about 17 times transformers' continuous batching on
#   equal work (recorded).
# - The **bandwidth bound** — weights once per step plus every KV read, at the measured copy
#   bandwidth — is 3.7 s (about 36,000 tok/s): we run at about 15% of it. The workload sits at
#   about 25 FLOP/byte, far below the H200's ridge: decode is a bandwidth problem.
# - The kernels are not the gap: the attention kernel runs at the roofline. A decode step
#   carries a fixed cost of 3.6–5.8 ms beyond its bytes, not explained by the Python around the
#   model (a null-model run of the real scheduler costs a fraction of a millisecond per small
#   step); the likeliest cause is the ~1,400 small kernels per step, and the cure kernel fusion.
#   Part of the measured time remains unexplained by the records; per-step statistics on the
#   next GPU run will settle it.
# - Knobs: `max_num_seqs` (batching: throughput), `max_num_batched_tokens` (prefill chunking:
#   latency vs steps), `block_size` (memory waste and prefix granularity; 16 is right),
#   `gpu_memory_utilization` (KV capacity; too little means preemption and recomputation).
# - Long context: llama3 RoPE scaling keeps fast frequencies, stretches slow ones; and every
#   long sequence is gigabytes of KV cache read at every step.

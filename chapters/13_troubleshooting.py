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
# # Chapter 13 — Troubleshooting
#
# The engine of this book works; the engine *you* extend may not. People who run or extend an
# inference engine meet the same few problems again and again: KV memory that leaks because a
# finished request's blocks are never freed; tensors that keep autograd graphs alive; positions
# beyond the length the model was trained on; and tuning advice that sounds right but is not
# for this design (a batch-wait timeout, defragmenting the block pool). This chapter takes them
# one at a time: **reproduce** the problem, **see** it with the engine's own tools, **fix** it,
# and measure, in cells, what each costs. It ends with the deployments this project measured
# and, in one table, the claims commonly made about engines like this one, each with what the
# book measured and where (section 9).
#
# **Why a chapter of its own.** These problems cut across the book: the leak lives in the block
# manager (chapter 04) but is made by whoever changes the scheduler (chapter 06) or the server
# (chapter 10); autograd belongs to the model runner; the length guard to the input processor;
# the tuning questions to chapters 06 and 11. An appendix of chapter 11 would hide them in the
# chapter about speed, while most of them are about correctness and sizing; and they need the
# whole engine, so they come after every component. It is also where the course's extension
# work goes wrong, so it ships a tool, the leak check, and an assignment to write its core.
#
# Package modules used: `nanovllm/engine/invariants.py` (the leak check: `check_invariants`,
# `checked_steps`, `InvariantError`; `LLMEngine.check_invariants()` calls it), the block
# manager and scheduler (chapters 04 and 06), `nanovllm/engine/model_runner.py` (the
# `inference_mode` guard), `nanovllm/engine/kv_cache.py` (the KV budget),
# `nanovllm/engine/input_processor.py` (the
# `max_model_len` guard), and the records in `figures/data/`. The GPU memory record is made by
# `tests/gpu/troubleshooting_h200.py` (stage `troubleshooting` of `tests/gpu/h200_session.sh`).
#
# Everything here runs on a 2-core CPU (its time: the book's runtime table), on SmolLM2-135M
# in fp32.

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(13)

# %% [markdown]
# ## Setup

# %%
import inspect
import json
import math
import random
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import nanovllm
from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.context import attention_metadata
from nanovllm.engine import invariants
from nanovllm.engine.invariants import InvariantError, check_invariants
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import SchedulerOutput
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.models import ModelConfig
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style

torch.set_num_threads(1)  # tiny matmuls on two shared cores run faster without OpenMP threads
use_book_style()
DATA = figures_dir() / "data"
SMOLLM2 = smollm2_path()
chapter_start = time.perf_counter()


# Token ids of real text (the book's Alice excerpt), cut into prompts of varied lengths that
# share a 16-token opening, so that the prefix cache has something to find.
llm = LLM(SMOLLM2, device="cpu", dtype="float32", num_kv_blocks=40, max_num_batched_tokens=256)
engine = llm.engine
text = (Path(nanovllm.__file__).parent / "data/alice_in_wonderland_ch1-2.txt").read_text()
corpus = engine.tokenizer.encode(text)[:4000]
rng = random.Random(13)
PROMPTS = [corpus[:16] + corpus[100 + 37 * i: 100 + 37 * i + rng.randrange(8, 40)]
           for i in range(30)]
print(f"{len(PROMPTS)} prompts of {min(map(len, PROMPTS))}-{max(map(len, PROMPTS))} tokens; "
      f"KV cache: {engine.block_manager.num_blocks} blocks of {engine.config.block_size} tokens")

# %% [markdown]
# ## 1. The leak check
#
# A block of the KV cache (chapter 04) is either free, in the free list with reference count
# 0, or held: its reference count is the number of sequences whose block table lists it
# (several, when a prefix is shared). A request that ends must give its blocks back. If one
# path forgets, nothing crashes: the blocks stay counted as held, the free list shrinks, fewer
# requests fit, throughput sinks, and finally a request that needs more blocks than remain
# waits forever. Nothing in the symptoms points at the line that forgot.
#
# What the engine knows between two steps is enough to find it. The leak check verifies, from
# the engine's state alone:
#
# 1. every block is free or held, never both;
# 2. each block's reference count equals the number of live requests whose table holds it
#    (waiting, running, or retired with a token in flight);
# 3. no finished or aborted request holds a block;
# 4. the prefix-cache index agrees with the blocks (each indexed hash names a full block that
#    carries it; a live request's cached blocks hold its own tokens under its chained hashes).
#
# The heart of it is the comparison of reference counts with holders:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(invariants.check_refcounts)

# %% [markdown]
# `check_invariants(engine)` gathers the live requests, adds the other checks and raises
# `InvariantError` listing every violation with request and block ids. To name a request that
# has already left the engine (the one that leaked), it remembers the requests it saw alive
# at its previous call. `checked_steps(engine)` runs it after every step of one engine;
# `LLMEngine.check_invariants()` is the same check as a method. The test suite runs it after
# every step of every engine (`tests/conftest.py`; `NANOVLLM_CHECK_INVARIANTS=0` turns it off).

# %%
# NBVAL_IGNORE_OUTPUT
show_source(invariants.check_invariants, invariants.checked_steps)

# %% [markdown]
# ## 2. A leaky extension, caught
#
# Here is a plausible change to the scheduler: a faster `finish` that handles aborts itself
# (say, to log them) and forgets the one line that frees the blocks. We run the same workload
# on the correct engine and on the leaky one: 30 requests, two arriving per step, every third
# one aborted by its client two steps after it arrived (a user closing the tab), 40 blocks of
# KV cache. After every step we record the KV usage and run the leak check.

# %%
class ForgetfulScheduler(Scheduler):
    """Finishes aborted requests itself, and forgets to free their blocks."""

    def finish(self, seq: Sequence, reason: str) -> None:
        if reason != "abort":
            return super().finish(seq, reason)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # missing: self.block_manager.free(seq)


def run_workload(engine, max_steps: int = 60) -> dict:
    """Two arrivals per step, every third request aborted two steps after arriving; the KV
    usage after each step, and the first problem the leak check reported."""
    usage, live, first_problem, step = [], [], None, 0
    for step in range(max_steps):
        for i in (2 * step, 2 * step + 1):
            if i < len(PROMPTS):
                engine.add_request(f"req-{i}", PROMPTS[i], SamplingParams(
                    temperature=0, max_tokens=12, ignore_eos=True))
        doomed = [f"req-{i}" for i in (2 * step - 4, 2 * step - 3) if i >= 0 and i % 3 == 0]
        engine.abort_request(doomed)
        engine.step()
        usage.append(engine.block_manager.usage)
        live.append(len(engine.requests))
        try:
            check_invariants(engine)
        except InvariantError as err:
            first_problem = first_problem or (step, err.problems)
        if 2 * step >= len(PROMPTS) and not engine.has_unfinished_requests():
            break
    return {"usage": usage, "live": live, "problem": first_problem, "steps": step + 1}


def fresh_engine(scheduler_class=Scheduler):
    e = LLM(SMOLLM2, device="cpu", dtype="float32", num_kv_blocks=40,
            max_num_batched_tokens=256).engine
    e.scheduler = scheduler_class(e.config, e.block_manager)
    return e


start = time.perf_counter()
good = run_workload(fresh_engine())
leaky_engine = fresh_engine(ForgetfulScheduler)
leaky = run_workload(leaky_engine)
leak_seconds = time.perf_counter() - start

# %%
# NBVAL_CHECK_OUTPUT
print(f"correct engine: {good['steps']} steps, leak check silent: {good['problem'] is None}, "
      f"KV usage at the end: {good['usage'][-1]:.0%}")
step, problems = leaky["problem"]
print(f"leaky engine: the leak check fired after step {step + 1}:")
for p in problems[:4]:
    print("  -", p)
print(f"  ... ({len(problems)} problems in all)")
bm_leaky = leaky_engine.block_manager
lost = bm_leaky.num_blocks - bm_leaky.num_free_blocks
print(f"after {leaky['steps']} steps the leaky engine has {len(leaky_engine.requests)} live "
      f"requests, yet {lost} of its {bm_leaky.num_blocks} blocks stay held: "
      f"{lost / (len(PROMPTS) // 3):.1f} blocks lost per abort")

# %% [markdown]
# The correct engine ends with every block free. The leaky one is caught after the first
# abort, by name: the request that left, what it kept, and each block whose count no longer
# matches its holders (block 0, the shared opening, is over-counted by one: the aborted
# request's reference). Unchecked, the same bug shows only as KV usage that never comes back
# down: each abort shrinks the cache for good, fewer requests fit at once, and a server that
# runs long enough reaches the point where no request fits and everything waits. Figure 13.1
# shows both runs.

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.6))
ax.plot(np.arange(1, len(good["usage"]) + 1), np.array(good["usage"]) * 100,
        label="correct scheduler", color=BOOK_COLORS[0])
ax.plot(np.arange(1, len(leaky["usage"]) + 1), np.array(leaky["usage"]) * 100,
        label="scheduler that forgets to free on abort", color=BOOK_COLORS[3])
ax.axvline(leaky["problem"][0] + 1, color=BOOK_COLORS[3], ls=":", lw=1)
ax.annotate("leak check fires", (leaky["problem"][0] + 1.5, 8), color=BOOK_COLORS[3])
ax.set_xlabel("engine step")
ax.set_ylabel("KV blocks held (%)")
ax.set_ylim(0, 105)
ax.set_title("A KV leak: usage over time, SmolLM2 on CPU, 40 blocks")
ax.legend(loc="center right")
figure(fig, "13_troubleshooting_kv_leak",
       "The share of KV blocks held after each engine step (SmolLM2 on a CPU, a small cache) for"
       " the correct scheduler and for one that forgets to free an aborted request's blocks; the"
       " dotted line marks the step where the engine's leak check fires.")

# %% [markdown]
# The fix is the line that was missing; the check then stays silent (the correct run above).
# How expensive is the check? It walks every block and every live request's table and hashes
# the cached blocks again, so it grows with the cache and the tokens in flight. Timed on the
# engine of this chapter, against the step it follows:

# %%
# NBVAL_IGNORE_OUTPUT
e = fresh_engine()
for i, prompt in enumerate(PROMPTS[:8]):
    e.add_request(f"t{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
step_s, check_s = [], []
while e.has_unfinished_requests():
    t0 = time.perf_counter()
    e.step()
    t1 = time.perf_counter()
    check_invariants(e)
    step_s.append(t1 - t0)
    check_s.append(time.perf_counter() - t1)
print(f"step {statistics.median(step_s) * 1e3:.1f} ms, leak check "
      f"{statistics.median(check_s) * 1e3:.3f} ms (median of {len(step_s)} steps)")

# %% [markdown]
# Cheap enough for every test (the suite runs it after every step), and off by default in
# production, where a step is milliseconds on a GPU and the check, written in Python, would
# grow with thousands of blocks.
#
# ## 3. Autograd left on
#
# PyTorch records a graph for backpropagation whenever a tensor that requires grad takes part
# in an operation, and keeps every tensor the backward pass would need alive as long as the
# result lives. An engine never calls `backward()`, so all of that is waste. In this engine
# the linear layers' weights have `requires_grad=False`, but not every parameter does (the
# norms' weights are plain `nn.Parameter`s): an extension that calls the model outside the
# engine's step, e.g. a scoring helper, builds a graph without noticing.
#
# We run one prefill forward of 128 tokens of SmolLM2 through the package's model, with
# autograd on and under `torch.inference_mode()`, and count the bytes autograd saves for
# backward (a hook on saved tensors sees each one):

# %%
def saved_for_backward(run) -> tuple[int, torch.Tensor, float]:
    """Bytes of the tensors autograd saved while ``run()`` ran, its result, seconds."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
    return sum(saved), out, seconds


# A separate engine: with autograd on, its cache writes join the graph too.
grad_llm = LLM(SMOLLM2, device="cpu", dtype="float32", num_kv_blocks=40,
               enable_prefix_caching=False)
runner, bm = grad_llm.engine.runner, grad_llm.engine.block_manager
N = 128
seq = grad_llm.engine.make_sequence(corpus[:N], SamplingParams(max_tokens=1))
assert bm.allocate(seq, N)
step_inputs = runner.prepare(SchedulerOutput([seq], [N]))


def forward():
    with attention_metadata(step_inputs.meta):
        return runner.model(step_inputs.input_ids, step_inputs.positions)


results = {}
for mode in ("autograd on", "inference_mode"):
    context = torch.enable_grad() if mode == "autograd on" else torch.inference_mode()
    times = []
    for _ in range(2):
        with context:
            nbytes, hidden, seconds = saved_for_backward(forward)
        times.append(seconds)
    results[mode] = {"saved_bytes": nbytes, "requires_grad": hidden.requires_grad,
                     "seconds": min(times)}
    del hidden

# %%
# NBVAL_CHECK_OUTPUT
cfg = grad_llm.engine.model_config
for mode, r in results.items():
    print(f"{mode:15s} output requires grad: {str(r['requires_grad']):5s} "
          f"saved for backward: {r['saved_bytes'] / 2**20:7.1f} MiB")
kv_per_token = cfg.kv_bytes_per_token(4)
ratio = results["autograd on"]["saved_bytes"] / (N * kv_per_token)
print(f"that is {results['autograd on']['saved_bytes'] / N / 1024:.0f} KiB per token, "
      f"{ratio:.0f}x the {kv_per_token / 1024:.0f} KiB of KV cache per token")

# %%
# NBVAL_IGNORE_OUTPUT
for mode, r in results.items():
    print(f"{mode:15s} {r['seconds'] * 1e3:7.1f} ms per forward of {N} tokens (best of 2)")
slower = results["autograd on"]["seconds"] / results["inference_mode"]["seconds"] - 1
print(f"autograd on: {slower:+.0%} time")

# %% [markdown]
# With autograd on, each forward keeps tens of times more memory alive than the KV cache it
# fills, for as long as any output survives: keep the logits of a few hundred steps in a list
# and the graphs behind them fill the device. The time costs less than the memory, since
# recording the graph is bookkeeping, but it is not free either.
#
# **The engine's guard.** `ModelRunner.launch`, the one place a step runs the model, is
# decorated with `@torch.inference_mode()`, so a step builds no graph whatever the caller's
# autograd mode; inference tensors cannot even be saved for backward by mistake later.
# `tests/test_invariants.py::test_no_step_tensor_requires_grad` holds it: it hooks every
# module of the model, runs `generate` inside `torch.enable_grad()`, and asserts that no
# output of any module requires grad and that all are inference tensors.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.engine.model_runner import ModelRunner

print("ModelRunner.launch runs under inference_mode:",
      "@torch.inference_mode()" in inspect.getsource(ModelRunner.launch))
seen = []
hook = runner.model.register_forward_hook(lambda m, a, out: seen.append(out.requires_grad))
with torch.enable_grad():
    grad_llm.generate([corpus[:20]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
hook.remove()
print(f"generate() inside torch.enable_grad(): {len(seen)} forward passes, any output requiring "
      f"grad: {any(seen)}")
bm.free(seq)
del grad_llm, runner, step_inputs

# %% [markdown]
# ## 4. Positions beyond the trained length
#
# A model is trained on sequences up to some length, `max_position_embeddings` in its config
# (8192 for SmolLM2). Nothing in the arithmetic stops at that length: RoPE (chapter 01) simply
# rotates by larger angles. But past it the model meets rotations it never saw. The slowest
# of RoPE's frequencies shows it best: within the trained length it turns by less than a full
# circle, so every angle it takes later is new.

# %%
# NBVAL_CHECK_OUTPUT
cfg = ModelConfig.from_pretrained(SMOLLM2)
slowest = cfg.rope_theta ** (-(cfg.head_dim - 2) / cfg.head_dim)  # radians per position
trained = cfg.max_position_embeddings
print(f"SmolLM2: rope_theta {cfg.rope_theta:g}, head_dim {cfg.head_dim}, trained length "
      f"{trained}")
for n in (trained, 2 * trained, 4 * trained):
    print(f"position {n:6d}: the slowest pair has turned {slowest * n:.3f} rad "
          f"({slowest * n / (2 * math.pi):.1%} of a turn)")

# %% [markdown]
# So the engine refuses to go there. `max_model_len` defaults to the model's trained length
# (capped at 8192) and may not exceed it; a prompt must leave room for one new token; and a
# request stops with `finish_reason="length"` when it reaches the limit, whatever its
# `max_tokens`. All three, with the errors a user sees:

# %%
# NBVAL_CHECK_OUTPUT
try:
    LLM(SMOLLM2, device="cpu", max_model_len=2 * trained)
except ValueError as err:
    print("LLM(max_model_len=16384):", err)
try:
    engine.add_request("too-long", corpus[:1] * trained, SamplingParams(max_tokens=1))
except ValueError as err:
    print("a prompt of 8192 tokens:", err)
short = LLM(SMOLLM2, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64)
out = short.generate([corpus[:60]], SamplingParams(temperature=0, max_tokens=100),
                     use_tqdm=False)[0]
print(f"max_model_len=64, a 60-token prompt asking for 100 tokens: got "
      f"{len(out.token_ids)} tokens, finish_reason={out.outputs[0].finish_reason!r}")
del short

# %% [markdown]
# To serve contexts longer than the training, the model itself must be stretched: RoPE scaling
# (linear interpolation, NTK-aware and YaRN, Llama 3's frequency-dependent scaling) rescales
# the frequencies so that long positions map onto angles the model knows. Chapter 12 (long
# context) builds them; a checkpoint that declares `rope_scaling` in its config raises its
# `max_position_embeddings` accordingly, and the guard above moves with it.
#
# ## 5. Why paging needs no defragmentation
#
# Operating-system advice carries over badly. A contiguous allocator, one region per request,
# suffers **external fragmentation**: after requests of different sizes come and go, the free
# memory is split into holes, and a new request may find enough free memory in total but no
# hole big enough. The cure there is to compact (move live regions together). A paged cache
# has nothing to compact: any free block can take any request's next tokens, since the block
# table maps a sequence's positions to blocks anywhere (chapter 04). What remains is
# **internal** waste, the unused slots of each sequence's last, partly filled block: at most
# `block_size - 1` per sequence.
#
# First, small: the same random trace of requests arriving and leaving, served by a first-fit
# contiguous allocator and by a paged one of the same size. We count the requests refused
# although enough memory was free in total.

# %%
def first_fit(holes: list[tuple[int, int]], size: int) -> int | None:
    """Offset of the first hole (start, length) that holds ``size`` slots, or None."""
    return next((start for start, length in holes if length >= size), None)


def free_holes(used: dict, capacity: int) -> list[tuple[int, int]]:
    holes, pos = [], 0
    for start, size in sorted(used.values()):
        if start > pos:
            holes.append((pos, start - pos))
        pos = start + size
    return holes + ([(pos, capacity - pos)] if pos < capacity else [])


def replay(capacity: int, block_size: int, steps: int = 3000, seed: int = 0) -> dict:
    """Requests of 20-400 tokens arrive and leave at random; both allocators see the same
    trace. A refused request is dropped (and counted)."""
    rng = random.Random(seed)
    contiguous: dict[int, tuple[int, int]] = {}  # request -> (start, size)
    paged: dict[int, int] = {}  # request -> blocks
    refused = {"contiguous": 0, "contiguous, enough free in total": 0, "paged": 0}
    for t in range(steps):
        if rng.random() < 0.5 and (contiguous or paged):  # a request leaves
            victim = rng.choice(sorted(set(contiguous) | set(paged)))
            contiguous.pop(victim, None)
            paged.pop(victim, None)
            continue
        size = rng.randrange(20, 400)
        start = first_fit(free_holes(contiguous, capacity), size)
        if start is None:
            refused["contiguous"] += 1
            free = capacity - sum(s for _, s in contiguous.values())
            refused["contiguous, enough free in total"] += free >= size
        else:
            contiguous[t] = (start, size)
        blocks = -(-size // block_size)
        if capacity // block_size - sum(paged.values()) >= blocks:
            paged[t] = blocks
        else:
            refused["paged"] += 1
    return refused


# %%
# NBVAL_CHECK_OUTPUT
refused = replay(capacity=4096, block_size=16)
for kind, n in refused.items():
    print(f"refused ({kind}): {n}")

# %% [markdown]
# Almost every refusal of the contiguous allocator happened with enough memory free in
# total, scattered in holes too small: that is external fragmentation, and compaction is its
# cure. The paged allocator refuses a request only when its free blocks cannot hold it, that is
# when the memory is really in use (the two counts differ also because each allocator, having
# refused different requests, holds a different set). There is nothing to defragment.
#
# Now the real engine: on the correct run of section 2's workload we measure, after every
# step, the internal waste of each live sequence, the slots its table holds minus the tokens
# whose keys and values are in them, against the bound of `block_size - 1` per sequence
# (Figure 13.2).

# %%
e = fresh_engine()
bs = e.config.block_size
waste, bound, worst = [], [], 0
for i, prompt in enumerate(PROMPTS):
    e.add_request(f"w{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
while e.has_unfinished_requests():
    e.step()
    per_seq = [len(s.block_table) * bs - s.num_computed_tokens
               for s in e.requests.values() if s.block_table]
    waste.append(sum(per_seq))
    bound.append(len(per_seq) * (bs - 1))
    worst = max([worst, *per_seq])

# %%
# NBVAL_CHECK_OUTPUT
print(f"{len(waste)} steps; the most any sequence wasted: {worst} slots (bound {bs - 1}); "
      f"total waste within the bound at every step: {all(w <= b for w, b in zip(waste, bound))}")

# %%
# NBVAL_IGNORE_OUTPUT
slots = e.block_manager.num_blocks * bs
print(f"mean internal waste {statistics.mean(waste):.0f} slots of {slots} "
      f"({statistics.mean(waste) / slots:.1%} of the cache)")

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.4))
steps = np.arange(1, len(waste) + 1)
ax.plot(steps, bound, color=BOOK_COLORS[1], ls="--",
        label="bound: (block_size − 1) × live sequences")
ax.plot(steps, waste, color=BOOK_COLORS[0], label="measured internal waste")
ax.set_xlabel("engine step")
ax.set_ylabel("KV slots allocated but unused")
ax.set_title(f"Internal waste of the paged cache, SmolLM2 on CPU, block_size {bs}")
ax.legend()
figure(fig, "13_troubleshooting_internal_waste",
       "The KV slots allocated but not yet written (internal waste) after each engine step of"
       f" section 2's workload (SmolLM2, block_size {bs}), against its bound, block_size - 1"
       " slots per live sequence.")

# %% [markdown]
# ## 6. Why continuous batching needs no batch-wait timeout
#
# Servers that batch whole requests (static batching, chapter 06) wait a little before
# starting a batch, so that more requests join it: a batch-wait timeout. With continuous
# batching a request that arrives joins the very next step, however many are already running,
# so waiting only delays it. We measure it at two loads, light (6 requests, one every 500 ms:
# the engine is idle when each arrives) and heavy (10 requests, one every 40 ms: faster than
# this CPU serves them), each served once as they come and once with an artificial admission
# wait of 50 ms (arrivals are held until 50 ms after the first of them, then admitted
# together). Time to first token (TTFT) counts from the true arrival; prefix caching is off, so
# that no run profits from the prompts an earlier run cached.

# %%
def serve(engine, prompts, gap: float, wait: float) -> dict:
    """Real time: request i arrives at i * gap seconds; with ``wait`` > 0 arrivals are held
    until ``wait`` after the first held one. Returns TTFTs and throughput."""
    arrival = {f"s{i}": i * gap for i in range(len(prompts))}
    held, first_token, tokens, pending = [], {}, {}, list(arrival)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    t0 = time.perf_counter()
    while pending or held or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and arrival[pending[0]] <= now:
            held.append(pending.pop(0))
        if held and now >= arrival[held[0]] + wait:
            for rid in held:
                engine.add_request(rid, prompts[int(rid[1:])], params)
            held = []
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids:
                    first_token.setdefault(out.request_id, time.perf_counter() - t0)
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        else:  # idle: sleep until the next arrival or release
            nxt = [arrival[pending[0]]] if pending else []
            nxt += [arrival[held[0]] + wait] if held else []
            time.sleep(max(0.0, min(nxt) - (time.perf_counter() - t0)) if nxt else 0)
    makespan = time.perf_counter() - t0
    ttft = [first_token[r] - arrival[r] for r in arrival]
    return {"ttft": ttft, "tok_s": sum(map(len, tokens.values())) / makespan,
            "tokens": [tokens[r] for r in arrival]}


LOADS = {"light": (6, 0.5), "heavy": (10, 0.04)}  # requests, seconds between arrivals
e = LLM(SMOLLM2, device="cpu", dtype="float32", num_kv_blocks=40, max_num_batched_tokens=256,
        enable_prefix_caching=False).engine
serve(e, PROMPTS[:2], 0.0, 0.0)  # warm-up
served = {(load, wait): serve(e, PROMPTS[:n], gap=gap, wait=wait)
          for load, (n, gap) in LOADS.items() for wait in (0.0, 0.05)}

# %%
# NBVAL_IGNORE_OUTPUT
for (load, wait), r in served.items():
    print(f"{load:5s} load, admission wait {wait * 1e3:2.0f} ms: TTFT mean "
          f"{statistics.mean(r['ttft']) * 1e3:6.1f} ms, p90 {np.percentile(r['ttft'], 90) * 1e3:6.1f}"
          f" ms; throughput {r['tok_s']:.1f} output tok/s")
for load in LOADS:
    no_wait, wait = served[load, 0.0], served[load, 0.05]
    delta = statistics.mean(wait["ttft"]) - statistics.mean(no_wait["ttft"])
    print(f"{load} load: the wait changed the mean TTFT by {delta * 1e3:+.0f} ms and throughput "
          f"by {wait['tok_s'] / no_wait['tok_s'] - 1:+.0%}; same tokens: "
          f"{wait['tokens'] == no_wait['tokens']}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
for ax, (load, (n, gap)) in zip(axes, LOADS.items()):
    for k, wait in enumerate((0.0, 0.05)):
        ttft = np.array(served[load, wait]["ttft"]) * 1e3
        ax.plot(np.arange(1, n + 1), ttft, "o-", ms=4, color=BOOK_COLORS[k],
                label=f"admission wait {wait * 1e3:.0f} ms")
    ax.set_xlabel(f"request (arrival order, one every {gap * 1e3:.0f} ms)")
    ax.set_title(f"{load} load, SmolLM2 on CPU")
    ax.set_ylim(bottom=0)
axes[0].set_ylabel("time to first token (ms)")
axes[0].legend()
figure(fig, "13_troubleshooting_batch_wait",
       f"Time to first token of each request (SmolLM2 on a CPU) at {' and '.join(LOADS)} load,"
       " admitted as it arrives and held by a 50 ms admission wait. Look at how much the wait"
       " adds at light load, where the engine was idle anyway.")

# %% [markdown]
# In Figure 13.3, at light load each request finds the engine idle, and the wait adds itself to its
# TTFT, nearly in full: nothing was gained by waiting, since there was no one to wait for. At heavy
# load the outcome is noisier: the steps on this CPU last longer than the wait, so a held request
# may have had to wait for the running step anyway (the wait then hides in it), or it may miss a
# step it would have joined and pay more than the wait. What could a wait buy? Bigger batches, hence
# throughput. But the engine's batch grows by itself while requests run, since every step admits
# whoever has arrived, so the throughput does not improve with the wait beyond the run-to-run noise
# of this shared machine. (On a GPU, where a decode step takes milliseconds, 50 ms is many steps:
# there the wait is pure delay.) The knobs that do shape batches here are the token budget per step
# and `max_num_seqs` (chapter 11).
#
# ## 7. GPU memory: what `torch.cuda.memory_summary()` says about the KV budget
#
# On a GPU the engine sizes its KV cache at start-up (`kv_cache.kv_budget_in_blocks`):
# it notes PyTorch's allocated memory, loads the weights, runs one warm-up forward at the largest
# step size to measure peak activation memory, and gives the KV cache
#
# $$\text{budget} = u\cdot\text{total} - (\text{weights} + \text{activation peak} +
# \text{CUDA graphs}),$$
#
# with $u$ = `gpu_memory_utilization`, the engine's share of the card (as in vLLM). What other
# processes hold does not enter it; if $u\cdot\text{total}$ exceeds what is free at start-up,
# the engine refuses with both numbers (another engine in the process: `llm.shutdown()` first). `torch.cuda.memory_summary()` shows PyTorch's caching
# allocator: **allocated** is memory held by live tensors, **reserved** is what the allocator
# holds from the driver (allocated plus its cache of freed blocks); `num_alloc_retries` and
# `num_ooms` count the times it had to flush its cache or failed. A memory snapshot
# (`torch.cuda.memory._record_memory_history()` then `torch.cuda.memory._snapshot()`) adds,
# for each allocation, the stack that made it. For this engine the picture should be simple:
# the weights, one big KV-cache tensor, and little else; allocated memory should not grow
# from one batch of requests to the next (if it does, something keeps tensors alive: a leak
# of section 3's kind).
#
# The record below was made on the H200 by `tests/gpu/troubleshooting_h200.py`. On a GPU the
# chapter also measures live.

# %%
# NBVAL_IGNORE_OUTPUT
record_path = DATA / "troubleshooting_h200.json"
gpu_record = json.loads(record_path.read_text()) if record_path.exists() else None
if gpu_record is None:
    print("not recorded yet: figures/data/troubleshooting_h200.json is not there (run stage "
          "`troubleshooting` of tests/gpu/h200_session.sh on a GPU)")
else:
    r = gpu_record
    print(f"recorded on {r['device']}, {r['date']} (torch {r['torch']}): {r['command']}")
    print(f"model {r['model']}, gpu_memory_utilization {r['gpu_memory_utilization']}")
    total = r["stages"]["start"]["device_total_gib"]
    b = r["budget"]
    print(f"device {total:.1f} GiB; weights {b['weights_gib']:.2f} GiB; KV cache "
          f"{b['kv_cache_gib']:.2f} GiB = {b['num_kv_blocks']} blocks of {b['block_size']} "
          f"tokens ({b['kv_bytes_per_block'] / 2**10:.0f} KiB each)")
    for name, s in r["stages"].items():
        print(f"  {name:20s} allocated {s['allocated_gib']:6.2f} GiB, reserved "
              f"{s['reserved_gib']:6.2f} GiB, peak {s['peak_allocated_gib']:6.2f} GiB, "
              f"alloc retries {s['num_alloc_retries']}, OOMs {s['num_ooms']}")
    print("largest live allocations (memory snapshot):")
    for a in r["largest_allocations"][:5]:
        print(f"  {a['bytes'] / 2**30:7.3f} GiB  {a['where']}")
    for mode in ("inference_mode", "grad_enabled"):
        a = r["autograd"].get(mode, {})
        print(f"forward of {r['autograd']['num_tokens']} tokens, {mode}: " + (
            a["error"] if "error" in a else f"peak +{a['peak_extra_gib']:.2f} GiB, held after "
            f"{a['held_after_gib']:.3f} GiB, {a['ms']:.1f} ms"))
    print("\n".join(r["memory_summary_head"][:14]))

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    live = LLM(SMOLLM2, gpu_memory_utilization=0.3)
    print(torch.cuda.memory_summary(abbreviated=True))
    kv = live.engine.runner.kv_cache
    print(f"KV cache here: {kv.numel() * kv.element_size() / 2**30:.2f} GiB, "
          f"{live.engine.runner.num_kv_blocks} blocks")
    del live
else:
    kv_block = engine.runner.kv_bytes_per_block()
    print(f"no GPU here. On this CPU the KV budget is explicit: {engine.block_manager.num_blocks}"
          f" blocks x {kv_block / 2**10:.0f} KiB = {engine.block_manager.num_blocks * kv_block / 2**20:.1f}"
          f" MiB for SmolLM2 in fp32 (without num_kv_blocks: 1 GiB)")

# %% [markdown]
# What to read from such a record: weights plus KV cache plus the activation peak should come
# to about $u$ times the device, the KV cache being the one large allocation; allocated memory
# after a full batch should be back near the level after start-up (the step's temporaries are
# freed, only the allocator's reserve grows); and the retries and OOM counters should stay at
# zero. If the reserve grows step after step while allocations do not, the allocator is
# fragmented by varying step shapes (CUDA graphs and fixed buckets, chapter 07, help); if
# allocations grow, something is holding tensors.
#
# ## 8. Deployments this project has measured
#
# Deployment guides end with a table of advice, its numbers measured elsewhere. Here is such a
# table rewritten with configurations this engine runs and throughput it measured,
# read from the records in `figures/data/` (each row names its record, device, date and
# workload). Throughput is only comparable between rows of one workload
# (`nanovllm/benchmarks/workload.py` defines them; all use random weights):
#
# * **nano-vllm**: chapter 11's benchmark, 256 requests of 100-1024 prompt and output tokens,
#   all there at the start: the throughput workload.
# * **cpu**: 32 small requests, for a laptop.
# * **arrivals**: 256 requests of mixed lengths let in as a Poisson process at 16 per second:
#   throughput is capped by the arrival rate (the run cannot end before the last request
#   arrives), and the record's point is latency.
# * **long-prompts**: 16 requests of 8,192-32,768 prompt tokens and 128 new tokens each:
#   almost all the work is prefill, which output tok/s does not count.
# * **shared-prefix**: 128 requests behind one 2,048-token system prompt, 64-256 new tokens
#   each: prefix caching computes the shared prompt once.
# * **server load test**: chapter 10's, requests sent over HTTP at a fixed rate, or all at once
#   ("inf"); the tensor-parallel rows are chapter 09's runs on two H200s.

# %%
# NBVAL_IGNORE_OUTPUT
def deployment_rows() -> list[dict]:
    rows = []
    for path in sorted(DATA.glob("*.json")):
        rec = json.loads(path.read_text())
        if "nanovllm_tok_s" in rec:
            # Records older than the `workload` field ran the tool's default: nano-vllm on a
            # GPU, the small `cpu` workload on a CPU.
            workload = rec.get("workload") or ("nano-vllm" if "NVIDIA" in rec["device"] else "cpu")
            if rec.get("request_rate"):
                workload += f", Poisson arrivals at {rec['request_rate']:g} req/s"
            knobs = []
            if "note" in rec and "before" in rec["note"]:
                knobs.append("before fused kernels and async scheduling")
            for key, label in (("cuda_graphs", "CUDA graphs"),
                               ("async_scheduling", "async scheduling")):
                if key in rec:
                    knobs.append(f"{label} {'on' if rec[key] else 'off'}")
            knobs += [f"{k}={v}" for k, v in rec.get("sampling", {}).items()]
            if rec.get("tensor_parallel_size", 1) > 1:
                knobs.append(f"tensor_parallel_size={rec['tensor_parallel_size']}")
            rows.append({"model": Path(rec["model"]).name, "device": rec["device"],
                         "date": rec["date"][:10], "requests": rec["requests"],
                         "workload": workload,
                         "config": ", ".join([rec["attention_backend"] + " attention", *knobs]),
                         "tok_s": rec["nanovllm_tok_s"], "record": path.name})
        for shape, per_variant in rec.get("bench_tok_s", {}).items():  # chapter 08's record
            for variant, tok_s in per_variant.items():
                rows.append({"model": shape, "device": rec["device"], "date": rec["date"][:10],
                             "requests": rec["bench_requests"][shape],
                             "workload": "nano-vllm", "config": f"weights/KV {variant}",
                             "tok_s": tok_s,
                             "record": path.name})
        tp_runs = [e for e in rec.get("engines", []) if isinstance(e, dict) and "tp" in e]
        for run in tp_runs:  # chapter 09's tensor-parallel runs
            rows.append({"model": run["model"], "device": rec["device"],
                         "date": rec["runs"][-1]["date"][:10], "requests": run["requests"],
                         "workload": "nano-vllm",
                         "config": f"triton attention, tensor_parallel_size={run['tp']}",
                         "tok_s": run["output_tok_s"], "record": path.name})
        for run in rec.get("runs", []) if "server_command" in rec else []:  # chapter 10's
            cfg = rec["config"]
            rows.append({"model": Path(rec["server_command"].split()[3]).name,
                         "device": rec["device"], "date": rec["date"][:10],
                         "requests": cfg["num_requests"],
                         "workload": f"server load test, {run['rate']} req/s, "
                                     f"{cfg['input_len']} in / {cfg['output_len']} out tokens",
                         "config": f"OpenAI server, streamed over HTTP, "
                                   f"TTFT p50 {run['ttft']['p50']:.2f} s",
                         "tok_s": run["output_throughput_tps"], "record": path.name})
    return rows


from nanovllm.viz.records import HEADLINES

table = ["| model | device | date | workload | requests | configuration | output tok/s | record |",
         "|---|---|---|---|---:|---|---:|---|"]
table += [f"| {r['model']} | {r['device']} | {r['date']} | {r['workload']} | {r['requests']} | "
          f"{r['config']} | {r['tok_s']:,.0f} | `{r['record']}`"
          f"{' (current)' if r['record'] == HEADLINES['h200_qwen3_0.6b_tok_s'].record else ''} |"
          for r in deployment_rows()]
display(Markdown("\n".join(table)))

# %% [markdown]
# Read it as the engine's measured range, not as a promise. Rows of the same workload and
# configuration differ for two reasons the records show: identical runs differ by several
# percent (chapter 11), and the records were made by different versions of the engine (the
# date column; the row marked current is the one every chapter quotes for today's engine,
# `nanovllm/viz/records.py`). The baseline row is the engine before fused kernels and async
# scheduling; the quantized rows come from chapter 08's own runs, the tensor-parallel rows
# from chapter 09's (each with its own KV-cache size); the server rows are bounded by the
# request rate until the engine saturates.

# %% [markdown]
# ## 9. Claims tested, in one place
#
# Claims about small vLLM-style engines travel from blog posts to slides to design documents,
# usually without the workload, the model or the baseline they were measured on. This book
# tested the common ones where it builds the component they are about. The table collects
# them: each claim, what this book measured (read from the records in `figures/data/` through
# `nanovllm/viz/records.py`, or from this chapter's own runs above), and where. "Not measured
# here" means what it says.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.configs import config_path
from nanovllm.viz.records import load_record

package = Path(nanovllm.__file__).parent
core_lines = sum(len(f.read_text().splitlines())
                 for part in ("engine", "layers", "kernels", "models")
                 for f in (package / part).rglob("*.py"))
package_lines = sum(len(f.read_text().splitlines()) for f in package.rglob("*.py"))

quant, quant_eval = load_record("quant_h200.json"), load_record("quant_eval_h200.json")
step_ms, tok_s = quant["decode_step_ms"], quant["bench_tok_s"]
int8_speed = ", ".join(
    f"{shape} batch {b} {step_ms[shape]['bf16'][b] / step_ms[shape]['int8'][b] - 1:+.0%}"
    for shape in step_ms for b in ("1", "256") if "int8" in step_ms[shape])
int8_throughput = ", ".join(f"{shape} {t['int8'] / t['bf16'] - 1:+.0%}"
                            for shape, t in tok_s.items())
accuracy = {row["variant"]: row for row in quant_eval["rows"]}
int8_ppl = accuracy["int8"]["perplexity"] / accuracy["none"]["perplexity"] - 1

tuning = load_record("tuning_h200.json")
default_tok_s = [r["tok_s"] for r in tuning["rows"] if not r["knobs"]]
by_block_size = {r["knobs"]["block_size"]: r["tok_s"] for r in tuning["rows"]
                 if "block_size" in r["knobs"]}
qwen3 = ModelConfig.from_pretrained(config_path("qwen3-0.6b"))
block_mib = {b: qwen3.kv_bytes_per_token(2) * b / 2**20 for b in (16, *by_block_size)}

long_ctx = load_record("12_long_context_h200.json")
half = long_ctx["trained_length"] // long_ctx["bin_size"] // 2


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


ntk_vs_plain = [geometric_mean(long_ctx["variants"]["dynamic NTK"]["perplexity_by_bin"][lo:hi])
                / geometric_mean(long_ctx["variants"]["no scaling"]["perplexity_by_bin"][lo:hi]) - 1
                for lo, hi in ((0, half), (half, 2 * half))]

def wait_effect(load: str) -> str:
    """What section 6's 50 ms admission wait did to one load's TTFT and throughput."""
    waited, direct = served[load, 0.05], served[load, 0.0]
    ttft_ms = 1e3 * (statistics.mean(waited["ttft"]) - statistics.mean(direct["ttft"]))
    return (f"{load} load: mean time to first token {ttft_ms:+.0f} ms, throughput "
            f"{waited['tok_s'] / direct['tok_s'] - 1:+.0%}")


claims = [
    ("nano-vllm is about 1,200 lines",
     f"nano-vllm's own count: not measured here. This engine's core (engine, layers, kernels, "
     f"models) is {core_lines:,} lines, the whole package {package_lines:,}: the rest is the "
     "server, the measuring tools, the course and the book's helpers",
     "chapter 00 §7 (every module's length)"),
    ("continuous batching gives 3-5x throughput above 8 requests",
     "Not on our workload: against static batching with the same slots, the steps saved are "
     "capped by the spread of output lengths, far below 3x for outputs of 1 to 32 tokens; in "
     "wall time on an H200 the tiny workload was even slower (refill steps run outside CUDA "
     "graphs)", "chapter 06 §2-3"),
    ("paging saves over 40% of KV memory",
     "Depends on the baseline: far more against buffers of `max_model_len`, nothing against "
     "buffers of exactly the right size (rounding to whole blocks costs a little); prefix "
     "caching is what saves against those", "chapter 04 §5"),
    ("INT8 is 20% faster with under 1% accuracy loss",
     f"int8 decode step vs bf16: {int8_speed}; nano-vllm workload: {int8_throughput} "
     f"({quant['date']}). SmolLM2 in bf16: perplexity {int8_ppl:+.2%}, top-1 agreement "
     f"{accuracy['int8']['top1']:.3f}, greedy token agreement "
     f"{accuracy['int8']['greedy_token_agreement']:.3f} ({quant_eval['date']})",
     "chapter 08 §8-10; `quant_h200.json`, `quant_eval_h200.json`"),
    ("use 4 MB KV blocks",
     f"The engine sizes blocks in tokens. A 16-token block of Qwen3-0.6B in bf16 is "
     f"{block_mib[16]:.2f} MiB; on the H200 the default ran at "
     + " and ".join(f"{t:,.0f}" for t in default_tok_s) + " tok/s, "
     + ", ".join(f"block_size {b} ({block_mib[b]:.0f} MiB) at {t:,.0f}"
                 for b, t in by_block_size.items())
     + ": no byte size to aim for", "chapter 11 §5; `tuning_h200.json`"),
    ("wait 50 ms to batch requests",
     f"With continuous batching a request joins the next step anyway. A 50 ms admission wait, "
     f"this CPU, live: {'; '.join(wait_effect(load) for load in LOADS)}",
     "chapter 13 §6"),
    ("defragment the KV cache periodically",
     f"Nothing to defragment: on one random trace a first-fit contiguous allocator refused "
     f"{refused['contiguous']} requests, {refused['contiguous, enough free in total']} of them "
     f"with enough memory free; the paged one refused {refused['paged']}, each when its free "
     "blocks could not hold it. Internal waste stays below `block_size - 1` slots per sequence",
     "chapter 13 §5"),
    ("switch dynamic NTK on beyond 50% of the training length",
     f"SmolLM2 ({long_ctx['date']}): dynamic NTK against no scaling, perplexity "
     f"{ntk_vs_plain[0]:+.1%} in the first half and {ntk_vs_plain[1]:+.1%} in the second half "
     "of the trained length; it pays past it", "chapter 12 §4"),
]
display(Markdown("\n".join(["| claim | measured in this book | where |", "|---|---|---|"]
                           + [f"| {c} | {m} | {w} |" for c, m, w in claims])))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"chapter run time so far: {time.perf_counter() - chapter_start:.0f} s")

# %% [markdown]
# ## Assignments
#
# In the course edition (`make student`; see the README's *Start here*) you write the heart of
# the leak check, `check_refcounts` (section 1): count each block's holders and report every
# block whose reference count disagrees, naming the requests. Its docstring is the handout;
# the project's tests grade it (`make check CHAPTERS=13` in your edition), including the planted
# leak of section 2.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("13"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — find and fix the leak.** A tiny block pool: `refcount[b]` counts the holders
# of block `b`, `free` lists the free block ids, a request is a dict with its `"id"` and its
# `"blocks"`. This `finish` was handed in with an extension:
#
# ```python
# def finish(request, reason, refcount, free):
#     if reason == "abort":
#         request["blocks"] = []       # the client is gone: nothing more to do
#         return
#     for b in request["blocks"]:
#         refcount[b] -= 1
#         if refcount[b] == 0:
#             free.append(b)
#     request["blocks"] = []
# ```
#
# Write a correct `finish(request, reason, refcount, free)`: whatever the reason, drop one
# reference of each of the request's blocks, last block first, append a block to `free` when
# its count reaches 0, and empty the request's blocks; raise `ValueError` naming the request
# and the block if a count would go below 0 (a double free). The check replays a random trace
# with shared prefix blocks and aborts and verifies, after every event, that each count equals
# the number of live requests holding the block.

# %% tags=["exercise"]
def finish(request: dict, reason: str, refcount: list[int], free: list[int]) -> None:
    """Release every block of ``request`` (for any ``reason``), last block first."""
    raise NotImplementedError("exercise 13.finish")


# %% tags=["check", "raises-exception"]
import random
from collections import Counter

rng = random.Random(1301)
num_blocks = 24
refcount, free = [0] * num_blocks, list(range(num_blocks))
shared = []  # a shared prefix block, once some request computed it
live = []
for t in range(400):
    if live and rng.random() < 0.45:
        req = live.pop(rng.randrange(len(live)))
        blocks = list(req["blocks"])
        finish(req, rng.choice(["stop", "length", "abort", "error"]), refcount, free)
        assert req["blocks"] == [], "finish must empty the request's blocks"
        if blocks and refcount[blocks[-1]] == 0:
            assert free[-1] == blocks[0] or refcount[blocks[0]] > 0, "last block first"
    else:
        need = rng.randrange(1, 4)
        if len(free) < need + 1:
            continue
        blocks = []
        if shared and refcount[shared[0]] > 0 and rng.random() < 0.5:
            blocks.append(shared[0])  # share the prefix
            refcount[shared[0]] += 1
        for _ in range(need):
            b = free.pop(0)
            refcount[b] += 1
            blocks.append(b)
        if not shared or refcount[shared[0]] == 0:
            shared[:] = [blocks[0]]
        live.append({"id": f"r{t}", "blocks": blocks})
    holders = Counter(b for r in live for b in r["blocks"])
    assert all(refcount[b] == holders[b] for b in range(num_blocks)), f"event {t}: counts wrong"
    assert sorted(free) == [b for b in range(num_blocks) if holders[b] == 0], f"event {t}"
victim = {"id": "twice", "blocks": [free[0]]}
try:
    finish(victim, "stop", refcount, free)
except ValueError as err:
    assert "twice" in str(err), "name the request in the error"
else:
    raise AssertionError("a double free must raise ValueError")
print("Exercise 1 passed: every reason frees, counts equal holders after 400 events")

# %% [markdown]
# **Exercise 2 — first fit, and its fragmentation.** Write `first_fit_alloc(used, capacity,
# size)` for a contiguous allocator: `used` maps request ids to `(start, length)` regions of
# a memory of `capacity` slots; return the start of the lowest free gap of at least `size`
# slots, or `None` if there is none. The check verifies regions never overlap on a random
# trace, that the lowest gap is chosen, and finds a state where the free memory in total
# would hold a request that no gap holds (the fragmentation of section 5).

# %% tags=["exercise"]
def first_fit_alloc(used: dict, capacity: int, size: int) -> int | None:
    """Lowest start of a free gap of >= ``size`` slots among ``used`` regions, or None."""
    raise NotImplementedError("exercise 13.first_fit_alloc")


# %% tags=["check", "raises-exception"]
import random

rng = random.Random(1302)
capacity, used, fragmented = 1000, {}, 0
for t in range(2000):
    if used and rng.random() < 0.5:
        used.pop(rng.choice(sorted(used)))
        continue
    size = rng.randrange(10, 200)
    start = first_fit_alloc(dict(used), capacity, size)
    taken = [False] * capacity
    for s, n in used.values():
        for i in range(s, s + n):
            taken[i] = True
    fits = [s for s in range(capacity - size + 1) if not any(taken[s:s + size])]
    assert start == (fits[0] if fits else None), f"event {t}: expected {fits[:1] or None}"
    if start is None:
        fragmented += capacity - sum(taken) >= size
    else:
        used[t] = (start, size)
assert fragmented > 0, "the trace should meet fragmentation"
print(f"Exercise 2 passed: first fit is exact; {fragmented} requests refused with enough free "
      "memory in total")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/13.json` *before* measuring; then `make analysis CH=13 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("13")

# %% [markdown]
# ## Summary
#
# - **KV leaks** are silent: the usage creeps up, throughput sinks, the engine stalls. The leak
#   check (`nanovllm/engine/invariants.py`, `engine.check_invariants()`) verifies between steps
#   that every block is free or held, counts equal holders, no finished request holds blocks,
#   and the prefix index matches the blocks; it names the request and the blocks. The tests run
#   it after every step; a planted leak is caught at the step after the abort.
# - **Autograd left on** keeps, per forward, many times the KV cache's bytes alive for a
#   backward that never comes; the engine's step runs under `torch.inference_mode()`, and a
#   test checks that no module output of a step requires grad.
# - **Positions beyond the trained length** give RoPE angles the model never saw; the engine
#   bounds `max_model_len` by the model's length, refuses prompts that do not leave room for a
#   token, and stops requests at the limit. Longer contexts need RoPE scaling (chapter 12).
# - **No defragmentation**: paging has no external fragmentation; internal waste is below one
#   block per sequence, measured within the bound at every step.
# - **No batch-wait timeout**: continuous batching admits at every step, so a wait adds to
#   TTFT and buys no throughput.
# - **GPU memory**: weights, one KV-cache tensor sized from `gpu_memory_utilization` after a
#   warm-up, and the activation peak; `memory_summary()` and snapshots tell leaks (allocated
#   grows) from allocator fragmentation (reserved grows).

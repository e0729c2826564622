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
# # Chapter 06 — The scheduler
#
# Chapters 03–05 made one engine step cheap and gave every request a paged KV cache. This
# chapter is about the decision made *before* every step: **which requests run, and how many of
# their tokens**. That decision is the scheduler's, and it governs almost everything a user of
# an inference service notices: how long they wait for the first token, how fast the rest
# arrive, whether a neighbour's huge prompt freezes their answer, and whether the machine is
# busy or idle while they wait.
#
# We will
#
# 1. compare **static batching** (a batch runs until its longest member finishes) with
#    **continuous batching** (a finished request's slot is refilled at the next step), first on
#    paper, then with a ten-line simulator, then on the real engine, drawn as Gantt charts;
# 2. measure **throughput against concurrency** and check an often-quoted claim against our
#    engine;
# 3. see what **chunked prefill** does to the time to first token of short requests stuck behind
#    a long prompt;
# 4. run out of KV cache on purpose and watch **preemption** keep the engine going without
#    changing a single output token;
# 5. compare the **scheduling policies** (first come first served, priority with aging and
#    deadlines, fair sharing between users, reserved shares per request class) on a mixed
#    workload, and **write our own policy**;
# 6. peek at the **async engine**, the producer/consumer loop that serves requests arriving from
#    many threads (chapter 10 goes deeper).
#
# **Package modules taught here:** `nanovllm/engine/scheduler.py` (the token-budget scheduler),
# `nanovllm/engine/policies.py` (who goes first), `nanovllm/engine/llm_engine.py` (the step
# loop, `stats`, `timeline`), `nanovllm/engine/metrics.py` (`StepMetrics`, `TimelineRecorder`,
# `latency_summary`), `nanovllm/outputs.py` (`RequestMetrics`), the scheduling fields of
# `nanovllm/sampling_params.py` (`deadline`, `user`, `request_class`), a request's `priority`
# (an argument of `generate` and `add_request`, as in vLLM) and, briefly,
# `nanovllm/engine/async_engine.py`.

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(6)

# %% [markdown]
# **Builds on:** iteration-level scheduling from Orca {cite}`yu2022orca`, chunked prefill from
# Sarathi-Serve {cite}`agrawal2024sarathi` and preemption as in vLLM {cite}`kwon2023paged`. The
# references are collected in the book's bibliography.

# %% [markdown]
# ## Setup
#
# Every experiment runs SmolLM2-135M-Instruct with greedy decoding in float32 and
# `ignore_eos=True`, so each request produces exactly the number of tokens it asks for and the
# schedules below are the same on every machine: step counts, admission orders and output tokens
# are checked by the notebook tests, while wall-clock times (which depend on the machine and on
# what else it is doing) are shown but not checked.
#
# Two practical choices keep the chapter fast on a laptop. The engines get a small KV cache
# (`num_kv_blocks=128`, i.e. 2048 token slots, plenty for our requests), and on a CPU we run
# PyTorch with one thread: on a small shared machine, several OpenMP threads per process fight
# for the same cores and make every step *slower*. The thread count is restored at the end of
# the chapter.

# %%
# NBVAL_IGNORE_OUTPUT
import inspect
import platform
import random
import statistics
import threading
import time
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import nanovllm
from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.metrics import TimelineRecorder, latency_summary
from nanovllm.engine.policies import FairPolicy, MixedPolicy, PriorityPolicy
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.scheduler_output import ModelRunnerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.viz import figure, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
saved_threads = torch.get_num_threads()
if device == "cpu":
    torch.set_num_threads(1)
use_book_style()
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
PATH = smollm2_path()
chapter_start = time.perf_counter()
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"nanovllm {nanovllm.__version__}")
print(f"device: {device}, torch threads: {torch.get_num_threads()} (was {saved_threads})")


def make_llm(**options) -> LLM:
    """A SmolLM2 engine in float32 with a small KV cache; options are EngineConfig fields.

    Async scheduling is off, so step counts are the same on every device (a GPU turns it on by
    default and then reports each step's tokens one step later, chapter 11)."""
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("async_scheduling", False)
    return LLM(PATH, dtype="float32", **options)


# %% [markdown]
# Prompts are token ids cut from one paragraph at different offsets, so we control their length
# exactly and no two prompts share a first KV block (the prefix cache of chapter 04 stays out of
# the way unless we want it). `greedy(n)` asks for exactly `n` new tokens.

# %%
# NBVAL_CHECK_OUTPUT
llm = make_llm(max_num_seqs=4, enable_prefix_caching=False)
tokenizer = llm.tokenizer
PARAGRAPH = tokenizer.encode(
    "An inference engine serves many users at once. Requests arrive at any moment, each with a "
    "prompt of its own length, and each wants an answer of a length nobody knows in advance. "
    "Between two steps of the model the scheduler looks at everything that is waiting and "
    "everything that is running, and decides which sequences take part in the next step and how "
    "many of their tokens the model computes. A good decision keeps the batch full, because a "
    "step for many sequences costs hardly more than a step for one; it answers interactive users "
    "quickly, because people notice the time to the first word; it shares the machine fairly "
    "between tenants, so that one customer with a thousand queued jobs cannot lock out another "
    "with one question; and it never runs out of memory for the key-value cache, where every "
    "running sequence keeps the keys and values of all its past tokens. When memory does run "
    "out, the scheduler must take blocks away from someone and give them back later, without "
    "changing a single token of anybody's answer. This chapter measures each of these choices "
    "on a real model, one experiment at a time, and draws what happens step by step.")


def prompt(i: int, length: int) -> list[int]:
    """A prompt of `length` token ids; different i give different prompts."""
    start = (13 * i) % 101
    return PARAGRAPH[start:start + length]


def greedy(n: int, **scheduling) -> SamplingParams:
    """Exactly n new tokens, greedily; `scheduling` sets deadline, user, request_class."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **scheduling)


print(f"{len(PARAGRAPH)} tokens to cut prompts from; prompt(0, 8) = {prompt(0, 8)}")
print(repr(tokenizer.decode(prompt(0, 8))))

# %% [markdown]
# ## 1. Why a scheduler: static versus continuous batching
#
# Chapter 00 measured the effect everything here rests on: a decode step for *B* sequences costs
# little more than a step for one, because the step's cost is dominated by reading the weights,
# which all *B* sequences share. So the engine wants as many sequences in every step as it can
# hold. The simplest way to get them is **static batching**: take *B* requests, run them together
# until all are done, then take the next *B*. Its flaw is that requests do not finish together.
# A batch whose members want $L_1, \dots, L_B$ new tokens runs for $\max_i L_i$ steps, and
# every slot whose request is already done sits idle until the longest one ends. Over a
# workload cut into groups $G$,
#
# $$\text{steps}_{\text{static}} = \sum_{G} \max_{i \in G} L_i, \qquad
#   \text{steps}_{\text{continuous}} \ \ge\ \left\lceil \frac{\sum_i L_i}{B} \right\rceil .$$
#
# **Continuous batching** (also called iteration-level scheduling, introduced by the Orca paper,
# OSDI 2022) re-decides the batch at *every step*: a request that finishes leaves at once and a
# waiting one takes its slot in the next step. The lower bound on the right is reached when
# slots never idle, and the fraction of slot-steps doing useful work,
#
# $$\text{utilization} = \frac{\sum_i L_i}{B \cdot \text{steps}},$$
#
# is what the two disciplines differ in. The price is bookkeeping: every step mixes requests
# at different stages (a new prompt here, the 17th token of an answer there), which is exactly
# what the paged KV cache (chapter 04) and varlen attention (chapters 02 and 05) make cheap.
#
# ### Build it small
#
# Both disciplines fit in a few lines. Each request needs `lengths[i]` steps in a slot (its
# first step computes the prompt and yields the first token, every later step one more token);
# the simulators return, for every request, the first and last step it occupies a slot.

# %%
# NBVAL_CHECK_OUTPUT
def static_spans(lengths: list[int], slots: int) -> list[tuple[int, int]]:
    """Static batching: groups of `slots` requests; a group starts when the previous one ends."""
    spans, start = [], 0
    for g in range(0, len(lengths), slots):
        group = lengths[g:g + slots]
        spans += [(start, start + n - 1) for n in group]
        start += max(group)
    return spans


def continuous_spans(lengths: list[int], slots: int) -> list[tuple[int, int]]:
    """Continuous batching, first come first served: a freed slot is refilled at the next step."""
    waiting, running, first, spans = list(range(len(lengths))), {}, {}, [None] * len(lengths)
    step = 0
    while waiting or running:
        while waiting and len(running) < slots:
            i = waiting.pop(0)
            running[i], first[i] = lengths[i], step
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                spans[i] = (first[i], step)
                del running[i]
        step += 1
    return spans


def num_steps(spans) -> int:
    return max(end for _, end in spans) + 1


LENGTHS = [3, 14, 5, 10, 4, 12, 6, 8]  # new tokens wanted by eight requests
SLOTS = 4
for name, fn in [("static", static_spans), ("continuous", continuous_spans)]:
    spans = fn(LENGTHS, SLOTS)
    steps = num_steps(spans)
    print(f"{name:>10}: {steps} steps, utilization {sum(LENGTHS) / (SLOTS * steps):.0%}, "
          f"spans {spans}")
print(f"lower bound: ceil({sum(LENGTHS)} / {SLOTS}) = {-(-sum(LENGTHS) // SLOTS)} steps")

# %% [markdown]
# Eight requests wanting 62 tokens in total, four slots. Static batching needs 14 steps for the
# first group (its longest request wants 14 tokens) and 12 for the second, and more than a third
# of its slot-steps are idle. Continuous batching gets within a step or two of the lower bound.
#
# ### The package's scheduler
#
# The package does the same thing under two extra constraints: a **token budget** per step
# (`max_num_batched_tokens`: a step can only compute so many tokens) and the **KV cache** (a
# sequence needs blocks for its tokens, chapter 04). Every step, `Scheduler.schedule` asks the
# policy to rank all unfinished sequences, gives the budget to the running ones in that order
# (one token for a decode, the next piece for a prompt being computed in chunks), preempts the
# lowest-ranked running sequence if the KV cache runs out (`_schedule_running`), and admits
# waiting sequences in rank order with what is left, stopping at the first one that does not
# fit (`_admit`):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(Scheduler.schedule, Scheduler._schedule_running, Scheduler._admit)

# %% [markdown]
# `schedule` only decides; it returns a `SchedulerOutput` (which sequences run, how many new
# tokens each, what it preempted). The scheduler is also the **one owner of request state**:
# after the model runner has executed the step, `Scheduler.update_from_output` is the one
# function that advances a request. It counts the step's tokens as computed, appends each
# sampled token, checks stop and length, registers the blocks that filled up for prefix caching,
# and frees whatever finished. So an engine step reads as three lines, schedule, execute, update
# (`LLMEngine.step`):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(LLMEngine.step, Scheduler.update_from_output)


# %% [markdown]
# To check the simulator against the real thing we drive the package's `Scheduler` and
# `BlockManager` with a *fake model*: `ModelRunnerOutput.constant(batch, 7)` "samples" token 7
# for every sequence that computed everything it had, and `update_from_output` does the rest. No weights, no
# tensors: just the scheduling decisions, step by step. `scheduler_spans` returns the same spans
# as our simulators.

# %%
# NBVAL_CHECK_OUTPUT
def scheduler_spans(lengths: list[int], slots: int) -> list[tuple[int, int]]:
    """Run the package's Scheduler (FCFS) with a fake model; (first, last) step of each request."""
    config = SimpleNamespace(max_num_seqs=slots, max_num_batched_tokens=4096,
                             enable_chunked_prefill=True, scheduler_policy="fcfs")
    sched = Scheduler(config, BlockManager(1024, 16, enable_prefix_caching=False))
    seqs = [Sequence(list(range(1000 * i, 1000 * i + 4)), SamplingParams(max_tokens=n))
            for i, n in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    first, last, step = {}, {}, 0
    while sched.has_unfinished():
        batch = sched.schedule(now=float(step))
        for seq in batch.seqs:
            first.setdefault(seq.seq_id, step)
        # the "model": token 7 for every sequence that reached its end; the scheduler advances
        # progress, appends the tokens and finishes what hit max_tokens
        sched.update_from_output(batch, ModelRunnerOutput.constant(batch, 7))
        for seq in batch.seqs:
            if seq.is_finished:
                last[seq.seq_id] = step
        step += 1
    return [(first[s.seq_id], last[s.seq_id]) for s in seqs]


rng = random.Random(0)
for _ in range(200):
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 12))]
    slots = rng.randint(1, 5)
    assert scheduler_spans(lengths, slots) == continuous_spans(lengths, slots), (lengths, slots)
print("the package's scheduler and continuous_spans agree on 200 random workloads")

# %% [markdown]
# ## 2. Static and continuous batching on the real engine
#
# Now the same eight requests on SmolLM2, with prompts of 12 to 40 tokens and four slots
# (`max_num_seqs=4`). Static batching is something we do *outside* the engine: hand it four
# requests, wait until all four are finished, hand it the next four. Continuous batching is
# what the engine does by itself when it gets all eight at once. To see who ran when, we switch
# on the engine's `TimelineRecorder` (off by default; it records one entry per request and step:
# which step, prefill or decode, how many tokens, when the step started and ended).

# %%
# NBVAL_CHECK_OUTPUT
PROMPT_LENS = [12, 40, 20, 32, 16, 24, 36, 28]
prompts = [prompt(i, n) for i, n in enumerate(PROMPT_LENS)]
params = [greedy(n) for n in LENGTHS]


def run_with_timeline(engine_llm, groups):
    """Generate each group of (prompts, params) after the previous one finished; returns the
    outputs, the timeline records and the wall time."""
    engine_llm.engine.timeline = TimelineRecorder()
    outputs, start = [], time.perf_counter()
    for group_prompts, group_params in groups:
        outputs += engine_llm.generate(group_prompts, group_params, use_tqdm=False)
    return outputs, engine_llm.engine.timeline.to_records(), time.perf_counter() - start


def spans_from_timeline(outputs, records):
    """(first, last) step of each request, counted from the run's first step."""
    s0 = records[0]["step"]
    steps = {}
    for r in records:
        steps.setdefault(r["request_id"], []).append(r["step"] - s0)
    return [(min(steps[o.request_id]), max(steps[o.request_id])) for o in outputs]


static_groups = [(prompts[g:g + SLOTS], params[g:g + SLOTS]) for g in range(0, 8, SLOTS)]
static_out, static_rec, static_wall = run_with_timeline(llm, static_groups)
cont_out, cont_rec, cont_wall = run_with_timeline(llm, [(prompts, params)])

static_real = spans_from_timeline(static_out, static_rec)
cont_real = spans_from_timeline(cont_out, cont_rec)
print("static:     ", num_steps(static_real), "steps; spans equal the simulator's:",
      static_real == static_spans(LENGTHS, SLOTS))
print("continuous: ", num_steps(cont_real), "steps; spans equal the simulator's:",
      cont_real == continuous_spans(LENGTHS, SLOTS))
print("same tokens either way:",
      [o.token_ids for o in static_out] == [o.token_ids for o in cont_out])

# %% [markdown]
# The engine's schedule is exactly the one the simulators predicted, and the generated tokens
# do not depend on how the requests were batched. In wall-clock time (machine-dependent), with
# the steps split by kind: a step that computes a prompt (alone or beside decodes) and a step
# that only decodes, each with its mean duration from the timeline:

# %%
# NBVAL_IGNORE_OUTPUT
def step_kinds(records) -> tuple[list[float], list[float]]:
    """Durations of the steps that compute a prompt and of the decode-only steps."""
    steps = {}  # step -> [duration, computes a prompt]; one timeline entry per request and step
    for r in records:
        entry = steps.setdefault(r["step"], [r["end"] - r["start"], False])
        entry[1] |= r["kind"] == "prefill"
    return ([d for d, prompt in steps.values() if prompt],
            [d for d, prompt in steps.values() if not prompt])


total_tokens = sum(LENGTHS)
for name, wall, records in [("static", static_wall, static_rec),
                            ("continuous", cont_wall, cont_rec)]:
    with_prompt, decode_only = step_kinds(records)
    print(f"{name:>10}: {wall:5.2f} s, {total_tokens / wall:5.1f} output tokens/s; "
          f"{len(with_prompt)} steps with a prompt, {1e3 * np.mean(with_prompt):6.2f} ms each; "
          f"{len(decode_only)} decode-only, {1e3 * np.mean(decode_only):6.2f} ms each")
print(f"continuous batching: {static_wall / cont_wall:.2f}x the throughput of static batching")

# %% [markdown]
# Fewer steps need not mean less time, because the two kinds of step cost differently, and the
# difference depends on the device. Static batching computes prompts only in the first step of
# each group; continuous batching admits a waiting request in the step after a slot frees, so
# more of its steps carry a prompt. On a CPU a step's cost is mostly its arithmetic, and fewer
# steps win. On a GPU the engine replays a decode-only step as a CUDA graph, while a step with
# a prompt runs eagerly, one kernel launch at a time (chapter 07 measures the difference). The
# chapter's run on an H200 (`figures/data/gpu_runs/06_scheduler.h200.ipynb`, the cell above,
# recorded before the split by kind was added) shows what that does to this tiny workload:
# continuous batching took fewer steps and *more* time, about half the throughput of static
# batching. The schedules say why: continuous batching computes a prompt in 5 of its 18 steps
# (the first, and one per refill: the spans of §1 start at steps 0, 3, 5, 7 and 10), static
# batching in 2 of its 26 (0 and 14). Those steps run eagerly, and with eight short requests of
# a 135M model nothing hides their launch costs; the split printed above, run on a GPU, shows
# what each kind of step costs there. A production
# engine also captures graphs for steps that mix prompts and decodes (vLLM's piecewise
# graphs); this engine does not (chapter 07).


# %%
def draw_gantt(ax, outputs, records, title):
    """One row per request: waiting (grey), prefill and decode steps (colours), from a timeline."""
    rows = {o.request_id: i for i, o in enumerate(outputs)}
    for r in records:
        y = rows[r["request_id"]]
        color = COLORS[1] if r["kind"] == "prefill" else COLORS[0]
        ax.broken_barh([(r["start"], r["end"] - r["start"])], (y - 0.35, 0.7), color=color)
    for o in outputs:  # every request is there from time 0; until its first step it waits
        first = min(r["start"] for r in records if r["request_id"] == o.request_id)
        ax.broken_barh([(0, first)], (rows[o.request_id] - 0.12, 0.24), color="0.8")
    ax.set_yticks(range(len(outputs)), [f"req {i} ({n} tok)" for i, n in enumerate(LENGTHS)])
    ax.invert_yaxis()
    ax.set_title(title, loc="left")


fig, axes = plt.subplots(2, 1, figsize=(7.5, 5.6), sharex=True)
draw_gantt(axes[0], static_out, static_rec,
           f"static batching, groups of {SLOTS}: {num_steps(static_real)} steps")
draw_gantt(axes[1], cont_out, cont_rec,
           f"continuous batching, {SLOTS} slots: {num_steps(cont_real)} steps")
axes[1].set_xlabel("time since the first step (s)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (COLORS[1], COLORS[0], "0.8")]
axes[1].legend(handles, ["prefill", "decode", "waiting"], loc="upper right")
fig.tight_layout()
figure(fig, "06_scheduler_gantt",
       f"{len(LENGTHS)} requests wanting {LENGTHS} new tokens, {SLOTS} slots, timed on {device}:"
       " static batching in groups (top) and continuous batching (bottom), one row per request:"
       " waiting (grey), prefill (orange) and decode steps (blue). Continuous batching gives a"
       " freed slot to a waiting request in the next step.")

# %% [markdown]
# Read the top chart of Figure 6.1 row by row: request 0 is done after three tokens, but its slot
# stays empty until request 1 finishes its fourteenth; requests 4–7 wait (grey) for the whole first
# group. In the bottom chart request 4 takes request 0's slot in the step after it leaves, request 5
# takes request 2's, request 6 request 4's, and so on (compare the spans printed in §1): a slot
# never idles while someone waits. The orange prefill bars are wider than the decode bars because a
# step that computes prompts does more work; in the continuous run some steps mix a prefill with the
# decodes of the others, which is why those steps are longer too. Notice what did *not* change: the
# per-step cost of a batch of four. All of the gain is fewer steps.

# %% [markdown]
# ## 3. Continuous against static batching, with many requests
#
# A claim that circulates in blog posts and vendor slides: *"continuous batching engines give
# 3–5× higher throughput once you have more than 8 concurrent requests"*. The comparison in it
# is continuous batching against **static** batching, the same engine with the same slots, not
# many requests against one. (How throughput grows with the number of requests in a step is
# chapter 00's batching measurement.) Section 2 measured the two on eight requests; here we
# scale that up: C = 8, 16 and 32 requests arrive at once, eight slots (`max_num_seqs=8`), 8-token
# prompts, and output lengths drawn from 1 to 32 tokens, as answers differ in length. Static
# batching runs groups of eight to completion, one after another; continuous batching gets all C
# at once. The step counts depend only on the lengths, so the notebook tests check them; the
# simulators of §1 predict them.

# %%
# NBVAL_CHECK_OUTPUT
BATCH_SLOTS = 8
RANDOM_LENGTHS = random.Random(6).choices(range(1, 33), k=32)  # new tokens of 32 requests
llm8 = make_llm(max_num_seqs=BATCH_SLOTS, enable_prefix_caching=False)


def batching_run(c: int, static: bool) -> dict:
    """C requests, static (groups of BATCH_SLOTS, each to completion) or continuous (all at once):
    engine steps, wall time and output tokens per second."""
    lengths = RANDOM_LENGTHS[:c]
    reqs = [(prompt(200 + i, 8), greedy(n)) for i, n in enumerate(lengths)]
    groups = [reqs[g:g + BATCH_SLOTS] for g in range(0, c, BATCH_SLOTS)] if static else [reqs]
    first_step = llm8.engine.stats.num_steps
    start = time.perf_counter()
    tokens = []
    for group in groups:
        outs = llm8.generate([p for p, _ in group], [s for _, s in group], use_tqdm=False)
        tokens += [o.token_ids for o in outs]
    wall = time.perf_counter() - start
    return {"c": c, "steps": llm8.engine.stats.num_steps - first_step, "wall": wall,
            "tok_s": sum(lengths) / wall, "tokens": tokens}


batching_run(8, static=False)  # warm-up
COUNTS = [8, 16, 32]
static_runs = {c: batching_run(c, static=True) for c in COUNTS}
cont_runs = {c: batching_run(c, static=False) for c in COUNTS}
for c in COUNTS:
    s, k = static_runs[c], cont_runs[c]
    lengths = RANDOM_LENGTHS[:c]
    print(f"C={c:2d}: static {s['steps']:3d} steps (simulator "
          f"{num_steps(static_spans(lengths, BATCH_SLOTS))}), continuous {k['steps']:3d} steps "
          f"(simulator {num_steps(continuous_spans(lengths, BATCH_SLOTS))}), "
          f"step ratio {s['steps'] / k['steps']:.2f}, same tokens: {s['tokens'] == k['tokens']}")
    # no schedule needs fewer steps than ceil(total tokens / slots), nor than the longest
    # answer (its tokens come one per step): the most continuous batching could ever gain
    bound = max(-(-sum(lengths) // BATCH_SLOTS), max(lengths))
    print(f"      at best {s['steps'] / bound:.2f} (static steps / {bound}, the fewest steps "
          f"any schedule needs)")

# %% [markdown]
# Each engine step here is one token for every running request (the 8-token prompts fit in the
# first step with the decodes), so the engine's step counts equal the simulators'. The ratio of
# steps is what continuous batching saves; in wall-clock time (machine-dependent, not checked):

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{'C':>3} {'static s':>9} {'continuous s':>13} {'static tok/s':>13} {'cont. tok/s':>12} "
      f"{'gain':>6}")
for c in COUNTS:
    s, k = static_runs[c], cont_runs[c]
    gain = k["tok_s"] / s["tok_s"]
    verdict = "below" if gain < 3 else "within" if gain <= 5 else "above"
    print(f"{c:>3} {s['wall']:>9.2f} {k['wall']:>13.2f} {s['tok_s']:>13.1f} {k['tok_s']:>12.1f} "
          f"{gain:>5.2f}x  ({verdict} the claimed 3-5x)")

# %%
fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(9, 3.6))
x = np.arange(len(COUNTS))
ax_s.bar(x - 0.2, [static_runs[c]["steps"] for c in COUNTS], 0.4, color=COLORS[1],
         label="static batching")
ax_s.bar(x + 0.2, [cont_runs[c]["steps"] for c in COUNTS], 0.4, color=COLORS[0],
         label="continuous batching")
ax_s.set(xticks=x, xticklabels=[str(c) for c in COUNTS], xlabel="requests C",
         ylabel="engine steps", title="steps (device-independent)")
ax_s.legend(fontsize=8)
gains = [cont_runs[c]["tok_s"] / static_runs[c]["tok_s"] for c in COUNTS]
ax_t.bar(x, gains, 0.5, color=COLORS[0])
ax_t.axhspan(3, 5, color=COLORS[1], alpha=0.25, label="the 3-5x claim")
ax_t.axhline(1, color="grey", lw=1, ls=":")
ax_t.set(xticks=x, xticklabels=[str(c) for c in COUNTS], xlabel="requests C",
         ylabel="continuous / static throughput", title=f"measured gain ({device})")
ax_t.legend(fontsize=8)
fig.suptitle(f"SmolLM2-135M fp32, {BATCH_SLOTS} slots, outputs of 1-32 tokens", fontsize=10)
fig.tight_layout()
figure(fig, "06_scheduler_concurrency",
       f"Static against continuous batching for C requests of 1-32 output tokens (SmolLM2-135M"
       f" fp32, {BATCH_SLOTS} slots): engine steps (left, the same on every device) and the"
       f" measured throughput of continuous over static batching on {device} (right), against"
       " the 3-5x band often quoted.")

# %% [markdown]
# Figure 6.2 sums it up. Continuous batching wins by removing idle slot-steps: a static group lasts
# as long as its longest answer, and its other slots idle meanwhile. With C = 8 there is one group
# and nothing to refill, so the two schedules are the same. With more requests the gain grows, but
# it is capped by the *spread* of output lengths, not by the number of requests: no schedule needs
# fewer steps than the total tokens divided by the slots, nor fewer than the longest answer, and the
# "at best" ratio printed above stays far below 3 for answers of 1 to 32 tokens. With all answers of
# one length there is nothing to gain at all. In wall time the gain differs from the step ratio,
# because steps differ in cost (a half-empty step is cheaper than a full one, and each static group
# starts with a prefill step of its own); the table shows by how much on this machine. On a GPU the
# wall-time "gain" of continuous batching here is below 1 (the H200 run of this chapter,
# `figures/data/gpu_runs/06_scheduler.h200.ipynb`): each refill puts a prompt into a step, and such
# a step runs eagerly while a decode-only step replays a CUDA graph, as section 2 showed. What the
# step counts measure, the scheduling, does not depend on that. Larger published gains (Anyscale's
# 2023 blog post reported up to 23× for vLLM against static batching in Hugging Face's pipelines)
# come from wider length spreads and from other differences between the engines compared. Quote such
# claims with their workload, or better: measure them, as here.

# %% [markdown]
# ## 4. Chunked prefill: long prompts without head-of-line blocking
#
# A step has a token budget, `max_num_batched_tokens`. A decode costs one token of it, a prompt
# as many tokens as it has. What happens to a prompt that does not fit the budget left over by
# the running decodes?
#
# * **Without chunked prefill** the prompt must be computed in one step, so it waits until
#   enough decodes have finished. And because admission stops at the first request that does not
#   fit (so that a big request is not overtaken forever by small ones), everything queued
#   *behind* it waits too: **head-of-line blocking**.
# * **With chunked prefill** (`enable_chunked_prefill=True`, the default) the scheduler hands
#   the prompt whatever budget is left, computes it over several steps, and the short requests
#   behind it get their turn as soon as it is done.
#
# The difference is one decision of `Scheduler._admit` (section 1): what a waiting prompt gets
# when what it still has to compute is more than the budget left. With chunking, all that is
# left (the rest comes in later steps, as a running sequence); without, nothing, and admission
# stops there.

# %% [markdown]
# The experiment: a budget of 128 tokens per step. Six "chat" requests (16-token prompts, 20
# new tokens each) arrive first and keep decoding; then one long document (124 tokens, 4 new
# tokens); then four short questions (16 tokens, 8 new tokens each). All eleven are submitted at
# once. The long prompt plus its answer just fits the budget (124 + 4 = 128), which the engine
# requires when chunking is off, but not next to six decodes. We run the same workload with
# chunking off and on, and read each request's time to first token (TTFT) from its
# `RequestMetrics` (`outputs[i].metrics`), in seconds and in engine steps.

# %%
# NBVAL_CHECK_OUTPUT
CHAT, LONG, SHORT = range(6), [6], range(7, 11)
chunk_prompts = ([prompt(i, 16) for i in CHAT] + [prompt(50, 124)]
                 + [prompt(60 + i, 16) for i in range(4)])
chunk_params = [greedy(20)] * 6 + [greedy(4)] + [greedy(8)] * 4
GROUPS = {"chat (decoding)": CHAT, "long prompt": LONG, "short, queued behind it": SHORT}


def steps_until(t: float, step_records: list[dict]) -> int:
    """How many of the run's steps had started by time t (t falls inside the last of them)."""
    return sum(s["start"] <= t for s in step_records)


def chunk_run(chunked: bool) -> dict:
    engine_llm = make_llm(max_num_batched_tokens=128, enable_chunked_prefill=chunked)
    outs = engine_llm.generate(chunk_prompts, chunk_params, use_tqdm=False)
    steps = engine_llm.engine.stats.to_records()
    ttft_steps = [steps_until(o.metrics.first_token_time, steps) for o in outs]
    return {"outs": outs, "steps": steps, "ttft_steps": ttft_steps,
            "ttft_s": [o.metrics.time_to_first_token for o in outs]}


chunk_results = {chunked: chunk_run(chunked) for chunked in (False, True)}
for chunked, res in chunk_results.items():
    print(f"chunked prefill {'on ' if chunked else 'off'}: {len(res['steps'])} steps; "
          "TTFT in steps: " + ", ".join(f"{g} {[res['ttft_steps'][i] for i in idx]}"
                                        for g, idx in GROUPS.items()))
for chunked, res in chunk_results.items():
    print(f"chunking {'on ' if chunked else 'off'}, first three steps (prefill + decode tokens):",
          [(s["num_prefill_tokens"], s["num_decode_tokens"]) for s in res["steps"][:3]])
print("same tokens with and without chunking:",
      [o.token_ids for o in chunk_results[False]["outs"]]
      == [o.token_ids for o in chunk_results[True]["outs"]])

# %% [markdown]
# Without chunking the long prompt cannot start while the six chats decode (128 − 6 = 122 free
# tokens per step, 124 needed), so it waits until they have finished all their 20 tokens, and
# the four short questions behind it wait just as long, although each would have fitted in any
# step. With chunking, the long prompt starts in the very first step with the 32 tokens left
# over there, finishes in the next, and the short questions follow at once. In seconds
# (machine-dependent), the mean TTFT of each group:

# %%
# NBVAL_IGNORE_OUTPUT
for chunked, res in chunk_results.items():
    means = {g: statistics.mean(res["ttft_s"][i] for i in idx) for g, idx in GROUPS.items()}
    print(f"chunked prefill {'on ' if chunked else 'off'}: "
          + ", ".join(f"{g} {v:.2f} s" for g, v in means.items()))
off = statistics.mean(chunk_results[False]["ttft_s"][i] for i in SHORT)
on = statistics.mean(chunk_results[True]["ttft_s"][i] for i in SHORT)
print(f"short requests' mean TTFT: {off:.2f} s -> {on:.2f} s ({off / on:.1f}x lower with chunking)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.4, 1]})
for k, res in enumerate(chunk_results.values()):
    x = np.arange(1, len(res["steps"]) + 1)
    pre = [s["num_prefill_tokens"] for s in res["steps"]]
    dec = [s["num_decode_tokens"] for s in res["steps"]]
    offset = -0.2 if k == 0 else 0.2
    ax1.bar(x + offset, dec, 0.4, color=COLORS[0], alpha=0.5 if k == 0 else 1.0)
    ax1.bar(x + offset, pre, 0.4, bottom=dec, color=COLORS[1], alpha=0.5 if k == 0 else 1.0)
ax1.axhline(128, color="grey", ls=":", lw=1)
ax1.set_xlabel("engine step (left bar: chunking off, right bar: on)")
ax1.set_ylabel("tokens computed in the step")
ax1.set_title("decode (blue) and prefill (orange) tokens per step", loc="left", fontsize=11)
width = 0.38
for k, (chunked, res) in enumerate(chunk_results.items()):
    means = [statistics.mean(res["ttft_s"][i] for i in idx) for idx in GROUPS.values()]
    ax2.bar(np.arange(3) + (k - 0.5) * width, means, width, color=COLORS[2 + 2 * k],
            label=f"chunked prefill {'on' if chunked else 'off'}")
ax2.set_xticks(range(3), ["chat", "long", "short,\nbehind long"])
ax2.set_ylabel("mean time to first token (s)")
ax2.legend(loc="upper left")
fig.tight_layout()
figure(fig, "06_scheduler_chunked_prefill",
       f"Chunked prefill off and on, with a 128-token step budget (dotted): {len(CHAT)} chats"
       f" decoding, one long prompt and {len(SHORT)} short prompts queued behind it. Left: the"
       " decode and prefill tokens of each engine step (pale: chunking off); right: each group's"
       f" mean time to first token on {device}.")

# %% [markdown]
# The left panel of Figure 6.3 shows the stall: without chunking (pale bars) every step after the
# first computes only the six decodes, far below the budget line, while the long prompt and the
# questions behind it wait; the budget is used only when the long prompt finally goes, in one big
# step. With chunking, the first two steps are full, the third finishes the short prompts, and
# everything after is ordinary decoding. The right panel is what users feel. Chunking is not free
# for everyone: the chat requests' first step now also computes a piece of the long prompt (128
# tokens instead of 96, see the first steps printed above), which can cost them a little; compare
# the chat figures printed above. Production engines accept that trade; vLLM turns chunked prefill
# on by default.
#
# A limit worth knowing: chunking lets a long prompt *start* early, but it does not let later
# arrivals *overtake* it. Once admitted, a prompt being computed in chunks is a running sequence,
# and running sequences get the budget before waiting ones, so requests that arrive while it
# is in progress wait for its last chunk whatever their policy rank. Engines that care cap the
# chunk a single long prompt may take per step (vLLM's `long_prefill_token_threshold`), leaving
# budget to admit others; our scheduler does not have that knob yet.

# %% [markdown]
# **Hints for assignment `06.admit`** (`Scheduler._admit`; its docstring is the specification).
# Try without them first; read one at a time.
#
# 1. The policy has done the sorting: walk `ranked` once and `break` at the first sequence that
#    cannot be admitted. Any `continue` would let a small request overtake a large one.
# 2. Three things can stop a sequence: no budget to run anything of it, no slot (`max_num_seqs`)
#    and no KV blocks. `_fit` answers the last two together, because a policy that evicts frees
#    a slot and blocks in one move; your part is the first, and what to do when `_fit` says no.
# 3. Ask the block manager for the cached prefix *before* deciding the budget: those tokens are
#    already in the cache, so they count as computed, cost no budget and are not part of what
#    the sequence still has to compute. Pass the same `cached` list on to `_fit`.
# 4. Recompute the budget from `batch.num_tokens` for every sequence rather than keeping a
#    running total: when `_fit` evicts, it takes the victim's tokens out of the batch.
# 5. Chunked prefill off means all or nothing: a prompt larger than the budget left waits whole
#    (and so does everyone behind it).
# 6. The order of the state changes matters only in one place: `num_computed_tokens` must be
#    set before `batch.add`, which reads it (a decode or not, sampling or not).

# %% [markdown]
# ## 5. Preemption: running out of KV cache
#
# Admission checks that a request's *prompt* fits in the KV cache, but every decode step needs a
# new slot per sequence, and every 16 tokens a new block. If all running sequences keep growing,
# the cache runs out mid-flight. The scheduler then **preempts** the lowest-ranked running
# sequence: it frees its blocks, puts it back in the waiting queue, and later recomputes its
# KV entries (prompt *and* the tokens generated so far) in one prefill step. This is
# *recompute* preemption; the alternative, swapping the blocks out to host memory, saves the
# recomputation at the price of copies. With prefix caching on, the freed blocks keep their
# contents until they are recycled, so a recomputation often finds most of them still there.
#
# Preempting is short: free the blocks, forget the progress, wait again. Choosing *whom* to
# preempt, and when to stop, is the running loop's job (`Scheduler._schedule_running`, shown in
# section 1):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(Scheduler._preempt)

# %% [markdown]
# The experiment: eight requests (prompts of 20–34 tokens, 24 new tokens each) with a KV cache
# of only 12 blocks of 16 tokens, against the same requests with 128 blocks. The first line
# printed below says how many blocks the eight need at their longest: far more than 12.

# %%
# NBVAL_CHECK_OUTPUT
pre_prompts = [prompt(200 + i, 20 + 2 * i) for i in range(8)]
pre_params = greedy(24)
runs_kv = {}
for blocks in (128, 12):
    engine_llm = make_llm(num_kv_blocks=blocks, max_num_seqs=8)
    outs = engine_llm.generate(pre_prompts, pre_params, use_tqdm=False)
    runs_kv[blocks] = {"outs": outs, "steps": engine_llm.engine.stats.to_records(),
                       "engine": engine_llm.engine}
prompt_tokens = sum(len(p) for p in pre_prompts)
blocks_needed = [-(-(len(p) + pre_params.max_tokens) // 16) for p in pre_prompts]
print(f"blocks needed at the end: {blocks_needed}, {sum(blocks_needed)} in all")
for blocks, res in runs_kv.items():
    engine = res["engine"]
    print(f"{blocks:>3} blocks: {len(res['steps'])} steps, "
          f"{engine.scheduler.num_preemptions} preemptions, "
          f"prefill tokens computed {engine.stats.num_prefill_tokens} "
          f"(prompts: {prompt_tokens}), "
          f"peak KV usage {max(s['kv_usage'] for s in res['steps']):.0%}, "
          f"tokens found in the prefix cache {engine.block_manager.hit_tokens}")
print("preemptions per request:", [o.metrics.num_preemptions for o in runs_kv[12]["outs"]])
small = runs_kv[12]
before = [{"num_running": 0, "num_preemptions": 0}] + small["steps"]
for prev, st in zip(before, small["steps"]):
    if st["num_preemptions"] > prev["num_preemptions"]:
        finished = sum(steps_until(o.metrics.finished_time, small["steps"]) == st["step"] + 1
                       for o in small["outs"])
        print(f"  step {st['step'] + 1:>2}: a preemption; running {prev['num_running']} -> "
              f"{st['num_running']}, {finished} finished in this step, "
              f"KV usage after {st['kv_usage']:.0%}")
print("outputs identical to the unconstrained run:",
      [o.token_ids for o in runs_kv[12]["outs"]] == [o.token_ids for o in runs_kv[128]["outs"]])

# %% [markdown]
# Read the small-cache line against the large-cache one: the same tokens came out, at the cost
# of more steps (fewer sequences fit at once) and of extra prefill tokens: the KV entries the
# preempted sequences had to recompute. It would have been more without the prefix cache: a
# preempted sequence's full blocks keep their contents until they are recycled, and on
# readmission the block manager found the number of tokens printed above still there. The
# victims are never the three oldest requests: the victim is always the lowest-ranked *running*
# sequence, and `fcfs` ranks by arrival. The engine's per-step statistics (`llm.engine.stats`)
# show how it unfolds:

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.6))
for k, (blocks, res) in enumerate(runs_kv.items()):
    steps = res["steps"]
    ax.plot([s["step"] + 1 for s in steps], [100 * s["kv_usage"] for s in steps],
            "-", color=COLORS[k], label=f"{blocks} KV blocks")
    events = [s for prev, s in zip([{"num_preemptions": 0}] + steps, steps)
              if s["num_preemptions"] > prev["num_preemptions"]]
    if events:
        ax.plot([s["step"] + 1 for s in events], [100 * s["kv_usage"] for s in events], "v",
                color=COLORS[3], ms=8, label="a preemption in this step")
    ax.plot([s["step"] + 1 for s in steps], [12.5 * s["num_running"] for s in steps], ":",
            color=COLORS[k], lw=1.2)
ax.set_xlabel("engine step")
ax.set_ylabel("KV blocks in use (%)")
ax.set_title("KV usage per step (dotted: running sequences, 8 = 100%)", loc="left", fontsize=11)
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3)
figure(fig, "06_scheduler_preemption",
       "KV-cache usage per engine step for one workload run with"
       f" {' and '.join(map(str, runs_kv))} KV blocks; triangles mark steps that preempted a"
       " sequence, dotted lines count the running sequences. With the small cache the scheduler"
       " preempts and recomputes instead of failing.")

# %% [markdown]
# In Figure 6.4, with 128 blocks (blue) usage creeps up as the eight answers grow and never comes
# close to full. With 12 blocks (orange) the cache is full almost all the time: each triangle is a
# step in which a sequence lost its blocks, and the dotted line shows the running set shrinking and
# refilling. The engine never stalls and never fails; it trades compute for memory.
#
# The deep dip deserves a look (the event where the running set falls to zero, printed above).
# In that step three requests computed their last token, and the fourth needed a fresh block
# for its next one. Blocks are freed only *after* a step (the finishing requests still use
# theirs while it runs), so there was none, and the sequence that needed it, being the
# lowest-ranked one running, was the victim: it preempted itself. And because the scheduler
# admits nobody new in a step that preempted (admitting would only cause the next preemption),
# the step ends with an empty cache. The victim returns at the next step, where prefix caching
# hands back its full blocks. The rule "the victim is always the lowest-ranked running
# sequence" keeps the work of the most important requests; a smarter scheduler could also
# notice that blocks are about to be freed and let the victim sit out one step instead.

# %% [markdown]
# **Hints for assignment `06.preempt`** (`Scheduler._schedule_running`; its docstring is the
# specification). Read one at a time.
#
# 1. Two ends of one queue: the loop serves sequences from the front (most important first)
#    and takes victims from the back (least important not yet served). `collections.deque`
#    does both in O(1).
# 2. A sequence already served this step is never a victim, even if it ranks low: it has left
#    the queue. Only the ones still waiting their turn can give up their blocks.
# 3. Retry the allocation after each victim: one victim may free too few blocks, or (with
#    prefix caching) blocks that others still hold. When the queue is empty the sequence itself
#    is the only one left to preempt; stop trying then.
# 4. A sequence with no budget this step is still running: it keeps its blocks and its place in
#    `self.running`, and does not join the batch.
# 5. Python's `while ... else` runs the `else` branch only when the loop ended without `break`,
#    i.e. when the allocation succeeded.

# %% [markdown]
# ## 6. Policies: who goes first
#
# When everything fits, the order of the queue does not matter. When it does not (too few slots,
# too small a budget, too little KV cache) someone waits, and a **policy** decides who. In the
# package a policy is anything with a method `order(seqs, now)` that returns the unfinished
# sequences, most important first; the scheduler does the rest (section 1). Four are built in
# (`nanovllm/engine/policies.py`):
#
# | name | ranks by | per-request fields used |
# |---|---|---|
# | `"fcfs"` | arrival time | — |
# | `"priority"` | priority, aged by waiting time, tightened by deadlines | `priority` (per request), `deadline` |
# | `"fair"` | round robin between tenants | `user` |
# | `"mixed"` | reserved shares of the slots per class | `request_class` |
#
# `PriorityPolicy` deserves a closer look. Strict priority starves: a low-priority request never
# runs while high-priority ones keep arriving. So each request's effective priority improves
# with waiting, by `aging_rate` levels per second, and a deadline tighter than the default counts
# as time already waited:
#
# $$p_{\text{eff}} = p - a\,(t_{\text{now}} - t_{\text{arrival}}) - a\,(D_{\text{default}} - D).$$
#
# Because every request ages at the same rate $a$, subtracting the common term $a\,t_{\text{now}}$
# leaves a key that does not depend on time at all, $p + a\,(t_{\text{arrival}} + D)$, the
# request's *virtual due time*: the order of two requests never flips while they wait. That is
# what makes it safe for this policy to **evict** a lower-ranked running request to admit a more
# urgent one (`preempts_to_admit = True`), with no risk of the two evicting each other in turn.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(PriorityPolicy.order, FairPolicy.order, MixedPolicy.order)

# %% [markdown]
# The workload: user **A** runs a batch job of six requests (48-token prompts, 4 to 12 new
# tokens, `request_class="batch"`, priority 1); a moment later user **B** sends six
# interactive questions (12-token prompts, 3 new tokens each, `request_class="interactive"`,
# priority 0). As in vLLM, a priority belongs to the request, not to its sampling settings:
# `generate(prompts, params, priority=[...])` and `chat` take one integer per prompt (lower
# runs first), `LLMEngine.add_request` and `AsyncEngine.submit` a `priority=` integer for their
# one request, and the policy reads it as `seq.priority`. The engine has four slots. We serve
# the workload under each policy, with `mixed` reserving 75% of the slots for interactive work,
# and measure each class's mean TTFT and end-to-end latency, in steps (the same on every
# machine) and in seconds (not).

# %%
# NBVAL_CHECK_OUTPUT
BATCH_TOKENS = [10, 8, 6, 12, 4, 8]
work_prompts = [prompt(300 + i, 48) for i in range(6)] + [prompt(400 + i, 12) for i in range(6)]
work_params = ([greedy(n, user="A", request_class="batch") for n in BATCH_TOKENS]
               + [greedy(3, user="B", request_class="interactive")] * 6)
work_priority = [1] * 6 + [0] * 6
CLASSES = {"batch": range(6), "interactive": range(6, 12)}
POLICY_CHOICES = {
    "fcfs": lambda: "fcfs",
    "priority": lambda: "priority",
    "fair": lambda: "fair",
    "mixed": lambda: MixedPolicy({"interactive": 0.75, "batch": 0.25}),
}


def label(i: int) -> str:
    return f"A{i}" if i < 6 else f"B{i - 6}"


def serve(policy) -> dict:
    """Serve the mixed workload under `policy`; who was admitted when, latencies in steps."""
    engine_llm = make_llm(max_num_seqs=4, scheduler_policy=policy)
    engine_llm.engine.timeline = TimelineRecorder()
    outs = engine_llm.generate(work_prompts, work_params, use_tqdm=False, priority=work_priority)
    steps = engine_llm.engine.stats.to_records()
    first_step = {}
    for r in engine_llm.engine.timeline.to_records():
        first_step.setdefault(r["request_id"], r["step"] + 1)
    admitted = {}
    for i, o in enumerate(outs):
        admitted.setdefault(first_step[o.request_id], []).append(label(i))
    return {
        "outs": outs,
        "admitted": " ".join(f"{k}:[{' '.join(v)}]" for k, v in sorted(admitted.items())),
        "ttft_steps": [steps_until(o.metrics.first_token_time, steps) for o in outs],
        "e2e_steps": [steps_until(o.metrics.finished_time, steps) for o in outs],
        "preemptions": engine_llm.engine.scheduler.num_preemptions,
        "tokens": [o.token_ids for o in outs],
    }


served = {name: serve(make()) for name, make in POLICY_CHOICES.items()}
print("admissions, as step:[requests admitted in that step]")
for name, res in served.items():
    print(f"  {name:<9} {res['admitted']}   ({res['preemptions']} preemptions)")
print(f"\n{'policy':<9} {'class':<12} {'mean steps to first token':>26} "
      f"{'mean steps to finish':>21}")
for name, res in served.items():
    for c, idx in CLASSES.items():
        print(f"{name:<9} {c:<12} {statistics.mean(res['ttft_steps'][i] for i in idx):>26.2f} "
              f"{statistics.mean(res['e2e_steps'][i] for i in idx):>21.2f}")
print("every policy produced the same tokens:",
      all(res["tokens"] == served["fcfs"]["tokens"] for res in served.values()))

# %% [markdown]
# The admission lists tell the story. `fcfs` starts user A's batch job first because it
# arrived first, and B's six short questions wait until most of it is done. `priority` admits
# four of B's questions in the very first step (priority 0 beats 1), and the last two as soon as
# slots free up. `fair` splits the slots between the users from the first step (A0 and A1 run
# with B0 and B1), and as B's short questions finish, B's next ones take their places: B, with
# far less work, is done early, yet A is never shut out. `mixed` keeps three of the four slots
# for interactive work and one for batch (A0 runs from the first step beside B0–B2). No policy
# had to preempt anything here: there was room for the first four requests of every order, and
# nobody arrived later to evict them.
# Scheduling never changes *what* is generated, only *when*. The same in seconds, from each
# request's `RequestMetrics`, summarised with `latency_summary`:

# %%
# NBVAL_IGNORE_OUTPUT
table = {}
for name, res in served.items():
    for c, idx in CLASSES.items():
        summary = latency_summary(res["outs"][i].metrics for i in idx)
        table[name, c] = (summary["time_to_first_token"]["mean"], summary["e2e_latency"]["mean"])
print(f"{'policy':<9} {'class':<12} {'mean TTFT s':>12} {'mean e2e s':>11}")
for (name, c), (ttft, e2e) in table.items():
    print(f"{name:<9} {c:<12} {ttft:>12.2f} {e2e:>11.2f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
names = list(served)
for ax, k, what in [(axes[0], 0, "mean time to first token (s)"),
                    (axes[1], 1, "mean end-to-end latency (s)")]:
    for j, c in enumerate(CLASSES):
        ax.bar(np.arange(len(names)) + (j - 0.5) * 0.38, [table[n, c][k] for n in names], 0.38,
               color=COLORS[j], label=f"{c} (user {'A' if c == 'batch' else 'B'})")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(what)
axes[0].legend(loc="upper right")
fig.suptitle("One workload, four policies: 6 batch + 6 interactive requests, 4 slots", x=0.02,
             ha="left", fontsize=12)
fig.tight_layout()
figure(fig, "06_scheduler_policies",
       f"Mean time to first token (left) and end-to-end latency (right) of the batch requests"
       f" (user A) and the interactive ones (user B) under the {len(names)} scheduling policies,"
       f" one workload on {device}. A policy moves waiting time from one class to the other.")

# %% [markdown]
# In Figure 6.5, under `fcfs` the interactive class waits longest of all four policies although its
# requests are the cheapest; `priority` and `mixed` give it the shortest waits, at the batch job's
# expense; `fair` sits in between, because its rule is about users rather than classes. (The table
# in steps above gives the exact figures; the chart shows the same in seconds.) No policy is best
# for everyone: the total work is the same, and a policy only moves waiting time from one group of
# requests to another. Choosing a policy is choosing whose time matters more.

# %% [markdown]
# ## 7. Writing your own policy
#
# A policy is a function `order(seqs, now) -> list` (or an object with such a method), passed as
# `scheduler_policy`. Each `Sequence` carries what a policy may need: `params` (the request's
# `SamplingParams`, with `max_tokens`, `deadline`, ...), `priority`, `user`, `request_class`,
# `num_prompt_tokens`, `num_output_tokens`, `metrics.arrival_time`, and `status`.
#
# A classic of scheduling theory: with all jobs present at the start and identical parallel
# machines (our four slots, each job occupying one slot for as many steps as it has tokens),
# serving the **shortest job first** minimises the mean completion time; when jobs arrive over
# time, its preemptive cousin, **shortest remaining processing time** (SRPT), does the same for
# a single machine. An LLM engine does not know how long an answer will be, but `max_tokens` is
# an upper bound the user gave us, and with `ignore_eos` (as here) it is exact. A few lines:

# %%
# NBVAL_CHECK_OUTPUT
def shortest_remaining_first(seqs, now):
    """SRPT: fewest tokens still to generate first (ties: earlier arrival)."""
    return sorted(seqs, key=lambda s: (s.params.max_tokens - s.num_output_tokens,
                                       s.metrics.arrival_time, s.seq_id))


served["srpt (ours)"] = serve(shortest_remaining_first)
res = served["srpt (ours)"]
print(f"srpt (ours) admissions: {res['admitted']}   ({res['preemptions']} preemptions)")
print("same tokens as fcfs:", res["tokens"] == served["fcfs"]["tokens"])
print(f"\n{'policy':<12} {'mean steps to finish (12 requests)':>35} "
      f"{'last one finishes at step':>26}")
for name, r in served.items():
    print(f"{name:<12} {statistics.mean(r['e2e_steps']):>35.2f} {max(r['e2e_steps']):>26}")

# %% [markdown]
# Our function was wrapped in a `FunctionPolicy` and used like the built-in ones. It admitted
# B's questions first, like `priority`, but it also ordered A's batch jobs by length (A4, which
# wants only 4 tokens, and A2 before A0 and A3), and it has the lowest mean completion time of
# all five policies. It pays in two ways. The longest job goes last, so the workload as a whole
# finishes later (the last column: `fcfs` is best there). And with requests arriving all the
# time, a long request can starve while short ones keep coming; the aging of `PriorityPolicy`
# is the usual cure.
#
# A function policy never evicts running sequences to admit waiting ones. A class can opt in
# with `preempts_to_admit = True`, but only if its ranking of two sequences cannot flip from
# step to step (SRPT's can: a running request's remaining work shrinks), or the engine would
# thrash. Classes can also define `on_admit(seq, now)` to keep state, as `FairPolicy` does.

# %% [markdown]
# ## 8. The async engine in brief
#
# `LLM.generate` is *offline*: it takes every request up front and returns when all are done. A
# server receives requests at any time from many connections and must stream tokens back as
# they are produced. `AsyncEngine` (`nanovllm/engine/async_engine.py`) does this with the
# classic **producer/consumer** design: one engine thread owns the `LLMEngine` and runs the step
# loop; producers in any thread call `submit`, which validates the request and puts it in an
# inbox; each request gets a `RequestStream` that its consumer iterates for chunks of new
# tokens. The scheduler does not care where requests come from: whatever sits in the inbox at a
# step boundary joins the continuous batch.
#
# Two client threads, each submitting one request and reading its stream:

# %%
async_prompts = {"alice": "What is a scheduler?", "bob": "Name three colours."}
async_params = greedy(12)
server = AsyncEngine(make_llm(max_num_seqs=4).engine)
server.engine.timeline = TimelineRecorder()
received = {}


def client(name: str) -> None:
    chunks = list(server.submit(async_prompts[name], async_params, request_id=name))
    received[name] = chunks


threads = [threading.Thread(target=client, args=(name,)) for name in async_prompts]
for t in threads:
    t.start()
for t in threads:
    t.join()
server.shutdown()

reference = llm.generate(list(async_prompts.values()), async_params, use_tqdm=False)
for name, ref in zip(async_prompts, reference):
    chunks = received[name]
    tokens = [t for c in chunks for t in c.token_ids]
    print(f"{name}: {len(chunks)} chunks, finish_reason {chunks[-1].finish_reason!r}, "
          f"same tokens as LLM.generate: {tokens == ref.token_ids}")
    print("   ", repr("".join(c.text for c in chunks)))

# %% [markdown]
# Each stream delivered one chunk per engine step, ending with a chunk that carries the finish
# reason, and the tokens equal those of the offline API. Did the two requests really share
# steps? The timeline says (this depends on thread timing, so it is not checked):

# %%
# NBVAL_IGNORE_OUTPUT
by_step = {}
for r in server.engine.timeline.to_records():
    by_step.setdefault(r["step"], set()).add(r["request_id"])
shared = sum(len(ids) == 2 for ids in by_step.values())
print(f"{len(by_step)} engine steps, {shared} of them served alice and bob together")

# %% [markdown]
# Chapter 10 builds the rest of the serving story on this engine: asyncio streams, aborts,
# an OpenAI-compatible HTTP server, rate limiting and a load test with latency percentiles.

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# these parts of the package yourself: admission under the token and sequence budgets, the
# running sequences' loop with recompute preemption, and the fair policy's order. Each function's docstring is the handout; the project's tests grade
# your code (`make check CHAPTERS=06` in your edition), and once they pass this notebook runs on your
# own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("06"))

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to complete (replace its `raise NotImplementedError`), followed by
# a cell that checks it on hand-worked
# cases and seeded random inputs, without importing `nanovllm`.
#
# **Exercise 1 — shortest prompt first.** Write the policy `shortest_prompt_first(seqs, now)`:
# return the sequences ordered by prompt length (`num_prompt_tokens`), shortest first, ties
# broken by earlier `metrics.arrival_time`, then by smaller `seq_id`. The check passes stand-ins
# for sequences (`types.SimpleNamespace` objects with just those three attributes) and compares
# your order with a hand-worked example and, on random inputs, with a property every adjacent
# pair must satisfy. Passed as `scheduler_policy`, such a function decides the order in which
# the scheduler admits waiting requests (section 7).

# %% tags=["exercise"]
def shortest_prompt_first(seqs, now):
    """Shortest prompt first; ties: earlier arrival, then smaller seq_id."""
    raise NotImplementedError("exercise 06.shortest_prompt_first")


# %% tags=["check", "raises-exception"]
import random
from types import SimpleNamespace


def stand_in(seq_id, num_prompt_tokens, arrival_time):
    """What the policy may read of a Sequence, and nothing else."""
    return SimpleNamespace(seq_id=seq_id, num_prompt_tokens=num_prompt_tokens,
                           metrics=SimpleNamespace(arrival_time=arrival_time))


# hand-worked: lengths first (2 < 3 < 5), then arrival among the 3s, then seq_id among equals
example = [stand_in(0, 5, 0.0), stand_in(1, 3, 2.0), stand_in(2, 3, 1.0), stand_in(3, 2, 9.0),
           stand_in(4, 3, 1.0)]
got = [s.seq_id for s in shortest_prompt_first(list(example), 0.0)]
assert got == [3, 2, 4, 1, 0], f"expected seq_ids [3, 2, 4, 1, 0], got {got}"

rng = random.Random(601)
for _ in range(200):
    ids = rng.sample(range(100), rng.randint(1, 12))  # seq_ids in random order
    # few lengths and arrival times: ties on purpose
    seqs = [stand_in(i, rng.randint(1, 6), float(rng.randint(0, 3))) for i in ids]
    got = list(shortest_prompt_first(list(seqs), rng.uniform(0, 10)))
    assert sorted(s.seq_id for s in got) == sorted(ids), "return every sequence exactly once"
    for a, b in zip(got, got[1:]):  # each adjacent pair must be in order, tie-breakers included
        la, lb = a.num_prompt_tokens, b.num_prompt_tokens
        ta, tb = a.metrics.arrival_time, b.metrics.arrival_time
        in_order = la < lb or (la == lb and (ta < tb or (ta == tb and a.seq_id < b.seq_id)))
        assert in_order, f"seq {a.seq_id} ({la} tokens, arrival {ta}) came before " \
            f"seq {b.seq_id} ({lb} tokens, arrival {tb})"
print("Exercise 1 passed: shortest_prompt_first orders by length, arrival, then seq_id")

# %% [markdown]
# **Exercise 2 — latency from timestamps.** A request arrived at time `arrival` and its output
# tokens came out at the times in `token_times` (sorted). Write `ttft_tpot(arrival, token_times)`
# returning `(ttft, tpot)`: the time to the first token, and the time per output token, the mean
# gap between consecutive tokens *after* the first (None when there are fewer than two tokens).
# The check tries hand-worked timestamps, then random ones against exact rational arithmetic
# (`fractions.Fraction`); `RequestMetrics` (`nanovllm/outputs.py`) defines TTFT and TPOT this way.

# %% tags=["exercise"]
def ttft_tpot(arrival: float, token_times: list[float]) -> tuple[float, float | None]:
    """Time to first token and mean inter-token time after the first (None if < 2 tokens)."""
    raise NotImplementedError("exercise 06.ttft_tpot")


# %% tags=["check", "raises-exception"]
import math
import random
from fractions import Fraction

# hand-worked: first token 0.5 s after arrival, then gaps of 0.5 s and 1.5 s (mean 1.0 s)
assert ttft_tpot(1.0, [1.5, 2.0, 3.5]) == (0.5, 1.0), f"got {ttft_tpot(1.0, [1.5, 2.0, 3.5])}"
assert ttft_tpot(2.0, [2.25]) == (0.25, None), "one token: TTFT 0.25, TPOT undefined (None)"

rng = random.Random(602)
for _ in range(200):
    arrival = rng.uniform(0, 100)
    times = sorted(arrival + rng.uniform(0, 5) for _ in range(rng.randint(1, 20)))
    # reference: exact rationals, the mean of the gaps one by one
    exact_ttft = Fraction(times[0]) - Fraction(arrival)
    gaps = [Fraction(b) - Fraction(a) for a, b in zip(times, times[1:])]
    ttft, tpot = ttft_tpot(arrival, times)
    assert math.isclose(ttft, float(exact_ttft), rel_tol=1e-9, abs_tol=1e-12), "wrong TTFT"
    if not gaps:
        assert tpot is None, "TPOT is undefined for a single token: return None"
    else:
        assert tpot is not None and math.isclose(tpot, float(sum(gaps) / len(gaps)),
                                                 rel_tol=1e-9, abs_tol=1e-12), "wrong TPOT"
print("Exercise 2 passed: ttft_tpot agrees with hand-worked cases and exact arithmetic")

# %% [markdown]
# **Exercise 3 — the token budget.** Prompts of lengths `prompt_lens` all wait at time 0, first
# come first served, each wanting a single new token (so a sequence is done in the step its
# prompt is complete). Chunked prefill is on, slots and KV cache are unlimited, and every step
# may compute at most `budget` tokens. Write `chunk_plan(prompt_lens, budget)` returning the
# schedule: one list per step of `(request index, tokens computed)` pairs, in the order the
# scheduler serves them (requests already started first, then new ones). Hint: fill each
# step's budget in order; a request gets `min(its remaining tokens, budget left)`. The check tries
# hand-worked plans, then random prompt lengths and budgets against a simulation that hands out
# each step's budget one token at a time (the package's `Scheduler` produces the same plans).

# %% tags=["exercise"]
def chunk_plan(prompt_lens: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Per step, the (request index, tokens) pairs a FCFS chunked-prefill scheduler computes."""
    raise NotImplementedError("exercise 06.chunk_plan")


# %% tags=["check", "raises-exception"]
import random

# hand-worked: budget 4 over prompts of 5, 3 and 7 tokens
assert chunk_plan([5, 3, 7], 4) == [[(0, 4)], [(0, 1), (1, 3)], [(2, 4)], [(2, 3)]], \
    f"chunk_plan([5, 3, 7], 4) = {chunk_plan([5, 3, 7], 4)}"
assert chunk_plan([2, 2, 2], 10) == [[(0, 2), (1, 2), (2, 2)]], "everything fits in one step"
assert chunk_plan([3], 1) == [[(0, 1)], [(0, 1)], [(0, 1)]], "budget 1: one token per step"


def token_at_a_time(prompt_lens, budget):
    """Each step, give the budget's tokens one by one to the first request with work left."""
    remaining, plan = list(prompt_lens), []
    while sum(remaining) > 0:
        served = []  # request index of each token computed in this step
        for _ in range(budget):
            waiting = [i for i, r in enumerate(remaining) if r > 0]
            if not waiting:
                break
            remaining[waiting[0]] -= 1
            served.append(waiting[0])
        step = []
        for i in served:  # run-length encode: [0, 0, 1] -> [(0, 2), (1, 1)]
            if step and step[-1][0] == i:
                step[-1] = (i, step[-1][1] + 1)
            else:
                step.append((i, 1))
        plan.append(step)
    return plan


rng = random.Random(603)
for _ in range(100):
    lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
    budget = rng.randint(1, 80)
    expected = token_at_a_time(lens, budget)
    got = [[tuple(pair) for pair in step] for step in chunk_plan(lens, budget)]
    assert got == expected, f"prompts {lens}, budget {budget}: expected {expected}, got {got}"
print("Exercise 3 passed: chunk_plan fills every step's token budget as expected")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/06.json` *before* measuring; then `make analysis CH=06 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("06")

# %% [markdown]
# ## Summary
#
# * The scheduler decides, before every step, which sequences run and how many tokens each
#   computes, under a slot limit (`max_num_seqs`), a token budget (`max_num_batched_tokens`) and
#   the KV cache. It never changes *what* is generated: every experiment above produced
#   identical tokens however it scheduled them.
# * **Continuous batching** refills a slot the step after it frees; static batching holds it
#   until the batch's longest request ends. On our eight requests that was the difference
#   between the step counts printed in §1 and §2, and the engine's schedule matched a ten-line
#   simulator exactly.
# * **Continuous against static batching** with 8 to 32 requests: the gain is the static
#   schedule's idle slot-steps, set by how much output lengths differ, not by the number of
#   requests. We measured the "3–5× above 8 requests" claim instead of repeating it (the steps
#   and the verdict are printed in §3).
# * **Chunked prefill** lets a prompt that does not fit next to the running decodes start at
#   once, which removes head-of-line blocking for the requests behind it; it does not let later
#   arrivals overtake a prompt already in progress.
# * **Preemption** (recompute) keeps the engine running when the KV cache is full, at the price
#   of recomputation that the prefix cache partly saves; outputs are unchanged.
# * **Policies** only move waiting time between requests: `fcfs` by arrival, `priority` by a
#   time-independent virtual due time (aging plus deadlines, safe to evict for), `fair` by
#   tenant, `mixed` by reserved class shares. A custom policy is one function; SRPT minimised the
#   mean completion time of our workload.
# * The **async engine** feeds the same scheduler from many threads; chapter 10 turns it into a
#   server.
#
# Next, chapter 07 makes each decode step cheaper on a GPU by capturing it as a CUDA graph.

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(saved_threads)
print(f"torch threads restored to {torch.get_num_threads()}; "
      f"chapter ran in {time.perf_counter() - chapter_start:.0f} s")

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
# # Chapter 07 — CUDA graphs
#
# Chapter 05 made the attention kernel fast: it streams the KV cache of a layer at nearly the
# full memory bandwidth, in tens of microseconds for a typical batch. A decode step runs that
# kernel once per layer, plus the matrix multiplies, the norms, the rotary embedding and the
# sampler: a few milliseconds of GPU work. Yet the same step, run the ordinary way from Python,
# takes several times longer. This chapter finds where the rest goes (**launch overhead**), and
# removes most of it with **CUDA graphs**: record the whole step once, replay it with a single
# launch.
#
# We first count the kernels one decode step launches and measure what one launch costs the
# host. Then we see what capture and replay mean, with a small recorder that runs on any CPU
# and with the real `torch.cuda.CUDAGraph` on a GPU. A graph replays exactly what it recorded,
# which imposes two disciplines on the engine: **static buffers** (inputs are copied into
# memory the graph knows) and **batch-size buckets** (one graph per padded batch size). We read
# the package's implementation, check the padding contract it relies on, and plot the speedup
# measured on an H200, which shrinks as the batch grows, for a reason we can compute. The same
# measurement, with and without the fused kernels of chapter 11, shows how graphs and kernel
# fusion attack the same fixed cost from two sides.
#
# Package modules taught here: `nanovllm/engine/cuda_graphs.py` (`batch_buckets`, `StaticInputs`,
# `DecodeGraphs`), where `nanovllm/engine/model_runner.py` switches graphs on, and
# `decode_step_benchmark` in `nanovllm/benchmarks/decode_step.py`.

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(7)

# %% [markdown]
# ## Setup
#
# One experiment below runs the package's Triton kernels. On a machine without CUDA they run
# under the Triton interpreter, which must be chosen before `triton` is first imported.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

# %%
import collections
import inspect
import json
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path
from nanovllm.viz import BOOK_COLORS, figure, figures_dir, show_source, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
use_book_style()


# %% [markdown]
# ## 1. Launch overhead, made visible
#
# When PyTorch runs `y = x @ w` on a GPU, the Python interpreter and PyTorch's dispatcher work
# out which kernel to call, the CUDA driver packs its arguments and puts it in a queue, and
# control returns to Python before the GPU has even started. That host-side work takes a few
# microseconds to a few tens of microseconds per operation, **whatever the size of the
# tensors**. When a kernel's GPU work is shorter than its launch cost, the GPU waits for the
# CPU: the step is *launch-bound*.
#
# ### 1.1 How many operations is one decode step?
#
# We count them. A `TorchDispatchMode` sees every ATen operation PyTorch executes; we skip
# *views* (reshapes, slices, transposes), which only change metadata and launch nothing, and
# count the rest: each is at least one kernel launch on a GPU. The model is the benchmark model
# of this book, Qwen3-0.6B, with its real structure (28 layers, 16 query heads over 8 KV heads,
# per-head q/k norms) but tiny widths, because the number of operations does not depend on how
# wide the matrices are, and tiny widths run in no time on a CPU. We tag each operation with
# the phase of the step it belongs to: the model's layers (with the embedding and the final
# norm), attention (the backend's `store_kv` and `attend`), and the LM head plus the sampler.
# (Preparing the inputs builds Python lists and NumPy arrays, no tensor operations; on a GPU
# it adds two host-to-device copies.)

# %%
class OpCounter(TorchDispatchMode):
    """Counts non-view ATen operations, per phase (set `.phase` to switch)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.phase = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # views only change metadata: no kernel
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))


def in_phase(counter, phase, fn):
    """Wrap fn so that the operations it runs are counted under `phase`."""
    def wrapped(*args, **kwargs):
        before, counter.phase = counter.phase, phase
        try:
            return fn(*args, **kwargs)
        finally:
            counter.phase = before
    return wrapped


# Qwen3-0.6B's structure with tiny widths (the operation count depends only on the structure).
qwen3 = json.loads((config_path("qwen3-0.6b") / "config.json").read_text())
tiny = {**qwen3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024}
tiny_dir = Path(tempfile.mkdtemp())
(tiny_dir / "config.json").write_text(json.dumps(tiny))
llm = LLM(tiny_dir, load_format="dummy", device="cpu", num_kv_blocks=64, max_model_len=256)
engine, runner = llm.engine, llm.engine.runner

counter = OpCounter()
runner.model.model.forward = in_phase(counter, "layers", runner.model.model.forward)
runner.backend.store_kv = in_phase(counter, "attention", runner.backend.store_kv)
runner.backend.attend = in_phase(counter, "attention", runner.backend.attend)
runner.model.compute_logits = in_phase(counter, "LM head + sampling", runner.model.compute_logits)
runner.sampler.forward = in_phase(counter, "LM head + sampling", runner.sampler.forward)

for i in range(8):  # 8 sequences: one prefill step, then decode steps
    engine.add_request(None, [i + 1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
engine.step()  # the prefill
with counter:
    engine.step()  # one decode step of 8 sequences
layers = tiny["num_hidden_layers"]
print(f"one decode step (8 sequences, {layers} layers), non-view operations by phase:")
for phase, n in counter.counts.most_common():
    print(f"  {phase:20s} {n:5d}")
total_ops = sum(counter.counts.values())
attention_ops = counter.counts["attention"]
print(f"  {'total':20s} {total_ops:5d}")
print(f"per layer: {(counter.counts['layers']) / layers:.0f} outside attention "
      f"+ {attention_ops / layers:.0f} in the torch attention backend")

# %% [markdown]
# Nearly 1,800 operations for one decode step. The count does not depend on the batch size
# either: 8 sequences or 256, the same operations run, on bigger tensors. (Outside attention,
# a layer's operations are its projections, the q/k norms, the rotary embedding, the residual
# adds and the MLP; the `other` one is the engine's bookkeeping.)
#
# On a GPU the engine uses the `triton` backend, which replaces the 15 operations of the
# PyTorch attention backend with two Triton launches per layer (`store_kv` and
# `decode_attention`, chapter 05; three when split-KV adds the merge kernel). With the PyTorch
# path for everything else, a decode step of Qwen3-0.6B on a GPU launches about this many
# kernels:

# %%
launches_gpu = total_ops - attention_ops + 2 * layers
print(f"estimated kernel launches per decode step, triton attention + PyTorch path: "
      f"{launches_gpu}")

# %% [markdown]
# That is the engine before chapter 11, which fuses each layer's norms (with their residual
# adds), its q/k norm with the rotary embedding, and the MLP's activation into single Triton
# kernels; the engine switches them on together with the `triton` backend, and then a decode
# step is about 310 kernels, as `torch.profiler` counted on an H200 (the sampler's kernels
# included):

# %%
profile_record = json.loads((figures_dir() / "data" / "profile_h200.json").read_text())
print(f"recorded on {profile_record['device']}, {profile_record['date']}: "
      f"`{profile_record['command']}`")
for run in profile_record["runs"]:
    print(f"batch {run['batch']}, async scheduling {'on ' if run['async_scheduling'] else 'off'}:"
          f" {run['kernels_per_step']:.0f} kernels per decode step")
kernels_fused = round(sum(r["kernels_per_step"] for r in profile_record["runs"])
                      / len(profile_record["runs"]))

# %% [markdown]
# ### 1.2 What one launch costs
#
# Time a loop of tiny operations, each on a one-element tensor so that the arithmetic itself
# costs nothing: what remains is the per-operation overhead of Python and PyTorch. On a GPU the
# same loop adds the driver's launch cost, and we synchronise at the end so that all the work
# is counted. (Timings depend on the machine and are not checked by the tests.)

# %%
# NBVAL_IGNORE_OUTPUT
def per_op_us(dev: str, n: int = 2000) -> float:
    x = torch.zeros(1, device=dev)
    for _ in range(100):  # warm-up
        x.add_(1)
    if dev == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


cpu_us = per_op_us("cpu")
print(f"this CPU: {cpu_us:.1f} µs per tiny PyTorch operation "
      f"-> {launches_gpu} operations = {launches_gpu * cpu_us / 1e3:.1f} ms of pure overhead")
if torch.cuda.is_available():
    gpu_us = per_op_us("cuda")
    print(f"{torch.cuda.get_device_name()}: {gpu_us:.1f} µs per tiny launch "
          f"-> {launches_gpu * gpu_us / 1e3:.1f} ms per decode step")

# %% [markdown]
# A few microseconds per operation, times well over a thousand operations, is milliseconds of
# host time per step before any useful work. And PyTorch's own operations are the cheap case.
# One eager call of our `decode_attention` (chapter 05) does several things on the host: it
# validates its arguments, allocates its output (and, when it splits the KV cache, three
# buffers for the partial results), chooses the number of splits, launches the split kernel
# through Triton's launcher, which inspects every argument, and, with more than one split,
# launches a second kernel that merges them. The H200 benchmark of chapter 05 recorded, besides
# the device time of `decode_attention`, the *host* time of the whole call:

# %%
decode_record = json.loads((figures_dir() / "data" / "bench_decode_h200.json").read_text())
print(f"recorded on {decode_record['device']}, {decode_record['date'][:10]}: "
      f"`{decode_record['command']}`")
print("batch  ctx  splits  device µs  host µs  host / device")
for r in decode_record["rows"]:
    if r["block_size"] == 16 and r["ctx"] == 1024:
        print(f"{r['batch']:5d} {r['ctx']:5d} {r['num_splits']:6d} {r['us']:10.1f} "
              f"{r['host_us']:8.0f} {r['host_us'] / r['us']:10.1f}x")

# %% [markdown]
# At batch 1 the kernels run for 7.5 µs on the GPU and the call takes about 130 µs of CPU time:
# the GPU could run it over ten times while the CPU prepares one call. Only at batch 256 does
# the device time catch up with the host time. Launched eagerly, a small decode step is a queue
# of short kernels that the GPU drains faster than the CPU fills it.
#
# How those microseconds divide between our own Python (validation, allocations, the split
# choice) and Triton's launcher (one launch, or two with a merge) is a separate measurement:
# `tests/gpu/host_breakdown.py` (the `host_breakdown` stage of `tests/gpu/h200_session.sh`)
# times each piece alone and writes `figures/data/host_breakdown_h200.json`. Its rows (a separate
# run, so the whole call's time differs a little from the table above) show that Triton's
# launches are only part of it:

# %%
breakdown_path = figures_dir() / "data" / "host_breakdown_h200.json"
if breakdown_path.exists():
    breakdown = json.loads(breakdown_path.read_text())
    print(f"recorded on {breakdown['device']}, {breakdown['date'][:10]}: `{breakdown['command']}`")
    parts = ["validate", "allocs", "choose_splits", "split_launch", "merge_launch", "rest"]
    print(f"{'batch':>5} {'splits':>6} {'full µs':>8} " + " ".join(f"{p:>13}" for p in parts))
    for r in breakdown["rows"]:
        print(f"{r['batch']:5d} {r['num_splits']:6d} {r['full']:8.1f} "
              + " ".join(f"{r[p]:13.1f}" for p in parts))
else:
    print("host time breakdown: not recorded yet (figures/data/host_breakdown_h200.json; "
          "run the host_breakdown stage of tests/gpu/h200_session.sh on a GPU)")

# %% [markdown]
# ## 2. Capture and replay
#
# A **CUDA graph** removes the host from the loop. During *capture*, the kernels the code
# launches are not run but recorded, with their arguments (pointers to GPU memory included),
# into a graph. A *replay* submits the whole graph with one call; the GPU runs the recorded
# kernels back to back. Python, PyTorch's dispatcher and Triton's launcher are not involved in
# a replay at all.
#
# The price is rigidity. A replay runs **exactly** the recorded kernels, on **exactly** the
# recorded memory addresses, with **exactly** the recorded launch parameters:
#
# * new inputs must be *copied into* the tensors that were used during capture (static
#   buffers); passing a different tensor does nothing;
# * anything decided on the host during capture (a Python `if` on a tensor value, a `.item()`,
#   a split count computed from the data) is frozen into the graph; during capture such
#   device-to-host synchronisations are forbidden outright;
# * tensor shapes are fixed, so a batch of a different size needs a different graph.
#
# ### 2.1 A toy recorder you can run on a CPU
#
# To see these rules at work without a GPU, here is a recorder with the same semantics, built
# on the same dispatch hook as the counter above: during capture it runs every operation and
# records it with its argument tensors; `replay()` re-executes the recorded operations on the
# recorded tensors and writes each result into the recorded output's memory.

# %%
class ToyGraph(TorchDispatchMode):
    """Records the ATen operations run inside `with graph:`; `replay()` re-runs them in place."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)  # the same operation on the same (recorded) tensors
            if isinstance(out, torch.Tensor) and not func.is_view and new is not out:
                out.copy_(new)  # results land in the recorded memory, as on a GPU


gen = torch.Generator().manual_seed(0)
w1, w2 = torch.randn(8, 16, generator=gen), torch.randn(16, 4, generator=gen)


def mlp(x):
    return torch.relu(x @ w1) @ w2


static_x = torch.zeros(3, 8)  # the static input buffer
graph = ToyGraph()
with graph:
    static_y = mlp(static_x)  # capture: static_y is the static output buffer
print(f"captured {len(graph.ops)} operations")

new_x = torch.randn(3, 8, generator=gen)
static_x.copy_(new_x)  # the right way: copy the new input into the static buffer...
graph.replay()  # ...replay, and read the static output
print("copy into the static input, replay:        matches eager:",
      torch.allclose(static_y, mlp(new_x)))

other_x = torch.randn(3, 8, generator=gen)
graph.replay()  # the wrong way: the graph has never heard of other_x
print("new tensor passed around the graph, replay: matches eager:",
      torch.allclose(static_y, mlp(other_x)))

# %% [markdown]
# Host-side decisions are frozen too. This function picks a branch from the data; captured with
# a positive input, its replay keeps doubling even when the new input calls for the other
# branch. (A real capture would fail earlier: `x.sum() > 0` needs the value on the host, a
# device synchronisation, which CUDA forbids during capture.)

# %%
def branchy(x):
    return x * 2 if x.sum() > 0 else -x


static_in = torch.ones(4)
frozen = ToyGraph()
with frozen:
    static_out = branchy(static_in)
static_in.copy_(-torch.ones(4))
frozen.replay()
print("eager:", branchy(-torch.ones(4)).tolist(), "  replay:", static_out.tolist())

# %% [markdown]
# This is why the engine captures decode steps only with the `triton` backend: the PyTorch
# backend reads sequence lengths on the host (`int(seq_lens.max())`, Python loops over
# sequences), while the Triton kernels take every length from device tensors and choose their
# split count from shapes alone (chapter 05).
#
# ### 2.2 The real thing (GPU)
#
# With PyTorch the recipe is: run the function once on a side stream (warm-up: Triton compiles
# its kernels, cuBLAS picks its algorithms, the allocator settles), capture it under
# `torch.cuda.graph`, then copy-and-replay. The cell below does that for a chain of 200 tiny
# operations and times eager execution against replay; on a CPU it only says what it would do.

# %%
# NBVAL_IGNORE_OUTPUT
def chain(x):
    for _ in range(200):
        x = x * 1.0001 + 0.0001
    return x


if torch.cuda.is_available():
    static_in = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_in)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        static_out = chain(static_in)
    fresh = torch.rand(1024, device="cuda")
    static_in.copy_(fresh)
    cuda_graph.replay()
    print("replay matches eager:", torch.allclose(static_out, chain(fresh)))
    for name, fn in (("eager", lambda: chain(static_in)), ("graph replay", cuda_graph.replay)):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        print(f"{name:12s}: {(time.perf_counter() - start) / 50 * 1e6:8.1f} µs for 400 kernels")
else:
    print("no GPU here: on a GPU this cell captures 400 tiny kernels and replays them")

# %% [markdown]
# ## 3. The package: buckets and static buffers
#
# A decode batch changes size every step, as requests arrive and finish, but a graph has a
# fixed batch size. Capturing one graph per possible size (1 to 256) would take long and cost
# memory, so the engine captures one graph per **bucket** and pads each batch up to the next
# bucket. `batch_buckets` in `nanovllm/engine/cuda_graphs.py` picks powers of two up to 8, then
# every multiple of 16:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine import cuda_graphs

show_source(cuda_graphs.batch_buckets)

# %%
from nanovllm.engine.cuda_graphs import batch_buckets

buckets = batch_buckets(256)
print(f"{len(buckets)} buckets for max_num_seqs=256:", buckets)
print("max_num_seqs=6:", batch_buckets(6), "  max_num_seqs=40:", batch_buckets(40))

# %% [markdown]
# How much does padding waste? For every batch size from 1 to 256, pad to the bucket
# `DecodeGraphs.run` would choose (the smallest bucket that holds the batch) and count the
# empty rows. For comparison, the same for powers of two only (1, 2, 4, …, 256), which need
# fewer graphs.

# %%
def padding_stats(buckets, max_batch):
    """Padded rows for every batch 1..max_batch: (mean fraction of rows wasted, worst rows)."""
    padded = [next(b for b in buckets if b >= n) for n in range(1, max_batch + 1)]
    waste = [(p - n) / p for n, p in zip(range(1, max_batch + 1), padded)]
    return sum(waste) / len(waste), max(p - n for n, p in zip(range(1, max_batch + 1), padded))


powers = [2**i for i in range(9)]
for name, bs in (("package buckets", buckets), ("powers of two", powers)):
    mean, worst = padding_stats(bs, 256)
    print(f"{name:16s}: {len(bs):2d} graphs, mean {mean:5.1%} of rows wasted, "
          f"worst {worst:3d} empty rows")

# %% [markdown]
# Powers of two need only 9 graphs but waste a quarter of the rows on average, and a batch of 129
# runs as 256. Steps of 16 keep the waste to at most 15 rows for 20 graphs. How much does an empty
# row actually cost? In a decode step, little: the weights are read once per step whatever the
# batch, and a padding row attends to nothing (its length is 0) and stores nothing (its slot is −1).
# Its cost is its share of the matrix arithmetic, which for a memory-bound decode step is close to
# free. Padding matters more for the memory each graph's activations hold, which is why the graphs
# share one memory pool (see below). Figure 7.1 compares the two schemes at every batch size.

# %%
ns = list(range(1, 257))
fig, ax = plt.subplots(figsize=(7.5, 3.4))
for name, bs, color in (("package buckets (20 graphs)", buckets, BOOK_COLORS[0]),
                        ("powers of two (9 graphs)", powers, BOOK_COLORS[1])):
    padded = [next(b for b in bs if b >= n) for n in ns]
    ax.plot(ns, [(p - n) / p for n, p in zip(ns, padded)], color=color, label=name, lw=1.5)
ax.set(xlabel="decode batch (sequences)", ylabel="fraction of padded rows",
       title="Padding waste of the CUDA-graph buckets")
ax.legend()
figure(fig, "07_cuda_graphs_padding",
       f"The fraction of a decode batch's rows that are padding, for batches of 1 to {ns[-1]}"
       f" sequences, with the package's {len(buckets)} buckets and with {len(powers)} powers of"
       " two: a batch runs padded up to the smallest bucket that holds it.")

# %% [markdown]
# Now the class that owns the graphs, `DecodeGraphs`. Its constructor allocates the **static
# buffers** for the largest bucket: token ids, positions, slot mapping, sequence lengths, block
# tables and the output hidden states. Every bucket's graph is captured on the first `bs` rows
# of these same buffers, largest bucket first, and all graphs share one memory pool: they never
# run at the same time, so their intermediate tensors can live at the same addresses. `run`
# copies a step's inputs into the buffers, marks the padding rows (slot −1, length 0), replays
# the bucket's graph and returns the real rows of the output.

# %%
# NBVAL_IGNORE_OUTPUT
show_source(cuda_graphs.DecodeGraphs)

# %% [markdown]
# The model runner (`nanovllm/engine/model_runner.py`) builds `DecodeGraphs` on a GPU when
# `enforce_eager=False` (the default) and the backend is `triton` (`capture_graphs`, which can
# also recapture them, for instance after switching the fused kernels off). Its `launch`, which
# `run` calls before waiting for the sampled tokens, replays a graph only for pure-decode
# batches that fit the largest bucket; steps with prompt tokens run eagerly. The graph covers
# the model's layers; the LM head and the sampler are launched eagerly after it:

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.engine.model_runner import ModelRunner

src = inspect.getsource(ModelRunner.launch)
display(Markdown(f"```python\n{src}```"))

# %% [markdown]
# The static buffers are small. For Qwen3-0.6B with `max_num_seqs=256` and the default
# `max_model_len` of 8192 tokens in 16-token blocks:

# %%
max_batch, max_blocks, hidden = 256, 8192 // 16, qwen3["hidden_size"]
static_bytes = {
    "input_ids, positions, slot_mapping (int64)": 3 * max_batch * 8,
    "seq_lens (int32)": max_batch * 4,
    "block_tables (int32)": max_batch * max_blocks * 4,
    "cu_seqlens_q (int32)": (max_batch + 1) * 4,
    "hidden states out (bf16)": max_batch * hidden * 2,
}
for name, n in static_bytes.items():
    print(f"{name:44s} {n / 1024:8.1f} KiB")
print(f"{'total':44s} {sum(static_bytes.values()) / 2**20:8.2f} MiB")

# %% [markdown]
# Figure 7.2 draws both halves for the engine's defaults: at start-up one graph per bucket of
# `batch_buckets(max_num_seqs)`, and at every decode step a batch padded up to the smallest bucket
# that holds it, the padded rows writing nowhere and attending to nothing.

# %%
from nanovllm.viz.kernel_diagrams import cuda_graph_diagram

fig = cuda_graph_diagram()
figure(fig, "07_graph_buckets",
       "CUDA graphs: captured once per bucket at start-up, replayed with padding at every "
       "decode step.")

# %% [markdown]
# ### 3.1 The padding contract, checked
#
# Padding is only safe if padded rows change nothing: a row with slot −1 must not write into
# the cache, a row with length 0 must produce a harmless output, and the real rows must come
# out exactly as without padding. `DecodeGraphs.run` leaves the copying and padding to a small
# class of its own, `StaticInputs` (the buffers and their `fill`), so it runs on a CPU too:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(cuda_graphs.StaticInputs.fill)

# %% [markdown]
# We check the contract on the package's Triton kernels (`store_kv` and `decode_attention`,
# under the interpreter on a CPU): a batch of 3 decodes, filled into buffers that an earlier,
# larger batch left dirty, padded by `fill` to the bucket of 4, against the same batch unpadded.
# The padding row's query, key and value are random: in a replayed graph they are whatever the
# stale token id in that row computes to.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.context import AttentionMetadata
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.store_kv import store_kv

gen = torch.Generator().manual_seed(7)
heads, kv_heads, dim, block = 4, 2, 32, 16
k_cache = torch.randn(12, block, kv_heads, dim, generator=gen)
v_cache = torch.randn(12, block, kv_heads, dim, generator=gen)
tables = torch.tensor([[3, 7, -1], [0, -1, -1], [5, 9, 11]], dtype=torch.int32)
lens = torch.tensor([20, 9, 40], dtype=torch.int32)  # after this step's token
slots = torch.tensor([int(tables[b, (n - 1) // block]) * block + (n - 1) % block
                      for b, n in enumerate(lens.tolist())])
q = torch.randn(3, heads, dim, generator=gen)
k_new, v_new = torch.randn(3, kv_heads, dim, generator=gen), torch.randn(3, kv_heads, dim,
                                                                         generator=gen)
static = cuda_graphs.StaticInputs(batch_buckets(8), max_blocks=3, device=torch.device("cpu"))
static.slot_mapping[:], static.seq_lens[:], static.block_tables[:] = 77, 33, 1  # dirty rows
meta = AttentionMetadata(
    slot_mapping=slots, cu_seqlens_q=torch.arange(4, dtype=torch.int32), seq_lens_k=lens,
    block_tables=tables, max_seqlen_q=1, max_seqlen_k=40, num_decodes=3,
    cu_seqlens_q_host=[0, 1, 2, 3], seq_lens_k_host=lens.tolist(),
)
token_ids = torch.zeros(3, dtype=torch.long)  # unused here: the attention inputs are given
bucket = static.fill(token_ids, lens.long() - 1, meta)


def junk_rows(t):
    """Rows bucket - 3 of random activations below the real ones."""
    return torch.cat([t, torch.randn(bucket - t.shape[0], *t.shape[1:], generator=gen)])


results = {}
for name, padded in (("unpadded", False), ("padded", True)):
    kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
    args = [q, k_new, v_new, slots, lens, tables]
    if padded:
        args = [junk_rows(q), junk_rows(k_new), junk_rows(v_new), static.slot_mapping[:bucket],
                static.seq_lens[:bucket], static.block_tables[:bucket]]
    qq, kk, vv, ss, ll, tt = (a.to(device) for a in args)
    store_kv(kk, vv, kc, vc, ss)
    results[name] = (decode_attention(qq, kc, vc, ll, tt, dim**-0.5).cpu(), kc.cpu(), vc.cpu())
out_u, k_u, v_u = results["unpadded"]
out_p, k_p, v_p = results["padded"]
print(f"batch of 3 padded to the bucket of {bucket}")
print("real rows identical, bit for bit:", torch.equal(out_p[:3], out_u))
print("padding row's output is all zeros:", bool((out_p[3] == 0).all()))
print("caches identical (the -1 slot wrote nothing):",
      torch.equal(k_p, k_u) and torch.equal(v_p, v_u))

# %% [markdown]
# ## 4. Switched on in the engine: the measured speedup
#
# `decode_step_benchmark` in `nanovllm/benchmarks/decode_step.py` times one engine decode step
# (prepare the inputs, run the model, sample, wait for the tokens) of Qwen3-0.6B with random
# weights at context 1024, for a few batch sizes, eager (`runner.graphs = None`) and with the
# captured graphs. It does so twice: first as the engine runs by default, with the fused kernels
# of chapter 11, then with them switched off and the graphs recaptured, so that the graphs record
# the unfused kernels (the `_unfused` keys):

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.benchmarks import decode_step

show_source(decode_step.decode_step_benchmark)

# %% [markdown]
# It ran on an H200 with `python -m nanovllm.bench --decode-step --out ...` (now also
# `python -m nanovllm.benchmarks.decode_step`). The recorded
# results (on a GPU, the cell after the figure measures your own):

# %%
from nanovllm.viz.records import HEADLINES, load_record

# The book's current batch-1 graph decode step is this record's (nanovllm/viz/records.py).
graphs_record = load_record(HEADLINES["h200_qwen3_0.6b_graph_decode_step_batch1"].record)
rows = graphs_record["rows"]
batches = [r["batch"] for r in rows]
for r in rows:
    r["speedup_unfused"] = r["eager_unfused_ms"] / r["graphs_unfused_ms"]
print(f"recorded on {graphs_record['device']}, {graphs_record['date']}, "
      f"torch {graphs_record['torch']}: `{graphs_record['command']}`")
print("                 with fused kernels (default)    without fusion")
print("batch  context   eager ms  graphs ms  speedup   eager ms  graphs ms  speedup")
for r in rows:
    print(f"{r['batch']:5d} {r['context']:8d} {r['eager_ms']:10.1f} {r['graphs_ms']:10.2f} "
          f"{r['speedup']:7.1f}x {r['eager_unfused_ms']:10.1f} {r['graphs_unfused_ms']:10.2f} "
          f"{r['speedup_unfused']:7.1f}x")

print("\nwhat fusion gains (time without fusion / time with it)")
print("batch   eager  graphs  graph step saved")
for r in rows:
    print(f"{r['batch']:5d} {r['eager_unfused_ms'] / r['eager_ms']:6.2f}x "
          f"{r['fusion_speedup_graphs']:6.2f}x {r['graphs_unfused_ms'] - r['graphs_ms']:11.2f} ms")
saved_ms = sum(r["graphs_unfused_ms"] - r["graphs_ms"] for r in rows) / len(rows)
removed = launches_gpu - kernels_fused
print(f"mean saving {saved_ms:.2f} ms for ~{removed:,} fewer kernels "
      f"(~{launches_gpu:,} -> ~{kernels_fused}, section 1): "
      f"~{saved_ms / removed * 1e3:.1f} µs per kernel")

# %% [markdown]
# With the fused kernels, graphs make the batch-1 step about 13 times faster (22.9 ms down to
# 1.8 ms) and the batch-256 step about twice as fast (2.2×). Without fusion the gain at batch 1
# is 7.9×.
#
# Fusion and graphs attack the same fixed cost, the per-kernel cost of a step, from two sides:
# fusion launches fewer kernels (about 310 instead of about 1,400, section 1), a graph launches
# them all at once. Their gains add up, and the second table shows why neither makes the other
# redundant:
#
# * **Eager, fusion alone is not enough.** With under a quarter of the kernels, the eager step
#   is only 1.5× faster at batch 1, and it stays at 22.9 ms, over 40 times its GPU work (the
#   lower bound computed below). The fused kernels are Triton kernels, and a Triton launch from
#   Python is the costly kind (section 1.2): the eager step is still launch-bound.
# * **With a graph, fewer kernels still help.** A replay removes the host's launch cost, but
#   the GPU still runs every recorded kernel one after the other, and each one, however small,
#   pays a couple of microseconds to start and finish on the GPU. So fusion makes the graph
#   step at batch 1 2.5× faster, 4.43 ms down to 1.80 ms. The saving is nearly the same at
#   every batch size, 2.6–2.8 ms: a fixed cost, roughly 2.4 µs for each kernel that fusion
#   removed (a rough figure: the ~1,400 is section 1's estimate, not a measurement).
#
# Why does the graphs' gain shrink as the batch grows? A step costs roughly
#
# $$t_\text{eager} \approx \max(\text{host launch time},\ \text{GPU time}),\qquad
#   t_\text{graph} \approx \text{GPU time} + \text{remaining host work}.$$
#
# The host launch time is fixed: the same launches at every batch size (section 1). The GPU
# time grows with the batch, because every sequence brings its own KV cache to read. We can
# estimate the GPU time from the kernel measurements of chapter 05: 28 layers of
# `decode_attention` at the recorded time for this batch and context, plus one read of the
# weights (2 bytes per parameter in bf16; we count the parameters on PyTorch's `meta` device,
# which records shapes without allocating memory) at the copy bandwidth. That leaves out the
# small kernels, so it is a lower bound.

# %%
from nanovllm.models import ModelConfig, get_model_class

cfg = ModelConfig.from_pretrained(config_path("qwen3-0.6b"))
with torch.device("meta"):  # shapes only, no memory
    n_params = sum(p.numel() for p in get_model_class(cfg.architecture)(cfg).parameters())
weights_ms = n_params * 2 / decode_record["copy_bytes_per_s"] * 1e3
attention_us = {r["batch"]: r["us"] for r in decode_record["rows"]
                if r["ctx"] == 1024 and r["block_size"] == 16}
print(f"Qwen3-0.6B: {n_params:,} parameters; one bf16 read of them: {weights_ms:.2f} ms")
print("                           with fused kernels                     without fusion")
print("batch  GPU bound ms   eager ms  graphs ms  graphs - bound   graphs ms  graphs - bound")
gpu_ms = {}
for r in rows:
    b = r["batch"]
    gpu_ms[b] = cfg.num_layers * attention_us[b] / 1e3 + weights_ms
    print(f"{b:5d} {gpu_ms[b]:13.2f} {r['eager_ms']:10.1f} {r['graphs_ms']:10.2f} "
          f"{r['graphs_ms'] - gpu_ms[b]:15.2f} {r['graphs_unfused_ms']:11.2f} "
          f"{r['graphs_unfused_ms'] - gpu_ms[b]:15.2f}")
print(f"eager step / GPU bound at batch 1: {rows[0]['eager_ms'] / gpu_ms[rows[0]['batch']]:.0f}x; "
      f"GPU bound / eager step at batch 256: {gpu_ms[256] / rows[-1]['eager_ms']:.0%}")
kv_256 = 256 * 1024 * cfg.kv_bytes_per_token(2)
print(f"KV cache read per step at batch 256, context 1024: {kv_256 / 1e9:.1f} GB "
      f"= {kv_256 / decode_record['copy_bytes_per_s'] * 1e3:.1f} ms at the copy bandwidth")
host_us = {r["batch"]: r["host_us"] for r in decode_record["rows"]
           if r["ctx"] == 1024 and r["block_size"] == 16}
print(f"extra host time of split-KV decode_attention at batch 1 vs 64, over {cfg.num_layers} "
      f"layers: {cfg.num_layers * (host_us[1] - host_us[64]) / 1e3:.1f} ms")

# %% [markdown]
# Read the table row by row:
#
# * **Batch 1.** Half a millisecond of GPU work, but the eager step takes 22.9 ms (34.8 ms
#   without fusion): it is entirely launch-bound. The graph removes the launches and the step
#   drops to 1.8 ms (4.4 ms without fusion). The eager batch-1 step is slower than the eager
#   batch-64 step, with fusion or without: at batch 1 `decode_attention` splits each sequence's
#   KV cache (chapter 05), which adds a merge kernel per layer and makes each call, merge
#   included, cost more host time (132 µs against 99 µs, section 1.2): about 0.9 ms per step
#   over 28 layers, part of the gap. The graph columns, where launches cost the host nothing,
#   grow with the batch as they should.
# * **Batch 256.** The attention alone now reads 30 GB per step (256 sequences × 1024 tokens
#   of K and V in 28 layers, printed above): about 7 ms even at the roofline. The GPU work has
#   grown to about a third of the eager time, and a graph can only remove the rest: 23.3 ms
#   down to 10.6 ms.
# * **The `graphs - bound` columns** are what the graph step costs beyond our GPU lower bound:
#   1.3–3.1 ms with fusion, 3.9–5.8 ms without, growing with the batch. They hold everything
#   the bound leaves out. On the GPU, the kernels it does not count (norms, rotary embedding,
#   activation, residual adds, the sampler), each with its start-up cost: this is the part
#   fusion shrank, by 2.6–2.8 ms at every batch size. On the host, the work a graph does not
#   remove because it lies *around* the captured forward pass: building the step's inputs in
#   Python, copying them to the GPU, launching the LM head and the sampler, and waiting for the
#   sampled tokens to come back.
#
# Chapter 11 takes this remainder apart: it builds the fused kernels, and with **async
# scheduling** it hides the host work behind the GPU's, the CPU preparing step *n*+1 while the
# GPU computes step *n*.
#
# Figure 7.3 shows these effects: on the left the step times, eager and with graphs, with and
# without fusion; in the middle the graph step alone, against the GPU lower bound; on the right
# the speedup of graphs.

# %%
x = range(len(rows))
fig, (ax_ms, ax_gr, ax_sp) = plt.subplots(1, 3, figsize=(15, 4.2))
bars = (("eager, without fusion", "eager_unfused_ms", BOOK_COLORS[1], "//", 0.45),
        ("eager, fused kernels", "eager_ms", BOOK_COLORS[1], None, 1.0),
        ("graphs, without fusion", "graphs_unfused_ms", BOOK_COLORS[0], "//", 0.45),
        ("graphs, fused kernels", "graphs_ms", BOOK_COLORS[0], None, 1.0))
width = 0.2
for k, (label, key, color, hatch, alpha) in enumerate(bars):
    ax_ms.bar([i + (k - 1.5) * width for i in x], [r[key] for r in rows], width, label=label,
              color=color, hatch=hatch, alpha=alpha, edgecolor=color)
ax_ms.set_xticks(list(x), labels=[str(b) for b in batches])
ax_ms.set(xlabel="decode batch (sequences, context 1024)", ylabel="time per decode step (ms)",
          title="One decode step of Qwen3-0.6B")
ax_ms.legend(fontsize=8)

width = 0.27
ax_gr.bar([i - width for i in x], [r["graphs_unfused_ms"] for r in rows], width,
          label="graphs, without fusion", color=BOOK_COLORS[0], hatch="//", alpha=0.45,
          edgecolor=BOOK_COLORS[0])
ax_gr.bar(list(x), [r["graphs_ms"] for r in rows], width, label="graphs, fused kernels",
          color=BOOK_COLORS[0])
ax_gr.bar([i + width for i in x], [gpu_ms[b] for b in batches], width,
          label="GPU work, lower bound", color=BOOK_COLORS[2])
for i, r in zip(x, rows):
    for dx, v in ((-width, r["graphs_unfused_ms"]), (0, r["graphs_ms"])):
        ax_gr.annotate(f"{v:.1f}", (i + dx, v), ha="center", textcoords="offset points",
                       xytext=(0, 2), fontsize=8)
ax_gr.set_xticks(list(x), labels=[str(b) for b in batches])
ax_gr.set(xlabel="decode batch (sequences, context 1024)", ylabel="time per decode step (ms)",
          title="The graph step: fusion still helps")
ax_gr.legend(fontsize=8)

for key, label, style in (("speedup", "with fused kernels", "o-"),
                          ("speedup_unfused", "without fusion", "s--")):
    ax_sp.plot(batches, [r[key] for r in rows], style, color=BOOK_COLORS[0], label=label,
               alpha=1.0 if key == "speedup" else 0.6)
    for b, r in zip(batches, rows):
        ax_sp.annotate(f"{r[key]:.1f}x", (b, r[key]), textcoords="offset points",
                       xytext=(6, 4 if key == "speedup" else -12), fontsize=8)
ax_sp.set(xscale="log", xlabel="decode batch (sequences)", ylabel="speedup (eager / graphs)",
          title="Speedup shrinks as GPU work grows", ylim=(0, 1.15 * rows[0]["speedup"]))
ax_sp.set_xticks(batches, labels=[str(b) for b in batches])
ax_sp.legend(fontsize=8)
fig.suptitle(f"Recorded on {graphs_record['device']}, {graphs_record['date']} "
             f"({graphs_record['command']})", fontsize=10)
fig.tight_layout()
figure(fig, "07_cuda_graphs_speedup",
       f"Recorded decode steps of Qwen3-0.6B (context 1024) on {graphs_record['device']}: the"
       " step time eager and replayed from CUDA graphs, with and without fused kernels (left);"
       " the graph step against the GPU-work lower bound (middle); the speedup of graphs over"
       " eager (right), which shrinks as the batch's GPU work grows.")

# %% [markdown]
# ### 4.1 Your own measurement (GPU only)
#
# On a GPU the next cell runs `decode_step_benchmark` at a few small batches (it builds
# Qwen3-0.6B with random weights and captures its graphs twice, with the fused kernels and
# without, which takes a little while). On a CPU there is nothing to capture: the "device" is
# the host itself, so there is no launch queue to keep full, and the engine never builds graphs
# there.

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    for row in decode_step.decode_step_benchmark("qwen3-0.6b", [1, 8, 32], 1024, iters=10):
        unfused = row["eager_unfused_ms"] / row["graphs_unfused_ms"]
        print(f"batch {row['batch']:3d}: eager {row['eager_ms']:6.1f} ms, "
              f"graphs {row['graphs_ms']:6.2f} ms ({row['speedup']:4.1f}x) | without fusion: "
              f"eager {row['eager_unfused_ms']:6.1f} ms, graphs {row['graphs_unfused_ms']:6.2f} ms "
              f"({unfused:4.1f}x)")
else:
    print("no GPU here: the recorded H200 results above stand in for a live measurement")

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# the replay side of the decode graphs yourself: `StaticInputs.fill` (`07.graphs`, sections 3
# and 3.1), which picks the bucket whose graph will replay a batch, copies the batch into the
# buffers that graph reads, and pads the rest of the bucket so that the padded rows store
# nothing and attend to nothing, whatever an earlier batch left there. The tests run on a CPU:
# they check the bucket choice, the copies, and a replay in which a stand-in for each graph
# reruns the recorded step on the buffers it was captured with. The function's docstring is
# the handout; the project's tests grade your code (`make check CHAPTERS=07` in your edition), and
# once they pass this notebook runs on your own engine.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("07"))

# %% [markdown]
# ### Hints, one rung at a time
#
# Read a hint only when stuck, and only the next one.
#
# **`07.graphs`** (`StaticInputs.fill`)
#
# 1. A captured graph remembers addresses, not Python objects: the graph of bucket `bs` reads
#    rows `:bs` of the tensors that existed at capture. So everything you do is an in-place
#    copy into slices of those tensors; a new tensor assigned to `self.slot_mapping` would
#    never be seen by any graph.
# 2. Three groups of rows: `:n` (the batch), `n:bs` (padding, replayed with the batch), and
#    `bs:` (not part of this replay). Only the second needs thought: which two fields decide
#    whether a row writes to the cache and whether it reads from it? Section 3.1 shows a
#    padded row going through the real kernels.
# 3. The buffers start clean, so a test with a single batch proves little: think of a batch of
#    3 after a batch of 13 (bucket 16), and what rows 3 of bucket 4 still hold. Its stale slot
#    would overwrite another sequence's key; its stale length would make it read blocks.
# 4. The bucket is the first of the ascending `self.buckets` that is `>= n`; check the batch
#    fits in the largest before looking. The block table may be narrower than the buffer:
#    copy it into the first `width` columns.

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — padding statistics.** Write `padding_waste(buckets, max_batch)` returning a
# pair: the mean, over every batch size `n` in `1..max_batch`, of the fraction of rows that are
# padding when `n` is padded to the smallest bucket `>= n`; and the largest number of padding
# rows any `n` gets. Assume `buckets` is sorted and its last entry is at least `max_batch`.
# The check uses hand-worked cases and the engine's buckets written out (1, 2, 4, 8, then every
# multiple of 16, as `batch_buckets(256)` returns them), against values computed exactly.

# %% tags=["exercise"]
def padding_waste(buckets: list[int], max_batch: int) -> tuple[float, int]:
    """(mean fraction of padded rows, worst number of padded rows) over batches 1..max_batch."""
    raise NotImplementedError("exercise 07.padding_waste")


# %% tags=["check", "raises-exception"]
import math

assert padding_waste([1, 2, 4], 4) == ((0 + 0 + 1 / 4 + 0) / 4, 1), \
    "buckets [1, 2, 4], max_batch 4: only n = 3 pads, 1 row of 4"
assert padding_waste(list(range(1, 65)), 64) == (0.0, 0), "one bucket per size wastes nothing"
# frozen means: computed once with fractions.Fraction, summing (bucket - n) / bucket over n
engine_buckets = [1, 2, 4, 8] + list(range(16, 257, 16))  # batch_buckets(256)
mean, worst = padding_waste(engine_buckets, 256)
assert worst == 15, f"the engine's buckets waste at most 15 rows (n = 17 pads to 32), got {worst}"
assert math.isclose(mean, 1980103 / 24600576, rel_tol=1e-9), f"mean waste {mean:.5f}, not 0.08049"
mean2, worst2 = padding_waste([2**i for i in range(9)], 256)
assert worst2 == 127, f"powers of two up to 256: n = 129 pads 127 rows, got {worst2}"
assert math.isclose(mean2, 247 / 1024, rel_tol=1e-9), f"mean waste {mean2:.5f}, not 0.24121"
print("Exercise 1 passed: padding_waste agrees on the engine's buckets and powers of two")

# %% [markdown]
# **Exercise 2 — pad a decode batch for a graph.** Write
# `pad_decode_batch(input_ids, slot_mapping, seq_lens, block_tables, bucket)` that pads a batch
# of `n` decodes to `bucket` rows the way `DecodeGraphs.run` does: token ids and positions
# don't matter for padding rows (use 0), slots are `-1` (write nothing), lengths are `0`
# (attend to nothing), and block-table rows are all `-1`. Return the four padded tensors, with
# the input dtypes. The check also writes a step's keys through the padded slot mapping, the way
# `store_kv` does (slot `-1` is skipped), and checks that only the real rows reach the cache.

# %% tags=["exercise"]
import torch


def pad_decode_batch(input_ids, slot_mapping, seq_lens, block_tables, bucket):
    """Pad a decode batch of n rows to `bucket` rows with harmless padding rows."""
    raise NotImplementedError("exercise 07.pad_decode_batch")


# %% tags=["check", "raises-exception"]
import torch

gen = torch.Generator().manual_seed(702)
block, kv_heads, dim = 16, 2, 8
k_cache = torch.randn(10, block, kv_heads, dim, generator=gen)
ids = torch.tensor([11, 12, 13])
slots = torch.tensor([5, 40, 70])
lens = torch.tensor([6, 9, 23], dtype=torch.int32)
tables = torch.tensor([[0, -1], [2, -1], [4, 3]], dtype=torch.int32)
out = pad_decode_batch(ids, slots, lens, tables, 8)
assert [t.shape[0] for t in out] == [8] * 4, "every tensor must have `bucket` rows"
assert [t.dtype for t in out] == [t.dtype for t in (ids, slots, lens, tables)], "keep dtypes"
assert out[3].shape == (8, 2), "block tables keep their width"
p_ids, p_slots, p_lens, p_tables = out
assert torch.equal(p_ids[:3], ids) and torch.equal(p_slots[:3], slots)
assert torch.equal(p_lens[:3], lens) and torch.equal(p_tables[:3], tables), "real rows changed"
assert (p_slots[3:] == -1).all(), f"padding slots must be -1, got {p_slots[3:].tolist()}"
assert (p_lens[3:] == 0).all(), f"padding lengths must be 0, got {p_lens[3:].tolist()}"
assert (p_tables[3:] == -1).all(), "padding block-table rows must be all -1"
# write one key per row through the padded slot mapping, skipping slot -1 as store_kv does
kc = k_cache.clone()
new = torch.randn(8, kv_heads, dim, generator=gen)
flat = kc.view(-1, kv_heads, dim)
for row, slot in enumerate(p_slots.tolist()):
    if slot >= 0:
        flat[slot] = new[row]
assert torch.equal(flat[slots], new[:3]), "real rows must be stored"
changed = (kc != k_cache).any(dim=(2, 3)).flatten().nonzero().flatten()
assert set(changed.tolist()) <= set(slots.tolist()), "padding rows wrote into the cache"
same = pad_decode_batch(ids, slots, lens, tables, 3)  # bucket == n: nothing to pad
assert all(torch.equal(a, b) for a, b in zip(same, (ids, slots, lens, tables))), "bucket == n"
print("Exercise 2 passed: padded rows write nothing and real rows are untouched")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/07.json` *before* measuring; then `make analysis CH=07 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("07")

# %% [markdown]
# ## Summary
#
# - A decode step of Qwen3-0.6B is about 1,400 kernel launches with the PyTorch path, and about
#   310 with the fused kernels of chapter 11, the same at every batch size. Each launch costs
#   the host microseconds (PyTorch ops) to tens of microseconds (a Triton launch from Python,
#   section 1.2's breakdown), often more than the kernel runs on an H200: small decode steps are
#   **launch-bound**.
# - A **CUDA graph** records the launches once and replays them with one call. It replays the
#   recorded kernels on the recorded addresses, so inputs go through **static buffers**, host
#   decisions (`.item()`, data-dependent branches, split counts) must not exist in the captured
#   code, and every batch size needs its own graph.
# - `nanovllm/engine/cuda_graphs.py` captures one graph per **bucket** (1, 2, 4, 8, then every
#   multiple of 16), largest first, sharing one memory pool; `DecodeGraphs.run` copies a step's
#   inputs into the static buffers and pads with rows that store nothing (slot −1) and attend to
#   nothing (length 0). We checked that padded rows change neither the real outputs nor the
#   cache; the package's buckets waste 8% of rows on average and at most 15 rows.
# - Recorded on an H200 with the fused kernels (the engine's default): graphs make a decode step
#   about 13× faster at batch 1 (22.9 ms down to 1.8 ms) and 2.2× faster at batch 256; without
#   fusion, 7.9× and 2.0×. The gain shrinks because the saved launch time is fixed while the GPU
#   work (mostly reading the KV cache) grows with the batch.
# - Fusion and graphs attack the same fixed cost from two sides: fusion launches fewer kernels,
#   a graph launches them all at once. A replay still pays each kernel's start on the GPU, so
#   fewer kernels still help: fusion took the batch-1 graph step from 4.4 ms to 1.8 ms. What the
#   graph step costs beyond the GPU work (small kernels, and host work around the forward pass)
#   is what chapter 11 takes apart, with async scheduling preparing step *n*+1 on the CPU while
#   the GPU computes step *n*.

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
# # Chapter 00 — A tour of nanovllm
#
# A language model by itself is a function: token ids in, one probability distribution over the
# next token out. Everything else you see in a chat window (the answer appearing word by word,
# thousands of people being served by the same GPU, the bill per million tokens) is the work of an
# **inference engine**: the program that wraps the model and decides what to compute, when, and
# where to keep it.
#
# This book builds such an engine, `nanovllm`, one component per chapter, and every chapter proves
# its component correct and measures what it buys. This first chapter is the tour: we run the
# finished engine on a real model, look at what it returns, peek at its internals, draw the map of
# the package and of the book, and measure the one effect that makes engines worth writing.

# %% [markdown]
# **Taking this as a course?** In a student edition (`make student`) some functions of the package
# are yours to write: each holds `raise NotImplementedError("assignment 04.allocate: ...")` between
# two `# >>> assignment` / `# <<< assignment` markers, under a docstring that is the handout. Take
# the chapters in order; each ends with an *Assignments* cell that lists its assignments, their
# points and whether each is still a `stub`, then practice exercises. Until a chapter's assignments
# are written, cells that run the engine stop on the first stub (this tour runs the whole engine, so
# read it now and run it again once the assignments on the engine's path are done: chapters 01–04,
# 06 and 11's `11.placeholders`). `make check CHAPTERS=NN` runs the public tests of chapter NN's
# assignments with the first failure of each; the README's *Start here* has the rest.

# %% [markdown]
# ## 1. Why `model.generate` is not enough
#
# Generating text from one prompt is a short loop: run the model on the tokens so far, pick a next
# token, append it, repeat until an end-of-sequence token or a length limit. Libraries ship that
# loop (`model.generate` in transformers), and for one user on one laptop it is fine. A service is
# different in three ways:
#
# * **Many requests at once.** Requests arrive at any time, with prompts of different lengths, and
#   finish at different times. Running them one after another leaves the hardware idle most of
#   the time; the engine must *batch* them, and keep the batch full as requests come and go
#   (continuous batching, chapter 06).
# * **Memory.** To avoid recomputing the whole prefix at every step, each request keeps the keys
#   and values of all its past tokens: the *KV cache* (chapter 03). It grows by one token per step
#   and per request, it is often larger than the model, and it must be handed out without waste
#   (paged blocks, chapter 04) and shared where prompts overlap (prefix caching, chapter 04).
# * **Latency versus throughput.** A user cares about *latency*: time to the first token, then time
#   per token. The operator cares about *throughput*: tokens per second over all users. Bigger
#   batches raise throughput, but every request in the batch waits for the whole step. The
#   scheduler (chapter 06) makes that trade every step.
#
# The engine in this book answers all three the way production engines such as vLLM do. Its core
# (the engine loop, the layers, the Triton kernels and the models) is under ten thousand lines
# of Python, one concept per file; the rest of the package is the server, the measuring tools
# and the course. Section 7 prints the map with every module's length. Let's start it.

# %% [markdown]
# ## 2. Setup
#
# The book's code lives in the package `nanovllm`; the chapters import it. The public API is three
# names: `LLM` (the engine), `SamplingParams` (how one request picks its tokens and when it stops)
# and `smollm2_path()`, which returns a local folder with the real weights of
# [SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), a small
# chat model (converted once from a file shipped on the package index; no model hub is needed).
# Every chapter runs on a laptop CPU; on a machine with a CUDA GPU the same code runs there.

# %%
# NBVAL_IGNORE_OUTPUT
import dataclasses
import inspect
import platform
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import transformers
from IPython.display import Markdown, display

import nanovllm
from nanovllm import LLM, EngineConfig, SamplingParams, smollm2_path
from nanovllm.viz import figure, use_book_style

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, nanovllm {nanovllm.__version__}")
print("device:", torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu")

# %% [markdown]
# ## 3. Start the engine
#
# `LLM(path)` reads the model folder (`config.json`, the safetensors weights, the tokenizer),
# builds the model, loads the weights and sets aside memory for the KV cache. Keyword arguments
# are engine options; we pass one: `dtype="float32"`. On a CPU that is the default anyway; on a GPU
# the default is bfloat16, which is faster but rounds differently, and we want the answers printed
# in this chapter to be the same on every machine.

# %%
# NBVAL_IGNORE_OUTPUT
start = time.perf_counter()
llm = LLM(smollm2_path(), dtype="float32")
print(f"engine ready in {time.perf_counter() - start:.1f} s on {llm.config.device}")

# %% [markdown]
# What did it load? The engine reads the architecture from `config.json` into a small
# `ModelConfig`, and the weights into an ordinary PyTorch module:

# %%
# NBVAL_CHECK_OUTPUT
mc = llm.engine.model_config
model = llm.engine.runner.model
num_params = sum(p.numel() for p in model.parameters())  # the tied LM head is counted once
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"architecture: {mc.architecture}")
print(f"layers {mc.num_layers}, hidden size {mc.hidden_size}, "
      f"{mc.num_heads} query heads / {mc.num_kv_heads} KV heads of dim {mc.head_dim}, "
      f"vocabulary {mc.vocab_size}")
print(f"parameters: {num_params:,} = {weight_bytes / 2**20:.0f} MiB in {llm.config.dtype}")

# %% [markdown]
# The "135M" in the name is the parameter count printed above. Three numbers will matter all
# through the book: the 30 layers, and the 3 *KV heads* of dimension 64: each token a request
# keeps in its KV cache stores one key and one value vector per KV head per layer (chapter 03).

# %% [markdown]
# ## 4. Ask it something: `llm.chat`
#
# `llm.chat` takes conversations, lists of `{"role", "content"}` messages, and answers them all
# together. `SamplingParams(temperature=0)` asks for *greedy* decoding: always the most likely next
# token, so the answer is deterministic. `max_tokens` caps the length of each answer.

# %%
# NBVAL_CHECK_OUTPUT
questions = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?"]
greedy = SamplingParams(temperature=0, max_tokens=32)
answers = llm.chat([[{"role": "user", "content": q}] for q in questions], greedy, use_tqdm=False)
for q, out in zip(questions, answers):
    print(f"Q: {q}\nA: {out.text}\n   ({len(out.token_ids)} tokens, finish_reason={out.finish_reason!r})")

# %% [markdown]
# Three answers from one call: the engine ran the three conversations *as one batch*. Each answer
# ended with `finish_reason='stop'`: the model produced its end-of-turn token before reaching
# `max_tokens`. The token counts include that final token, which is not shown in the text.
#
# A chat model does not see a list of messages; it sees one string laid out in the format it was
# trained on. The tokenizer's *chat template* produces it, and `llm.chat` feeds the result to the
# engine as an ordinary prompt. Here is what the model actually read for the first question:

# %%
# NBVAL_CHECK_OUTPUT
first = answers[0]
print(first.prompt)
print(f"-> {len(first.prompt_token_ids)} prompt tokens; the last token of the answer is "
      f"{first.token_ids[-1]} = {llm.tokenizer.decode(first.token_ids[-1:])!r}")

# %% [markdown]
# SmolLM2 uses the *ChatML* layout: every message sits between `<|im_start|>role` and
# `<|im_end|>`, and the template adds a default system message when the conversation has none. The
# prompt ends with `<|im_start|>assistant` and a newline: an invitation to write the assistant's
# turn. The model closes its turn with `<|im_end|>` (token 2), the engine recognises it as the
# end-of-sequence token and stops the request. Exercise 2 rebuilds this template by hand.

# %% [markdown]
# ## 5. Plain completion: `llm.generate`
#
# `llm.generate` continues raw text, with no template. It returns one `RequestOutput` per prompt,
# in prompt order, with the generated `text`, its `token_ids` and a `finish_reason`:

# %%
# NBVAL_CHECK_OUTPUT
prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
for out in outputs:
    print(f"prompt {out.prompt!r} = token ids {out.prompt_token_ids}")
    print(f"  text          {out.text!r}")
    print(f"  token ids     {out.token_ids}")
    print(f"  finish_reason {out.finish_reason!r}")

# %% [markdown]
# Each completion is exactly 16 tokens long and finished with `'length'`: it hit `max_tokens`
# before an end-of-sequence token. (The model is small: its Fibonacci function is really a
# factorial, and after "Paris." it rambles on. Quality is not this book's subject; speed and
# correctness of the engine are.)
#
# Prompts may also be given as token ids, which is what the engine works with inside. Feeding back
# the ids the tokenizer produced gives the same tokens out:

# %%
# NBVAL_CHECK_OUTPUT
again = llm.generate([o.prompt_token_ids for o in outputs],
                     SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
print("same tokens from token-id prompts:", [a.token_ids == o.token_ids for a, o in zip(again, outputs)])

# %% [markdown]
# **Sampling.** With `temperature > 0` the engine draws the next token at random from the model's
# distribution (sharpened or flattened by the temperature and trimmed by `top_p`; chapter 01 shows
# how). A `seed` gives a request its own random generator, so its text is reproducible *and does
# not depend on which other requests share its batch*. Below, three requests run in one batch: two
# with seed 0 and one with seed 1.

# %%
story = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)
seeded = [dataclasses.replace(story, seed=s) for s in (0, 0, 1)]
samples = llm.generate(["Once upon a time"] * 3, seeded, use_tqdm=False)
for params, out in zip(seeded, samples):
    print(f"seed {params.seed}: {out.text!r}")

# %%
# NBVAL_CHECK_OUTPUT
print("seed 0 twice gives the same tokens:", samples[0].token_ids == samples[1].token_ids)
print("seed 1 gives different tokens:     ", samples[2].token_ids != samples[0].token_ids)

# %% [markdown]
# The two checks are device-independent; the sampled texts themselves depend on the random number
# generator of the device, so a GPU prints other stories.

# %% [markdown]
# ## 6. The smallest engine is a for-loop
#
# To see what the engine adds, write the loop from §1 ourselves, on the very model object the
# engine runs. The model takes a flat tensor of token ids and their positions and returns one
# hidden vector per token; `compute_logits` turns the last one into scores over the vocabulary.
# Called outside the engine, the model's attention layers simply attend over the tokens they are
# given (a plain causal attention, no cache).

# %%
@torch.inference_mode()
def naive_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Greedy decoding without a KV cache: every step recomputes the whole sequence."""
    dev = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev))
        next_id = int(model.compute_logits(hidden[-1:]).argmax())
        ids.append(next_id)
        if next_id in eos_ids:
            break
    return ids[len(prompt_ids):]


# %%
# NBVAL_CHECK_OUTPUT
for out in outputs[:2]:
    mine = naive_generate(model, out.prompt_token_ids, 16, llm.engine.eos_token_ids)
    print(f"{out.prompt!r}: naive loop == engine: {mine == out.token_ids}")

# %% [markdown]
# Token for token the same. Everything the rest of the book adds to this loop changes *how fast*
# and *how many*, never *what*: each chapter checks that again for its component. Our loop has the
# three flaws of §1: it recomputes the whole sequence at every step (the KV cache fixes that,
# chapter 03), it serves one request at a time (continuous batching, chapter 06), and it has no
# notion of memory at all (the block manager, chapter 04).

# %% [markdown]
# The engine keeps this loop but cuts each of its iterations into three calls, with a batch of
# requests instead of one, which Figure 0.1 draws: **schedule** (choose the requests and the
# number of tokens each computes this step, and give them KV-cache slots), **execute** (lay the
# tokens out, run the model, sample) and **update** (append the tokens, stop finished requests,
# free their memory). Deciding again at every step which requests run is Orca's iteration-level
# scheduling {cite}`yu2022orca`; the block-based cache is vLLM's {cite}`kwon2023paged`, and the
# package's shape follows nano-vllm {cite}`nanovllm_upstream` and vLLM {cite}`vllm_software`. The
# boxes name the package's methods; the drawing is made from them (`nanovllm/viz/diagrams.py`), so
# a rename shows here.

# %%
from nanovllm.viz.diagrams import engine_step_diagram

fig = engine_step_diagram()
figure(fig, "00_engine_step",
       "One engine step: schedule, execute, update, and what flows between them.")

# %% [markdown]
# ## 7. The map of the book and of the package
#
# Each chapter builds one component small, in the notebook, then shows the package's version,
# checks that the two agree, switches the component on in the engine and measures it. Every
# module's docstring names the chapter that teaches it, so the map below is not typed:
# `nanovllm/viz/package_map.py` reads the chapter titles from `chapters/NN_*.py` and, for each
# chapter, lists the package modules whose docstrings name it (a module can belong to several
# chapters; the last row holds the modules that name none). A chapter that modules name but that
# has no notebook yet is marked as not written yet. The README's chapter table is the same table,
# written by `python -m nanovllm.viz.package_map`, and a test fails when it is stale.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.viz.package_map import chapter_table, module_tree, package_modules

modules = package_modules(Path(nanovllm.__file__).parent)
display(Markdown(chapter_table(modules, Path("."), links=False)))  # the kernel runs in chapters/

# %% [markdown]
# The same walk, module by module: each with its length in lines, the chapters its docstring
# names and the first sentence of that docstring. (The counts change whenever the package does,
# so the notebook tests do not compare them.)

# %%
# NBVAL_IGNORE_OUTPUT
print(module_tree(modules))

# %% [markdown]
# **The data flow of one step.** `LLM.generate` tokenizes each prompt and wraps it, with its
# `SamplingParams`, in a `Sequence` (`engine/sequence.py`), which `LLMEngine.make_sequence`
# validates and `add_sequence` puts in the scheduler's waiting queue (`LLMEngine.add_request`
# does both, with vLLM's signature `add_request(request_id, prompt, params)`). Then `generate`
# calls `LLMEngine.step()` until every request has finished. One step does three things. First
# `Scheduler.schedule()` picks the batch: running sequences get one token each (decode), and
# waiting sequences are admitted with their prompts (prefill) as long as the step's token budget
# and the free KV-cache blocks allow; the `BlockManager` hands each sequence the blocks its new
# tokens need, and registers the blocks this step fills for prefix caching (chapter 04). Second,
# `ModelRunner.launch(batch)` lays all new tokens of the batch end to end, computes for each one
# the cache slot its key and value go to (from the sequence's block table), runs the model, whose
# attention layers write the new keys and values into the paged cache and read back everything
# cached for their sequence, and hands the logits of each sequence's last token to the
# `Sampler`, which returns one token per sequence. Third, `Scheduler.update_from_output`, the one
# function that advances a request: count the step's tokens as computed, put each sampled token
# into its sequence, check the stop conditions, on finishing free the sequence's blocks, and
# report. `step()` returns one `EngineCoreOutput` per request that progressed: its
# `request_id`, the `new_token_ids` since its last report and, in the step it ends, its
# `finish_reason`. That is all the engine hands out; `generate` feeds these deltas to an
# `OutputProcessor` (`engine/output_processor.py`, the async engine's too), whose `RequestState`
# per request turns them into the `RequestOutput`, text included, when it is done. (On a GPU the engine applies a step's
# tokens one call later, so that the CPU schedules the next step while the GPU computes this one:
# *async scheduling*, chapter 11.) Here is that loop, as the package has it today:

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown("```python\n" + inspect.getsource(llm.engine.step.__func__) + "```"))

# %% [markdown]
# We can drive that loop by hand. Four greedy requests with 13-token prompts that want 2, 4, 6 and 8
# new tokens (`ignore_eos=True` makes the lengths exact) go in, with our own request ids; after
# each step we print how many requests the step reported on, how many of those finished, and how
# many KV blocks are in use (a block holds `block_size` tokens of one sequence). We use a second,
# small engine for this (64 KV blocks), with async scheduling off, so that each step reports its
# own tokens on every device; a GPU turns async scheduling on by default, and then every report
# arrives one step later (chapter 11).

# %%
# NBVAL_CHECK_OUTPUT
stepper = LLM(smollm2_path(), dtype="float32", async_scheduling=False, num_kv_blocks=64).engine
print("block_size:", stepper.config.block_size, "tokens")
for i, n in enumerate([2, 4, 6, 8]):
    stepper.add_request(f"story-{i}", f"Story number {i}: a robot, a cat and a dog",
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
step = 0
while stepper.has_unfinished_requests():
    reports = stepper.step()
    step += 1
    done = sum(r.finished for r in reports)
    used = stepper.block_manager.num_blocks - stepper.block_manager.num_free_blocks
    print(f"step {step}: tokens for {len(reports)} requests, {done} finished; KV blocks in use: {used}")
print("the last step's report:", reports)

# %% [markdown]
# In step 1 all four prompts were computed together (a prefill of every prompt, which also yields
# each sequence's first token). Each later step is a *decode* step: one new token per running
# sequence. Each report is a delta: the one token the request got in that step, and, in the step
# it ends, its `finish_reason` (`'length'` for story-3, the last to finish). As requests finish, they leave the batch and give their blocks back; nobody waits for
# the longest request. In a server, new requests would be admitted into the freed places in the
# very next step: that is continuous batching. The blocks in use also *grow*: in step 5 the two
# remaining sequences reach their 17th token, one more than a block holds, and each gets a second
# block. Memory is handed out a block at a time, as it is needed.

# %% [markdown]
# ## 8. Peek inside
#
# Every chat prompt begins with the same default system message. The engine notices: when a prompt
# starts with tokens whose keys and values are still in the KV cache from an earlier request, it
# reuses them instead of computing them again (*prefix caching*, chapter 04). Each output carries
# per-request metrics, among them how many prompt tokens came from the cache. One more question:

# %%
# NBVAL_CHECK_OUTPUT
out = llm.chat([{"role": "user", "content": "What is the largest ocean?"}], greedy, use_tqdm=False)[0]
print(f"{out.text!r}: {len(out.prompt_token_ids)} prompt tokens, "
      f"{out.metrics.num_cached_prompt_tokens} of them found in the prefix cache")

# %% [markdown]
# (The answer is confidently wrong, a trench is not an ocean: a 135M-parameter model knows
# little. This book is about the engine, which must reproduce the model's choices exactly and fast,
# good or bad.) Only whole blocks of `block_size` tokens are shared (chapter 04 explains why), so the
# count is a multiple of the block size: the full blocks of the system message that all our chats
# share.
#
# The engine keeps counters we can read at any time. Everything above has finished, so no block is
# in use right now. The *prefix hit rate* is the fraction of prompt tokens, over the engine's life
# so far, that were found in the cache instead of being computed.

# %%
engine = llm.engine
bm = engine.block_manager
print(f"KV cache: {bm.num_blocks} blocks x {engine.config.block_size} tokens "
      f"= {bm.num_blocks * engine.config.block_size:,} tokens")
print(f"bytes per block: {engine.runner.kv_bytes_per_block():,}")
print(f"block usage now: {bm.usage:.2f}")
print(f"prefix hit rate so far: {bm.prefix_hit_rate:.3f} "
      f"({bm.hit_tokens} of {bm.queried_tokens} prompt tokens)")
print(f"preemptions so far: {engine.scheduler.num_preemptions}")

# %% [markdown]
# The hits are the system message's full block, found by every chat but the first: by the
# question above, and already by two of the three questions of §4, although those were admitted
# in the same step as the first one (a block is registered for sharing as soon as its
# computation is scheduled, chapter 04). Our completions and stories had nothing in common, so
# the rate stays low; a chat service whose requests share long system prompts sees much more. No
# request was ever *preempted* (evicted from the batch because the cache ran out of blocks,
# chapter 06): the cache is far larger than this chapter needs.
#
# The bytes per block follow from the architecture. Each token stores a key and a value (2) in
# every layer, for every KV head, each a vector of `head_dim` numbers of `dtype`'s size:
#
# $$\text{bytes per block} = 2 \times \text{layers} \times \text{KV heads} \times \text{head\_dim}
# \times \text{bytes per number} \times \text{block\_size}.$$

# %%
# NBVAL_CHECK_OUTPUT
itemsize = torch.empty(0, dtype=llm.config.torch_dtype).element_size()
per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize
print(f"2 x {mc.num_layers} x {mc.num_kv_heads} x {mc.head_dim} x {itemsize} = {per_token:,} bytes per token")
print(f"x block_size {llm.config.block_size} = {per_token * llm.config.block_size:,} bytes per block;"
      f" the engine says {engine.runner.kv_bytes_per_block():,}")

# %% [markdown]
# On a CPU the engine gives the KV cache a fixed budget of 1 GiB (the engine option
# `kv_cache_memory` changes it); divided by the bytes per block that gives the number of blocks
# printed above. On a GPU the engine's share of the card is `gpu_memory_utilization` (0.9 by
# default; two engines at 0.45 share one GPU), and the cache gets what is left of that share after
# the weights, the activations and the CUDA graphs: that is why the block count is the one number
# here that differs between machines.
#
# **Swapping models in a notebook.** An engine holds its share of the GPU until it is shut down.
# `llm = LLM(other)` builds the new engine while the old one still holds its memory, and on a GPU
# the new one is refused ("gpu_memory_utilization=0.9 asks for ... GiB ..., but only ... GiB are
# free"). Give the memory back first, then build:
#
# ```python
# llm.shutdown()        # or: del llm (once nothing else refers to the engine)
# llm = LLM(other_model)
# ```
#
# `with LLM(path) as llm:` does the same when the block ends. After `shutdown()` the old engine
# raises an error if used; its KV cache, CUDA graphs and weights are gone.
#
# Finally, every knob of the engine lives in one validated dataclass, `EngineConfig`; `LLM(path,
# **options)` accepts exactly its field names and rejects anything else with a helpful error. Here
# are the fields and their values in our engine (the model folder is shortened to its name; the
# list grows as the book adds components, so the notebook tests do not compare it):

# %%
# NBVAL_IGNORE_OUTPUT
for f in dataclasses.fields(EngineConfig):
    value = getattr(llm.config, f.name)
    if f.name == "model":
        value = Path(value).name
    print(f"{f.name:<24} {value!r}")

# %%
try:
    LLM(smollm2_path(), max_num_seq=8)  # a typo: the option is max_num_seqs
except ValueError as err:
    print("ValueError:", str(err)[:60], "...")

# %% [markdown]
# The options we rely on in this chapter: `block_size` (tokens per KV block), `max_num_seqs` (the
# most sequences in one step), `max_num_batched_tokens` (the most tokens in one step), and
# `enable_prefix_caching` and `enable_chunked_prefill`, both on:

# %%
for name in ["dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
             "enable_prefix_caching", "enable_chunked_prefill"]:
    print(f"{name:<24} {getattr(llm.config, name)!r}")

# %% [markdown]
# ## 9. The effect that makes engines worth writing: batching
#
# How long does one decode step take? For every new token the model multiplies the token's hidden
# vector by every weight matrix once: about 2 floating-point operations per parameter, while every
# weight has to come in from memory. For one sequence that is very little arithmetic per byte:

# %%
# NBVAL_CHECK_OUTPUT
flops_per_token = 2 * num_params
print(f"one decode step of one sequence: {flops_per_token / 1e9:.2f} GFLOP on "
      f"{weight_bytes / 1e6:.0f} MB of weights = {flops_per_token / weight_bytes:.2f} FLOP per byte")

# %% [markdown]
# Processors do far more arithmetic per byte than that (a laptop CPU ten or more FLOP per byte of
# memory traffic, a datacenter GPU hundreds), so a single-sequence decode step waits on memory, not
# on arithmetic. Now put *B* sequences in the step: the weights are read once and used B times.
# Until the arithmetic catches up with the memory traffic, B tokens cost about as much time as one,
# and throughput grows almost linearly with B.
#
# Let's measure. For each number of concurrent requests B we submit B short prompts that each want
# exactly 32 new tokens (`ignore_eos=True`), step the engine until all are done and time every
# step. The first step computes the prompts; the other 31 are decode steps with all B sequences.
# We report two throughputs in output tokens per second: *end to end* (all B·32 tokens over the
# wall time), and *decode* (B tokens per decode step, using the **fastest** of the 31 decode
# steps). Other programs on the machine can only add time to a step, never remove it: with the
# median, a busy machine once showed a step for 2 requests slower than a step for 4, which says
# nothing about batching. The fastest step is the closest we get to the cost of the step itself,
# but on a shared machine even the fastest of 31 can be slowed, so read the trend over B rather
# than two neighbouring rows. Sizes are small so that this runs in seconds on a laptop CPU.

# %%
NEW_TOKENS = 32
CONCURRENCY = [1, 2, 4, 8, 16, 32]


def measure_throughput(engine, num_requests: int, new_tokens: int = NEW_TOKENS) -> dict:
    """Run num_requests fixed-length requests together; output tokens/s end to end and in decode."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(None, f"{i}. Tell me a short story about a robot.", params)
    step_times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {
        "requests": num_requests,
        "steps": len(step_times),
        "end_to_end_tok_s": num_requests * new_tokens / wall,
        "decode_step_s": min(step_times[1:]),  # the other programs only add time
        "decode_tok_s": num_requests / min(step_times[1:]),
        "median_step_s": statistics.median(step_times[1:]),
    }


measure_throughput(engine, 2)  # warm-up: first-call allocations are not what we measure
results = [measure_throughput(engine, b) for b in CONCURRENCY]
print("steps per run:", [r["steps"] for r in results])

# %% [markdown]
# Every run took 32 steps, one per output token, whatever the number of requests: the requests
# really ran side by side. The measured throughputs (machine-dependent, so the notebook tests do
# not check them), with the median step beside the fastest to show how busy the machine was:

# %%
# NBVAL_IGNORE_OUTPUT
base = results[0]
print(f"{'requests':>8} {'fastest step ms':>16} {'median ms':>10} {'decode tok/s':>13} "
      f"{'speedup vs 1':>13} {'end to end tok/s':>17}")
for r in results:
    print(f"{r['requests']:>8} {1000 * r['decode_step_s']:>16.1f} {1000 * r['median_step_s']:>10.1f} "
          f"{r['decode_tok_s']:>13.1f} {r['decode_tok_s'] / base['decode_tok_s']:>12.1f}x "
          f"{r['end_to_end_tok_s']:>17.1f}")

# %%
use_book_style()
fig, ax = plt.subplots()
xs = [r["requests"] for r in results]
ax.plot(xs, [r["decode_tok_s"] for r in results], "o-", label="decode steps (fastest)")
ax.plot(xs, [r["end_to_end_tok_s"] for r in results], "s--", label="end to end")
ax.plot(xs, [base["decode_tok_s"] * b for b in xs], ":", color="grey", label="ideal: B x one request")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(xs, [str(x) for x in xs])
ax.set_xlabel("concurrent requests B")
ax.set_ylabel("output tokens / s")
threads = torch.get_num_threads()
where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {threads} thread{'s' * (threads > 1)}"
ax.set_title(f"SmolLM2-135M ({llm.config.dtype}), {NEW_TOKENS} new tokens each, {where}")
ax.legend()
figure(fig, "00_tour_throughput",
       "Output tokens per second against the number of concurrent requests B"
       f" (SmolLM2-135M, {where}):"
       " the fastest decode steps (solid), end to end with the prompt step (dashed), and B times"
       " one request's rate (dotted). Look at how far batching lifts throughput above one request"
       " at a time, and where the solid line bends away from the dotted ideal.")

# %% [markdown]
# Figure 0.2 is the whole case for an inference engine in one picture. Look at the decode step
# times in the table: one step for many sequences costs far less than that many steps for one
# sequence, because with one sequence the hardware mostly waits for the weights to arrive, and each
# extra sequence in the same step reuses weights that are already on their way. So throughput (the solid
# line) climbs steeply with the number of concurrent requests, far above what one request at a
# time can reach, and bends away from the dotted ideal only as the work that grows with the batch
# (the arithmetic itself, attention over each sequence's own cache, per-sequence bookkeeping)
# catches up with the cost of reading the weights. On a GPU, which has far more arithmetic per byte
# of memory bandwidth, the climb continues to much larger batches. The end-to-end curve sits a
# little lower because it also pays for the prompt step.
#
# Serving users one at a time would throw that factor away. Serving them together raises the
# problems the rest of this book solves: where to keep all their KV caches (chapters 03–05), whom
# to run in each step (06), and how to make each step cheap (02, 05, 07, 08, 09).

# %% [markdown]
# ## Exercises
#
# Each exercise is a function to complete (replace its `raise NotImplementedError`) followed by
# a cell that checks it; until you do, the check stops on that stub. The checks
# do not use the package: they build their own inputs and compare with values frozen in the
# check or with a reference written differently.
#
# **Exercise 1 — count the work.** Write `count_new_tokens(outputs)` that returns the total number
# of generated tokens in a list of `RequestOutput`s. A `RequestOutput` can carry several
# completions in `.outputs` (each a `CompletionOutput` with its own `token_ids`): count them all.
# The check builds stand-ins with just those fields (a request's `.outputs`, each completion's
# `.token_ids`, as the engine returns them) for seeded random batches, and compares with the
# number of tokens it put in.

# %% tags=["exercise"]
def count_new_tokens(outputs) -> int:
    """Total number of generated tokens over every completion of every request."""
    raise NotImplementedError("exercise 00.count_new_tokens")


# %% tags=["check", "raises-exception"]
import random
from types import SimpleNamespace


def completion(n: int, rng: random.Random) -> SimpleNamespace:
    """Stand-in for a CompletionOutput of n tokens (its text is longer than n characters)."""
    ids = [rng.randrange(49152) for _ in range(n)]
    return SimpleNamespace(index=0, text="tok " * n + "!", token_ids=ids, finish_reason="length")


def request(lengths: list[int], rng: random.Random) -> SimpleNamespace:
    """Stand-in for a RequestOutput with one completion per entry of lengths."""
    return SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3], finished=True,
                           outputs=[completion(n, rng) for n in lengths])


rng = random.Random(1)
assert count_new_tokens([]) == 0, "no requests, no tokens"
assert count_new_tokens([request([3], rng)]) == 3, "one request with 3 tokens"
assert count_new_tokens([request([3, 1], rng), request([5], rng)]) == 9, "count every completion"
for _ in range(50):
    batch = [[rng.randint(0, 20) for _ in range(rng.randint(1, 4))]  # completion lengths
             for _ in range(rng.randint(0, 8))]  # of each request
    expected = 0
    for per_request in batch:
        for n in per_request:
            expected += n
    got = count_new_tokens([request(lengths, rng) for lengths in batch])
    assert got == expected, f"completion lengths {batch}: got {got}, expected {expected}"
print("Exercise 1 passed: count_new_tokens counts every completion of 50 random batches")

# %% [markdown]
# **Exercise 2 — the chat template by hand.** Write `chatml_prompt(messages)` that turns a
# conversation into the exact string SmolLM2's chat template produces with
# `add_generation_prompt=True` (look at the prompt printed in §4): each message as
# `<|im_start|>{role}\n{content}<|im_end|>\n`, the default system message
# `You are a helpful AI assistant named SmolLM, trained by Hugging Face` first when the
# conversation does not start with a system message, and `<|im_start|>assistant\n` at the end. The
# check compares your strings with ones SmolLM2's tokenizer produced
# (`tokenizer.apply_chat_template(..., tokenize=False)`, frozen in the check), then takes your
# strings for seeded random conversations apart again, message by message.

# %% tags=["exercise"]
def chatml_prompt(messages: list[dict]) -> str:
    """SmolLM2's chat layout of `messages`, ready for the assistant's answer."""
    raise NotImplementedError("exercise 00.chatml_prompt")


# %% tags=["check", "raises-exception"]
import random

# frozen: SmolLM2's tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
# tokenize=False) for these conversations, computed once
frozen = [
    ([{"role": "user", "content": "hello"}],
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
     "<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "why?"}],
     "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nwhy?<|im_end|>\n"
     "<|im_start|>assistant\n"),
    ([{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "Über line\nbreak"}],
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
     "<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
     "<|im_start|>user\nÜber line\nbreak<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "ok"}],
     "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"),
]
for conversation, expected in frozen:
    got = chatml_prompt(conversation)
    assert got == expected, f"for {conversation}:\n got      {got!r}\n expected {expected!r}"

# seeded random conversations, taken apart again: one block per message, each closed by
# <|im_end|>\n, the default system block first when needed, the assistant's header last
default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
rng = random.Random(2)
words = ["hello", "Paris", "why?", "2+2", "tell me a joke", "ok", "Über", "line\nbreak"]
for _ in range(20):
    roles = (["system"] if rng.random() < 0.4 else []) + ["user", "assistant"] * rng.randint(0, 2)
    conversation = [{"role": r, "content": " ".join(rng.choices(words, k=rng.randint(1, 4)))}
                    for r in roles + ["user"]]
    *blocks, last = chatml_prompt(conversation).split("<|im_end|>\n")
    assert last == "<|im_start|>assistant\n", f"must end with the assistant's header, not {last!r}"
    if conversation[0]["role"] != "system":
        assert blocks[:1] == [default], f"the default system message must come first: {blocks[:1]}"
        blocks = blocks[1:]
    expected = [f"<|im_start|>{m['role']}\n{m['content']}" for m in conversation]
    assert blocks == expected, f"for {conversation}:\n got      {blocks}\n expected {expected}"
print(f"Exercise 2 passed: chatml_prompt matches the chat template on {len(frozen)} frozen and "
      "20 random conversations")

# %% [markdown]
# **Exercise 3 — which settings are invalid?** `SamplingParams` validates its fields when it is
# built and raises `ValueError` for a bad one, so a bad request never reaches the engine. Write
# `invalid_settings(settings)` that, *without* constructing `SamplingParams`, returns the indices
# of the settings (dicts of `temperature`, `top_k`, `top_p`, `min_p`, `max_tokens`) that it would
# reject. The rules are in the class docstring and in §4–5: temperature is not negative (0 is
# greedy), `top_k` is -1 (off) or at least 1, `top_p` lies in (0, 1], `min_p` in [0, 1], and
# `max_tokens` is at least 1. The check marks each value it tries as valid or not, following these
# rules, and builds seeded random settings from them.

# %% tags=["exercise"]
def invalid_settings(settings: list[dict]) -> list[int]:
    """Indices of the settings that SamplingParams would reject, in increasing order."""
    raise NotImplementedError("exercise 00.invalid_settings")


# %% tags=["check", "raises-exception"]
import random

# frozen: a few settings by hand, then every candidate value marked valid (True) or not (False)
# by the rules above (SamplingParams, tried once value by value, agrees); a missing field takes
# its (valid) default
by_hand = [{}, {"temperature": 0.0}, {"top_k": 0}, {"top_p": 0.0}, {"min_p": 1.0, "max_tokens": 1},
           {"max_tokens": 0}, {"top_p": 1.0, "top_k": -1}, {"temperature": -0.5, "top_p": 1.5}]
got = invalid_settings(by_hand)
assert got == [2, 3, 5, 7], f"{by_hand}: got {got}, expected [2, 3, 5, 7]"
assert invalid_settings([]) == [], "no settings, nothing invalid"
candidates = {
    "temperature": {0.0: True, 0.7: True, 1.0: True, 2.5: True, -0.1: False, -1.0: False},
    "top_k": {-1: True, 1: True, 50: True, 0: False, -2: False},
    "top_p": {1.0: True, 0.9: True, 1e-6: True, 0.0: False, 1.01: False, -0.5: False},
    "min_p": {0.0: True, 0.05: True, 1.0: True, -0.01: False, 1.5: False},
    "max_tokens": {1: True, 16: True, 64: True, 0: False, -3: False},
}
rng = random.Random(3)
settings = [{k: rng.choice(list(v)) for k, v in candidates.items() if rng.random() < 0.6}
            for _ in range(200)]
expected = [i for i, s in enumerate(settings) if not all(candidates[k][v] for k, v in s.items())]
got = invalid_settings(settings)
assert got == expected, (f"first disagreement at index {sorted(set(got) ^ set(expected))[0]}: "
                         f"{settings[sorted(set(got) ^ set(expected))[0]]}")
print(f"Exercise 3 passed: invalid_settings agrees with the rules on {len(settings)} random "
      "settings")

# %% [markdown]
# ## Summary
#
# * An inference engine wraps a model's forward pass with everything needed to serve many
#   requests: batching them, keeping and sharing their KV caches in memory, deciding who runs in
#   each step, and turning logits into tokens and text.
# * nanovllm's API mirrors vLLM's: `LLM(path, **options)`, `llm.chat(conversations, params)`,
#   `llm.generate(prompts, params)`, returning `RequestOutput`s with `text`, `token_ids` and
#   `finish_reason` (`"stop"` or `"length"`). Greedy decoding is deterministic; sampling with a
#   `seed` is reproducible whatever else is in the batch.
# * One engine step is schedule → prepare tensors → model forward over the paged KV cache →
#   sample → postprocess, and reports one delta (`EngineCoreOutput`: new token ids, finish
#   reason) per request that progressed. The same model in a plain for-loop produces the same
#   tokens; the engine changes how fast and how many, never what.
# * A decode step is memory-bound: it reads all the weights for a few FLOPs per byte. That is why
#   running many requests together multiplies throughput, as the figure shows, and why most of this
#   book is about making room for many requests and keeping each step cheap.
#
# **What's next.** Chapter 01 opens the model: the Llama forward pass layer by layer (RMSNorm,
# rotary position embeddings, grouped-query attention, SwiGLU), loading the weights, checking our
# logits against transformers', and the road from logits to tokens: greedy, temperature, top-k,
# top-p and the Gumbel-max trick our sampler uses.

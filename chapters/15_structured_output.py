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
# # Chapter 15 — Structured output
#
# Applications call an LLM server for JSON that their code parses. Asking nicely ("answer in
# JSON") is not a contract: a small model often adds a sentence, forgets a brace or invents a
# key. **Constrained decoding** makes the contract hold by construction: at every step the
# engine computes which tokens keep the output a valid prefix of *some* string the constraint
# accepts, and sets every other logit to $-\infty$ before sampling.
#
# 1. Why prompting is not enough: we measure how often SmolLM2's free answers parse.
# 2. A regular expression as an automaton, built small, and the token mask it gives over a toy
#    vocabulary whose tokens span several characters.
# 3. Why real masks are the hard part (a 49,152-token vocabulary scan per step) and how
#    xgrammar precomputes most of it; the package's masks agree with the small version.
# 4. The cost per step against batch size, measured; JSON schema to grammar; the engine and
#    the server.
#
# Package modules taught here: `nanovllm/structured_output/` (`params.py`: vLLM's
# `StructuredOutputsParams`; `backend_xgrammar.py`: compiling against the tokenizer, one matcher
# per sequence; `masks.py`: packed bitmasks, filled on the host and applied on the device;
# `toy_dfa.py`: this chapter's automaton), the matcher's advance in
# `nanovllm/engine/scheduler.py` (`_took_token`), the mask before sampling in
# `nanovllm/engine/model_runner.py` (`_sample`), the deferred sampling of constrained steps
# under async scheduling in `nanovllm/engine/llm_engine.py` (`_execute_constrained`),
# `response_format` in `nanovllm/serve/response_format.py`, and
# `nanovllm/benchmarks/structured_output.py`.
#
# The chapter runs in about two minutes on a 2-core CPU (SmolLM2-135M).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(15)

# %% [markdown]
# **Builds on:** the sampler and logits processors of chapter 01 (a mask is one more logits
# processor), the scheduler's single update path of chapter 06 and async scheduling of
# chapter 11, the server of chapter 10. The method follows Willard and Louf's finite-state
# guided generation (Outlines) and xgrammar's pushdown automata with precomputed
# context-independent tokens (Dong et al., 2024).

# %% [markdown]
# ## Setup

# %%
import json
import time
from pathlib import Path

import jsonschema
import matplotlib.pyplot as plt
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams, smollm2_path
from nanovllm.benchmarks.structured_output import mask_cost
from nanovllm.structured_output import masks
from nanovllm.structured_output.backend_xgrammar import GrammarBackend
from nanovllm.structured_output.masks import apply_token_bitmask, bitmask_words
from nanovllm.structured_output.toy_dfa import dfa_mask, number_dfa
from nanovllm.viz import figure, show_source, use_book_style

use_book_style()
torch.set_num_threads(1)  # small matmuls on 2 shared cores: one thread is faster
chapter_start = time.perf_counter()
llm = LLM(smollm2_path(), num_kv_blocks=128, max_model_len=512, async_scheduling=False)
tokenizer = llm.engine.tokenizer


def chat(question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)


# %% [markdown]
# ## 1. Why "please answer in JSON" fails
#
# Eight questions that ask for a JSON object with two fields, sampled four times each at
# temperature 0.7: how many answers does `json.loads` accept, and how many also validate
# against the schema the question describes?

# %%
# NBVAL_IGNORE_OUTPUT
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
subjects = ["a famous scientist", "a painter", "a football player", "a novelist",
            "a chess champion", "a composer", "an astronaut", "a film director"]
questions = [chat(f"Reply with only a JSON object with the keys \"name\" (a string) and "
                  f"\"age\" (an integer) describing {s}.") for s in subjects]


def parse_rate(outputs, schema):
    parsed = valid = total = 0
    for out in outputs:
        for sample in out.outputs:
            total += 1
            try:
                value = json.loads(sample.text)
            except json.JSONDecodeError:
                continue
            parsed += 1
            try:
                jsonschema.validate(value, schema)
                valid += 1
            except jsonschema.ValidationError:
                pass
    return parsed, valid, total


free = llm.generate(questions, SamplingParams(temperature=0.7, n=4, seed=0, max_tokens=48),
                    use_tqdm=False)
constrained = llm.generate(questions, SamplingParams(
    temperature=0.7, n=4, seed=0, max_tokens=48,
    structured_outputs=StructuredOutputsParams(json=PERSON)), use_tqdm=False)
free_rate, constrained_rate = parse_rate(free, PERSON), parse_rate(constrained, PERSON)
print("an unconstrained answer:", repr(free[0].outputs[0].text[:120]))
print("a constrained answer:   ", repr(constrained[0].outputs[0].text))
for name, (parsed, valid, total) in (("free", free_rate), ("constrained", constrained_rate)):
    print(f"{name:12s} parses: {parsed}/{total}   validates: {valid}/{total}")

# %% [markdown]
# Free answers parse only sometimes (the exact counts vary with the machine's floating point;
# the constrained ones cannot fail, which the cell below checks). A constrained answer may
# still be *wrong* (an invented age), but it is always *well-formed*: the application's parser
# never sees a stray sentence. One more way to fail remains: running out of `max_tokens`
# mid-object, which ends with `finish_reason="length"` and the partial text.

# %%
# NBVAL_CHECK_OUTPUT
parsed, valid, total = constrained_rate
print(f"constrained: {valid} of {total} answers validate against the schema")
assert valid == total

# %% [markdown]
# ## 2. A regular expression as an automaton
#
# A regular expression is a **deterministic finite automaton** (DFA): states, and for each state
# which character leads where. Reading text moves a cursor from state to state; a character
# with no edge kills the match; the text matches if it ends in an *accepting* state. Here is
# `-?[0-9]+(\.[0-9]+)?`, a number, written out by hand (`toy_dfa.number_dfa`):

# %%
# NBVAL_CHECK_OUTPUT
dfa = number_dfa()
for state, edges in dfa.transitions.items():
    shown = {("0-9" if chars.isdigit() and len(chars) == 10 else chars): nxt
             for chars, nxt in edges.items()}
    print(f"state {state}{' (accepting)' if state in dfa.accepting else '':13s} {shown}")
for text in ["42", "-3.14", "3.", "-", "1e5"]:
    print(f"{text!r:8} matches: {dfa.matches(text)!s:5}  state after it: {dfa.walk(0, text)}")

# %% [markdown]
# ## 3. The token mask over a toy vocabulary
#
# The decoder does not emit characters but **tokens**, and a token spans several characters.
# A token is allowed in a state when *all* its characters can be read from there without
# dying; the end-of-sequence token is allowed exactly in accepting states. That is assignment
# `15.dfa_mask`:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(dfa_mask)

# %% [markdown]
# Hints for `15.dfa_mask`, one rung at a time: (1) the answer is a loop over the vocabulary;
# (2) inside it, a loop over the token's characters that stops at the first dead step;
# (3) EOS does not walk: it asks whether `state` is accepting.
#
# The mask of every state over a toy vocabulary (Figure 15.1; a filled square: allowed):

# %%
# NBVAL_CHECK_OUTPUT
VOCAB = ["<eos>", "-", "1", "12", "3.", ".5", ".", "-7", "0.25", "a", "1a", "9.9."]
grid = [[int(t in dfa_mask(dfa, s, VOCAB, eos_id=0)) for t in range(len(VOCAB))]
        for s in dfa.states]
fig, ax = plt.subplots(figsize=(7.5, 2.6))
ax.imshow(grid, cmap="Greens", vmin=0, vmax=1.3, aspect="auto")
ax.set_xticks(range(len(VOCAB)), [repr(t) for t in VOCAB], rotation=45, ha="right")
ax.set_yticks(range(len(dfa.states)), [f"state {s}" for s in dfa.states])
ax.set_title("allowed next tokens for -?[0-9]+(\\.[0-9]+)?")
figure(fig, "15_toy_mask", "The toy DFA's token mask: a row per state, a column per token. "
       "'3.' is allowed at the start (its '.' leads to state 3) but '9.9.' never is; "
       "EOS only in the accepting states 2 and 4.")
for s in dfa.states:
    print(f"state {s}: {[VOCAB[t] for t in sorted(dfa_mask(dfa, s, VOCAB, eos_id=0))]}")

# %% [markdown]
# ## 4. Why real masks are the hard part
#
# With a real tokenizer the same scan walks 49,152 tokens (SmolLM2) or 151,669 (Qwen3) every
# step, for every constrained request. Timed in Python over SmolLM2's vocabulary:

# %%
# NBVAL_IGNORE_OUTPUT
vocab_size = llm.engine.model_config.vocab_size
texts = [tokenizer.decode([t]) for t in range(vocab_size)]
EOS = tokenizer.eos_token_id
start = time.perf_counter()
slow_mask = dfa_mask(dfa, 2, texts, eos_id=EOS)
scan_ms = 1e3 * (time.perf_counter() - start)
print(f"one Python vocabulary scan: {scan_ms:.0f} ms for {len(slow_mask)} allowed tokens")

# %% [markdown]
# Tens of milliseconds per request per step, longer than a whole decode step of a small model
# on a GPU. And JSON is not even regular: nesting needs a stack (a **pushdown automaton**), and
# which tokens may follow then depends on the stack too. xgrammar (used by vLLM and SGLang)
# makes this fast by splitting the vocabulary, for each automaton state, into
# **context-independent** tokens, whose validity the state alone decides (most of them:
# precomputed once, when the grammar is compiled) and the few **context-dependent** ones, checked
# against the stack at run time. The compiled grammar is cached per tokenizer and constraint
# (`GrammarBackend.compile`), so a schema shared by many requests compiles once.
#
# The package's mask for the same regex agrees with the toy scan over the whole vocabulary:

# %%
# NBVAL_CHECK_OUTPUT
backend = GrammarBackend(tokenizer.hf, vocab_size, {EOS})
bitmask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
for prefix in ["", "-", "12", "12.", "3.5"]:
    state = backend.new_state(StructuredOutputsParams(regex=r"-?[0-9]+(\.[0-9]+)?"))
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        state.accept(token)
    state.fill(bitmask, 0)
    logits = apply_token_bitmask(torch.zeros(1, vocab_size), bitmask, torch.tensor([0]))
    package = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    small = dfa_mask(dfa, dfa.walk(0, prefix), texts, eos_id=EOS)
    print(f"after {prefix!r:6}: {len(package):4d} tokens allowed, the toy scan agrees: "
          f"{package == small}")
    assert package == small

# %%
# NBVAL_IGNORE_OUTPUT
start, reps = time.perf_counter(), 100
for _ in range(reps):
    state.fill(bitmask, 0)
fill_us = 1e6 * (time.perf_counter() - start) / reps
print(f"xgrammar's mask for that state: {fill_us:.0f} us (the Python scan: {scan_ms:.0f} ms)")

# %% [markdown]
# ## 5. Applying the mask, and its cost per step
#
# A mask travels as a **packed bitmask**: per constrained row, $\lceil V/32 \rceil$ int32 words,
# bit $t \bmod 32$ of word $\lfloor t/32 \rfloor$ set when token $t$ is allowed (19 KB per row for
# Qwen3, instead of 152 KB of bools). The host fills the rows of the constrained requests
# (`masks.fill_bitmask`) while the device computes the forward pass; the model runner copies them
# over and applies them to the logits right before sampling, rows of unconstrained requests
# untouched. That is assignment `15.apply_mask`:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(masks.apply_token_bitmask)

# %% [markdown]
# Hints for `15.apply_mask`: (1) turn the `[R, W]` words into `[R, W, 32]` bits with one shift
# and one `& 1`; (2) flatten to `[R, 32W]` and cut to `V`; (3) write back only the listed
# rows with tensor indexing, no Python loop and no host sync.
#
# What it costs per step, on this CPU (every row constrained by a six-field JSON schema,
# the matchers at different points of a valid object; `nanovllm.benchmarks.structured_output`
# records the same on an H200):
#
# Figure 15.2 measures both costs against the number of constrained requests.

# %%
# NBVAL_IGNORE_OUTPUT
rows = mask_cost(Path(smollm2_path()), [1, 4, 16, 64], "cpu", reps=5)
fig, ax = plt.subplots(figsize=(6, 3.2))
sizes = [r["batch_size"] for r in rows]
ax.plot(sizes, [r["fill_ms"] for r in rows], "o-", label="fill (host, xgrammar)")
ax.plot(sizes, [r["apply_ms"] for r in rows], "s-", label="apply (torch, this CPU)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("constrained requests in the step")
ax.set_ylabel("ms per step")
ax.legend()
figure(fig, "15_mask_cost", "Per-step cost of the masks against the number of constrained "
       "requests, on this CPU. Filling (xgrammar) costs microseconds per request and runs on "
       "the host while the device computes the forward pass; applying touches every logit "
       "of the constrained rows, a memory-bound pass that a GPU makes cheap.")
for r in rows:
    print(f"batch {r['batch_size']:3d}: fill {r['fill_ms']:.3f} ms, apply {r['apply_ms']:.3f} ms")

# %% [markdown]
# Two costs are *not* in this plot. Compiling a new schema takes milliseconds to seconds (it
# happens once, at submission, in the submitting thread; a schema that does not compile is a
# `ValueError` there, and a 400 from the server). And under async scheduling (chapter 11) a
# constrained request's mask for step n needs the token of step n-1, still in flight when step
# n is planned. nanovllm does what vLLM does: it queues step n's forward pass for the whole
# batch, *then* lands step n-1, advances the matchers with its tokens and fills step n's masks
# while the device computes, and only then queues step n's sampling
# (`LLMEngine._execute_constrained`). Every request, constrained or not, stays in the
# pipeline; the device waits only if the host's matcher work outlasts the forward pass, and a
# batch with no constrained request never takes this path. (The other design, making only the
# constrained rows wait a step, would halve their speed.)
#
# ## 6. JSON schema to grammar
#
# xgrammar turns a JSON schema into a grammar (EBNF) and compiles that. A schema's `required`
# keys in order, `maxLength` and the integer range all become rules (the range as a
# regular expression over digits):

# %%
# NBVAL_CHECK_OUTPUT
import xgrammar

grammar = str(xgrammar.Grammar.from_json_schema(json.dumps(PERSON), any_whitespace=False))
# the schema's own rules (the shared basic_* rules for strings, numbers, ... follow them)
print("\n".join(line for line in grammar.splitlines() if not line.startswith("basic_")))

# %% [markdown]
# ## 7. In the engine and the server
#
# `SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... |
# choice=[...] | grammar=... | json_object=True))` is vLLM's interface. The input processor
# compiles the constraint and gives every sample its own matcher (`Sequence.grammar`); the
# scheduler's update path advances it with every delivered token and ends the request with
# "stop" when the constraint is complete; the model runner masks before sampling, so
# constrained and unconstrained requests share a batch. Requests of every kind in one batch:

# %%
# NBVAL_CHECK_OUTPUT
requests = [
    (chat("Name a primary color."), StructuredOutputsParams(choice=["red", "yellow", "blue"])),
    (chat("Give me a phone number."), StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
    (chat("Is water wet?"), StructuredOutputsParams(
        grammar='root ::= ("Yes" | "No") ", because " [a-z ]+ "."')),
    (chat("Describe a person."), StructuredOutputsParams(json=PERSON)),
]
outs = llm.generate([q for q, _ in requests],
                    [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
                     for _, so in requests], use_tqdm=False)
for (_, so), out in zip(requests, outs):
    print(f"{so.kind:8s} {out.outputs[0].finish_reason:6s} {out.outputs[0].text!r}")

# %% [markdown]
# The server (chapter 10) takes OpenAI's `response_format` and vLLM's `structured_outputs`:
#
# ```python
# client.chat.completions.create(model=..., messages=...,
#     response_format={"type": "json_schema",
#                      "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
# client.chat.completions.parse(model=..., messages=..., response_format=Person)  # pydantic
# client.completions.create(model=..., prompt=...,
#                           extra_body={"structured_outputs": {"regex": r"\d+"}})
# ```
#
# `{"type": "json_object"}` asks for any JSON object; streaming works unchanged; a schema,
# regex or grammar that does not compile is a 400 in OpenAI's error shape
# (`tests/test_serve_structured.py`).

# %% [markdown]
# ## Assignments
#
# In the course edition you write `apply_token_bitmask` in `nanovllm/structured_output/masks.py`
# (`15.apply_mask`, section 5), graded against a bit-by-bit reference and xgrammar's own kernel,
# and `dfa_mask` in `nanovllm/structured_output/toy_dfa.py` (`15.dfa_mask`, section 3), graded
# against Python's `re` on every state of the number automaton and on a second automaton.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("15"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — an automaton for `(yes|no)!?`.** Write `yes_no_dfa()`: the transitions of a
# DFA that matches exactly "yes", "no", "yes!" and "no!", in the toy DFA's shape -- a dict from
# each state to a dict from a character to the next state -- with its start state 0 and its set
# of accepting states. The check walks it, and computes its token mask over a small vocabulary
# the way `dfa_mask` does (the exercises run without the package).

# %% tags=["exercise"]
def yes_no_dfa() -> tuple[dict[int, dict[str, int]], set[int]]:
    """(transitions, accepting states) of a DFA for (yes|no)!? starting in state 0."""
    raise NotImplementedError("exercise 15.yes_no_dfa")


# %% tags=["check", "raises-exception"]
transitions, accepting = yes_no_dfa()


def walk(state, text):
    for ch in text:
        state = transitions.get(state, {}).get(ch)
        if state is None:
            return None
    return state


def matches(text):
    return walk(0, text) in accepting


for text, ok in [("yes", True), ("no!", True), ("yes!!", False), ("ye", False), ("", False)]:
    assert matches(text) == ok, text
vocab = ["<eos>", "y", "yes", "yes!", "no", "!", "n", "o!"]
allowed = {t for t, tok in enumerate(vocab) if t > 0 and walk(0, tok) is not None}
assert allowed == {1, 2, 3, 4, 6}, allowed
assert 0 not in accepting  # so EOS is not allowed at the start
print("Exercise 1 passed")

# %% [markdown]
# **Exercise 2 — pack a mask.** Write `pack(allowed, vocab_size)`: the int32 words of a packed
# bitmask for the set of allowed token ids (bit `t % 32` of word `t // 32`; a word whose bit 31
# is set is negative as an int32). The check unpacks your words and compares.

# %% tags=["exercise"]
import torch


def pack(allowed: set[int], vocab_size: int) -> torch.Tensor:
    raise NotImplementedError("exercise 15.pack")


# %% tags=["check", "raises-exception"]
import torch

for allowed, v in [({0, 31, 32, 63}, 64), ({5, 69}, 70), (set(), 10), (set(range(40)), 40)]:
    words = pack(allowed, v)
    assert words.dtype == torch.int32 and words.shape == ((v + 31) // 32,), words
    unpacked = {t for t in range(v) if (int(words[t // 32]) >> (t % 32)) & 1}
    assert unpacked == allowed, (allowed, unpacked)
print("Exercise 2 passed")

# %% [markdown]
# ## Summary
#
# - Prompting for JSON is a request, not a contract; a **token mask** before sampling makes the
#   output a valid prefix of the constraint at every step, and the request ends with "stop"
#   when the constraint is complete.
# - A regex is a DFA; a token is allowed when all its characters survive the walk. JSON needs
#   a stack; xgrammar precomputes the context-independent tokens of each state, so a mask costs
#   microseconds instead of a vocabulary scan.
# - Masks travel packed (32 tokens per int32), are filled on the host and applied on the
#   device; unconstrained rows are untouched; the cost grows linearly with the constrained
#   requests of a step.
# - nanovllm: `StructuredOutputsParams` (JSON schema, regex, choice, grammar, JSON object),
#   compiled once per constraint at submission, one matcher per sample, advanced only in the
#   scheduler's update path; under async scheduling a constrained step's sampling waits for
#   the step in flight, its forward pass does not; `response_format` and
#   `structured_outputs` in the server.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"chapter run time: {time.perf_counter() - chapter_start:.0f} s")

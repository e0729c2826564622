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
# # Chapter 10 — Serving
#
# Every chapter so far called the engine from the same Python process, with every request known
# up front. A deployed model is different: requests arrive over the network, at any moment, from
# clients that expect tokens to *stream* back while the model is still writing, that send
# malformed input, that retry, and that sometimes send far more than their share. This chapter
# puts the engine behind an **OpenAI-compatible HTTP server** and looks at what that takes:
#
# 1. why the engine must run **asynchronously** (the producer/consumer design of chapter 06);
# 2. **HTTP and server-sent events** by hand, with a raw socket, so nothing is magic;
# 3. the **server** itself, used with the official `openai` client: a completion, a stream, and
#    an error in OpenAI's shape;
# 4. **rate limiting** with token buckets (and your exercise: write one);
# 5. **priorities under load**: two classes of API key sharing one small engine (a figure);
# 6. **latency against request rate**, measured with the package's Poisson load generator (a
#    figure);
# 7. **deployment**: replicas or tensor parallelism, with what we have measured and what we have
#    only reasoned.
#
# Everything runs on a CPU in a couple of minutes, with servers on the loopback address
# `127.0.0.1` only. Status codes, token equality and counts are checked by the notebook tests;
# latencies depend on the machine and are shown but not checked.
#
# **Package modules taught here:** `nanovllm/engine/async_engine.py` (`AsyncEngine`),
# `nanovllm/engine/stream.py` (a request's stream, from the engine thread to its reader),
# `nanovllm/serve/` (`app.py` and `serving.py`: the endpoints; `streaming.py`: SSE;
# `admission.py`: API keys, token buckets, queue depth; `config.py`: the deployment's YAML;
# `server.py`: `serve` and `ServerThread`; `metrics.py`: Prometheus), and
# `nanovllm/benchmarks/serve.py` (the load generator).

# %%
from nanovllm.viz.diagrams import show_roadmap

show_roadmap(10)

# %% [markdown]
# **Builds on:** vLLM's OpenAI-compatible server {cite}`vllm_software`. The references are
# collected in the book's bibliography.

# %% [markdown]
# ## Setup
#
# Two models. SmolLM2-135M-Instruct (real weights, float32) answers the requests whose *text*
# we check. For the load experiments we want many requests in little time, so we also build a
# **tiny random model**: SmolLM2's tokenizer and architecture with 2 layers of width 64 and
# random weights (`load_format="dummy"`). Its words are nonsense, but with `ignore_eos` every
# request produces exactly the tokens it asks for, which is all a load test needs. As in
# chapter 06, on a CPU we run PyTorch with one thread (restored at the end).

# %%
# NBVAL_IGNORE_OUTPUT
import concurrent.futures
import json
import platform
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import matplotlib.pyplot as plt
import openai
import torch

import nanovllm
from nanovllm import LLM, SamplingParams, smollm2_path
from nanovllm.benchmarks import serve as loadgen
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve import ServeConfig, ServerThread, build_app
from nanovllm.serve.admission import TokenBucket
from nanovllm.serve.config import ApiKey, Limits
from nanovllm.viz import figure, figures_dir, show_source, use_book_style
from nanovllm.viz.records import HEADLINES, load_record

device = "cuda" if torch.cuda.is_available() else "cpu"
saved_threads = torch.get_num_threads()
if device == "cpu":
    torch.set_num_threads(1)
use_book_style()
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
SMOLLM2 = smollm2_path()
chapter_start = time.perf_counter()
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"nanovllm {nanovllm.__version__}, openai {openai.__version__}")
print(f"device: {device}, torch threads: {torch.get_num_threads()} (was {saved_threads})")


def make_tiny_model() -> Path:
    """SmolLM2's tokenizer and architecture, 2 layers of width 64; weights are random."""
    path = Path(tempfile.mkdtemp(prefix="tiny-smollm2-"))
    for f in SMOLLM2.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, head_dim=16,
                  max_position_embeddings=512)
    (path / "config.json").write_text(json.dumps(config))
    return path


TINY = make_tiny_model()


def tiny_server(engine_options: dict | None = None, **serve_options):
    """(ServerThread, AsyncEngine) for the tiny model, served as "tiny"; not started yet."""
    options = {"num_kv_blocks": 256, "max_num_seqs": 8} | (engine_options or {})
    engine = AsyncEngine(LLM(str(TINY), load_format="dummy", dtype="float32", **options).engine)
    config = ServeConfig(model=str(TINY), served_model_name="tiny", **serve_options)
    return ServerThread(build_app(engine, config)), engine


# %% [markdown]
# ## 1. Why an async engine
#
# `LLM.generate` is a *batch job*: it takes every request, runs steps until all are done and
# returns. A server cannot work that way. Requests arrive one at a time on many connections,
# and each connection wants its tokens as they are produced, not when the slowest request of
# the batch ends. Two things must run at once:
#
# - the **network side** (many connections, mostly waiting on slow clients), which asyncio
#   handles well: thousands of idle connections cost nothing;
# - the **engine loop** (one `step()` after another, each a few milliseconds of numeric work
#   that must not pause while a client is slow to read).
#
# If the event loop ran `step()` itself, every connection would freeze during each step, and a
# slow client would stall the GPU. Chapter 06 §8 introduced the answer, a **producer/consumer**
# design: one *engine thread* owns the `LLMEngine` and loops "take what is in the inbox, step,
# hand each request its new tokens"; producers (the HTTP handlers) `submit` into the inbox from
# any thread; each request gets a stream its consumer reads. The engine thread sleeps when there
# is no work. This is the whole loop:

# %%
# NBVAL_IGNORE_OUTPUT
show_source(AsyncEngine._run)

# %% [markdown]
# The scheduler of chapter 06 does not know where requests come from: whatever sits in the
# inbox at a step boundary joins the continuous batch. The server adds only a thin asyncio
# bridge (`AsyncEngine.stream`), which forwards each chunk into an `asyncio.Queue` with
# `loop.call_soon_threadsafe`, so the event loop never blocks on the engine.
#
# We load SmolLM2, compute a reference answer with the offline API, and then hand the *same*
# engine to an `AsyncEngine` and a server on a free port of `127.0.0.1`. (While the
# `AsyncEngine` runs, nothing else may call the `LLMEngine`, so the reference comes first.)

# %%
# NBVAL_CHECK_OUTPUT
PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
smol = LLM(str(SMOLLM2), dtype="float32", num_kv_blocks=128, max_num_seqs=4)
reference = smol.generate([PROMPT], GREEDY, use_tqdm=False)[0]
smol_engine = AsyncEngine(smol.engine)
smol_server = ServerThread(build_app(smol_engine, ServeConfig(
    model=str(SMOLLM2), served_model_name="smollm2"))).start()
print(f"reference: {len(reference.token_ids)} tokens; server on 127.0.0.1: "
      f"{smol_server.host == '127.0.0.1'}")

# %% [markdown]
# ## 2. HTTP and SSE by hand
#
# HTTP/1.1 is text over a TCP connection: a request line, headers, an empty line, a body. The
# answer has the same shape. **Server-sent events** (SSE) are a way to stream an answer over
# one HTTP response: the server sends `Content-Type: text/event-stream` and then, whenever it
# has something to say, a line `data: <payload>` followed by an empty line; OpenAI's API ends a
# stream with `data: [DONE]`. No WebSocket, no special client: a socket will do. We send an
# HTTP/1.0 request (so the server closes the connection when done and does not frame the body
# in chunks) and read until the end.

# %%
# NBVAL_CHECK_OUTPUT
body = json.dumps({"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                   "ignore_eos": True, "stream": True}).encode()
request = (b"POST /v1/completions HTTP/1.0\r\n"
           b"Host: 127.0.0.1\r\n"
           b"Content-Type: application/json\r\n"
           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
with socket.create_connection((smol_server.host, smol_server.port), timeout=60) as sock:
    sock.sendall(request)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk

head, _, payload = raw.decode().partition("\r\n\r\n")
status_line, *header_lines = head.split("\r\n")
headers = dict(line.split(": ", 1) for line in header_lines)
events = [line[len("data: "):] for line in payload.split("\n") if line.startswith("data: ")]
print(status_line)
print("content-type:", headers.get("content-type"))
# How many events carry the 12 tokens depends on timing (a step's tokens share one event when
# the reader falls behind), so the checked output says only that the answer came in pieces.
print(f"streamed in {'several events' if len(events) > 2 else 'one piece'}, "
      f"the last one {events[-1]!r}")
chunks = [json.loads(e) for e in events[:-1]]
streamed = "".join(c["choices"][0]["text"] for c in chunks)
print(f"first event's object: {chunks[0]['object']!r}; "
      f"finish_reason of the last: {chunks[-1]['choices'][0]['finish_reason']!r}")
print("streamed text equals LLM.generate's:", streamed == reference.text)

# %% [markdown]
# What the wire carried (the first two events and the end; the text is the model's):

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{len(events)} events")
print(head[:200], "\n...")
print(payload[:400].rstrip(), "\n...\n", payload[-60:].strip())

# %% [markdown]
# Each event is one JSON object, a "chunk" in OpenAI's format, carrying the text of the tokens
# one engine step produced for this request. The package writes these lines in
# `nanovllm/serve/streaming.py`; a client that disconnects mid-stream makes the server abort
# its request, so its KV blocks return to the pool at the next step.

# %% [markdown]
# ## 3. The server, with the official client
#
# `nanovllm serve MODEL` (or `python -m nanovllm.serve`) runs FastAPI and uvicorn over an
# `AsyncEngine`; `ServerThread` runs the same app on a background thread, for notebooks and
# tests. Because the API is OpenAI's, the official `openai` client talks to it unchanged: only
# `base_url` points elsewhere. Fields OpenAI does not have (`ignore_eos`, `top_k`, `priority`)
# travel in `extra_body`, as with vLLM.

# %%
# NBVAL_CHECK_OUTPUT
client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
print("models:", [m.id for m in client.models.list().data])
completion = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
choice = completion.choices[0]
print(f"completion: finish_reason {choice.finish_reason!r}, usage "
      f"{completion.usage.prompt_tokens} prompt + {completion.usage.completion_tokens} "
      f"completion tokens, text equals LLM.generate's: {choice.text == reference.text}")
stream = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True})
pieces = [c.choices[0].text for c in stream if c.choices]
print(f"stream: {len(pieces) > 1} (more than one chunk), "
      f"joined text equals LLM.generate's: {''.join(pieces) == reference.text}")

# %% [markdown]
# The text itself (SmolLM2's continuation; not checked, as a GPU's float rounding may differ):

# %%
# NBVAL_IGNORE_OUTPUT
print(repr(PROMPT + choice.text))

# %% [markdown]
# Errors come back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
# the status code OpenAI would use, so the client raises its usual exception classes. An
# unknown model is a 404; a bad field a 400 naming the field:

# %%
# NBVAL_CHECK_OUTPUT
for kwargs in ({"model": "gpt-7"}, {"model": "smollm2", "temperature": -1.0}):
    try:
        client.completions.create(prompt="Hi", max_tokens=2, **kwargs)
    except openai.APIStatusError as err:
        error = err.response.json()["error"]
        print(f"{type(err).__name__}: {err.status_code}, keys {sorted(error)}, "
              f"type {error['type']!r}, param {error['param']!r}")

# %% [markdown]
# This server's work is done: it stops (the thread joins, the port closes) and its engine
# thread ends.

# %%
# NBVAL_CHECK_OUTPUT
smol_server.stop()
smol_engine.shutdown()
print("server thread alive:", smol_server.thread.is_alive(), "| engine running:",
      smol_engine.is_running)

# %% [markdown]
# Figure 10.1 is the path every request of this section took, read from the steps that
# `nanovllm/serve/serving.py` documents: each step can turn the request away with its own HTTP
# status, and the ones that pass reach the engine's thread through the async engine, whose tokens
# come back through asyncio queues.

# %%
from nanovllm.viz.diagrams import request_path_diagram

fig = request_path_diagram()
figure(fig, "10_request_path",
       "A request's path through the server: each step and the status it answers with when it "
       "refuses.")

# %% [markdown]
# ## 4. Rate limiting: the token bucket
#
# A public endpoint needs limits per API key: so many requests per second, so many tokens per
# minute. The classic mechanism is the **token bucket**. A bucket holds at most `capacity`
# tokens and starts full; tokens flow in at `rate` per second; a request may enter if the
# bucket holds what it costs, and then takes it. So a key may send a **burst** of `capacity`
# at once after being idle, but on average no more than `rate` per second, and a rejected
# client can be told *exactly* how long to wait (the HTTP `Retry-After` header): the missing
# amount divided by the rate.
#
# Nothing has to tick in the background: the bucket is **lazy**. It remembers its level and
# when it was last updated, and before each question it adds `rate × elapsed`, capped at the
# capacity. The package's bucket (the refill is this chapter's assignment):

# %%
# NBVAL_IGNORE_OUTPUT
show_source(TokenBucket)

# %% [markdown]
# The token-per-minute bucket charges a request's prompt when it enters and its generated
# tokens when it ends; since the output length is not known in advance, the bucket may go into
# **debt**, which delays the key's next requests. On a fake clock, a bucket of 3 requests
# refilled at 2 per second, asked for one request every 0.125 s:

# %%
# NBVAL_CHECK_OUTPUT
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


clock = FakeClock()
bucket = TokenBucket(rate=2, capacity=3, clock=clock)
for i in range(12):
    clock.now = 0.125 * i
    wait = bucket.wait_time(1)
    if wait == 0:
        bucket.take(1)
    print(f"t={clock.now:.3f} s  " + ("admitted" if wait == 0 else f"429, retry in {wait:.2f} s"))

# %% [markdown]
# The first three pass in a row (the burst), then one every 0.5 s: the rate. The server runs
# this check in `Admission.enter`, the moment a request arrives and before its body is read (so
# a refused request costs nothing, and a request that fails later still counts), after one
# gate and before another: an API key (401 without a valid one when keys are configured), and
# the queue depth (`Admission.admit`: 429 when the server already holds `max_num_seqs +
# max_queue_depth` sequences). A live server with a limit of one request per two seconds and a
# burst of 3, hit by six quick requests:

# %%
# NBVAL_CHECK_OUTPUT
server, engine = tiny_server(limits=Limits(requests_per_second=0.5, burst=3))
with server:
    answers = [httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
               for _ in range(6)]
engine.shutdown()
print("status codes:", [a.status_code for a in answers])
refused = answers[-1]
print("Retry-After present:", "retry-after" in refused.headers, "| error code:",
      refused.json()["error"]["code"])

# %% [markdown]
# ## 5. Priorities under load
#
# A rate limit decides *whether* a request enters; once inside, the scheduler's **policy**
# (chapter 06) decides *when* it runs. In a deployment, API keys belong to **key classes**
# (`key_classes` in the YAML config), and a class carries a priority the scheduler's priority
# policy uses (lower runs first), and a tenant name the fair policy shares by. A typical split:
# interactive users and a batch pipeline share one engine.
#
# A small live experiment on the tiny model. The engine runs at most 2 sequences at once. A
# batch key sends 10 long requests (60 tokens) at once; 0.05 s later an interactive key sends 4
# short ones (10 tokens), one every 0.05 s. We measure every request's end-to-end latency under
# first-come-first-served and under the priority policy.

# %%
# NBVAL_IGNORE_OUTPUT
KEYS = [ApiKey("sk-chat", "chat-app", "interactive"), ApiKey("sk-batch", "pipeline", "batch")]
CLASSES = {"interactive": Limits(priority=0), "batch": Limits(priority=10)}


def timed_request(url: str, key: str, max_tokens: int, delay: float) -> tuple[int, float]:
    time.sleep(delay)
    start = time.perf_counter()
    answer = httpx.post(f"{url}/v1/completions", timeout=120,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": "tiny", "prompt": "alpha beta", "max_tokens": max_tokens,
                              "ignore_eos": True})
    return answer.status_code, time.perf_counter() - start


def priority_run(policy: str) -> dict[str, list[tuple[int, float]]]:
    server, engine = tiny_server({"max_num_seqs": 2, "scheduler_policy": policy},
                                 api_keys=KEYS, key_classes=CLASSES)
    jobs = [("batch", "sk-batch", 60, 0.0)] * 10
    jobs += [("interactive", "sk-chat", 10, 0.05 * (i + 1)) for i in range(4)]
    with server, concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [(cls, pool.submit(timed_request, server.url, key, n, delay))
                   for cls, key, n, delay in jobs]
        results = {"batch": [], "interactive": []}
        for cls, future in futures:
            results[cls].append(future.result())
    engine.shutdown()
    return results


priority_results = {policy: priority_run(policy) for policy in ("fcfs", "priority")}
for policy, results in priority_results.items():
    for cls, rows in results.items():
        latencies = [t for _, t in rows]
        print(f"{policy:8s} {cls:11s}: mean {1e3 * sum(latencies) / len(latencies):6.0f} ms, "
              f"max {1e3 * max(latencies):6.0f} ms")

# %% [markdown]
# Every request finished, whatever the policy (checked):

# %%
# NBVAL_CHECK_OUTPUT
for policy, results in priority_results.items():
    print(policy, {cls: [code for code, _ in rows].count(200) for cls, rows in results.items()})

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(7, 3.6))
for i, policy in enumerate(priority_results):
    for j, cls in enumerate(("interactive", "batch")):
        latencies = [1e3 * t for _, t in priority_results[policy][cls]]
        x = 2 * i + j + 0.12 * torch.linspace(-1, 1, len(latencies)).numpy()
        ax.scatter(x, latencies, color=COLORS[j], label=cls if i == 0 else None, alpha=0.8)
ax.set_xticks([0, 1, 2, 3], ["fcfs\ninteractive", "fcfs\nbatch", "priority\ninteractive",
                             "priority\nbatch"])
ax.set(ylabel="end-to-end latency (ms)",
       title="Two key classes on one engine (2 slots, tiny model, CPU)")
ax.legend()
figure(fig, "10_serving_priorities",
       "The end-to-end latency of every request of two key classes, interactive and batch, sent"
       " together to one engine (tiny model, 2 slots, this machine's CPU), under first come,"
       " first served and under the priority policy.")

# %% [markdown]
# In Figure 10.2, under first come, first served the interactive requests queue behind the whole
# batch backlog: their latency is roughly the time to drain it. Under the priority policy each one
# takes the next free slot, so its latency is about its own generation time plus the wait for one
# slot (a running batch request is not interrupted). The batch requests pay a little for it. The
# same experiment on your machine gives other milliseconds but the same shape.

# %% [markdown]
# ## 6. Latency against request rate
#
# How much load can a deployment take? The package's load generator,
# `python -m nanovllm.benchmarks.serve`, sends streamed requests whose arrivals form a
# **Poisson process** at a given rate (exponential gaps: real users do not coordinate), and
# measures per request the **TTFT** (time to first token), the **TPOT** (time per output token
# after the first) and the end-to-end latency; per rate it reports percentiles, throughput and
# **goodput**: the requests per second that met a latency objective (an SLO on TTFT and TPOT).
#
# As the rate grows, the continuous batch grows, and each step serves more requests: throughput
# rises almost for free, while TPOT creeps up. Past the engine's capacity, requests wait in the
# queue: TTFT climbs steeply, and goodput falls away from throughput. We run it small and live,
# against the tiny model (16 requests per rate, 32 prompt tokens, 16 output tokens), calling the
# command's `main` with the arguments one would type (on a thread of its own: `main` runs its
# own asyncio loop, and Jupyter already runs one). Here the load generator shares the process,
# and on a 2-core CPU the cores, with the server: the numbers measure this notebook, not a
# deployment.

# %%
# NBVAL_IGNORE_OUTPUT
RATES = ["8", "32", "inf"]
server, engine = tiny_server({"max_num_seqs": 16})
with server, tempfile.TemporaryDirectory() as tmp:
    argv = ["--base-url", server.url, "--model", "tiny", "--rates", *RATES,
            "--num-requests", "16", "--input-len", "32", "--output-len", "16", "--seed", "0",
            "--slo-ttft", "0.25", "--slo-tpot", "0.02", "--json", f"{tmp}/load.json"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (main calls asyncio.run, which
        report = pool.submit(loadgen.main, argv).result()  # cannot run inside Jupyter's loop)
engine.shutdown()

# %%
# NBVAL_CHECK_OUTPUT
for run in report["runs"]:
    print(f"rate {run['rate']}: {run['completed']} completed, {run['failed']} failed, "
          f"{run['output_tokens']} output tokens")

# %%
# NBVAL_IGNORE_OUTPUT
fig = loadgen.plot(report)
fig.suptitle("tiny model on this machine's CPU: 16 requests, 32 in / 16 out tokens, "
             "SLO TTFT 250 ms, TPOT 20 ms")
figure(fig, "10_serving_load",
       "The load generator against a live server of the tiny model on this machine: TTFT and"
       " TPOT percentiles (left, middle) and request throughput and goodput (right) at offered"
       f" rates of {', '.join(RATES)} requests/s, {report['config']['num_requests']} requests"
       " each.")

# %% [markdown]
# Read Figure 10.3 left to right: at a low rate each request runs nearly alone; at "inf" all
# arrive at once, and the last ones wait for the first ones' prefill steps, which the TTFT p99
# shows. The same command against a GPU server (`--base-url`) gives the curve that sizes a
# deployment: the highest rate whose p99 still meets the SLO is what one replica can promise.

# %% [markdown]
# ## 7. Deployment: replicas or tensor parallelism?
#
# A deployment must carry more load than one engine gives. Two ways to add GPUs:
#
# - **Replicas**: N independent servers, each with the whole model, behind a load balancer.
# - **Tensor parallelism** (TP): one server whose every weight matrix is split across N GPUs,
#   with an all-reduce after the attention and the MLP of every layer.
#
# What is **measured**: one H200 running Qwen3-0.6B offline (`figures/data/bench_h200.json`,
# chapter 11's benchmark); the server's own load test on that GPU, with the load generator of
# §6 in a second process on the same machine (`figures/data/serve_h200.json`); and the engine
# at tensor-parallel sizes 1 and 2 on two NVLink-connected H200s (`figures/data/tp_h200x2.json`,
# chapter 09).

# %%
# NBVAL_IGNORE_OUTPUT
data = figures_dir() / "data"
bench = load_record(HEADLINES["h200_qwen3_0.6b_tok_s"].record)  # the book's current one
print(f"measured ({bench['device']}, {bench['date']}): {bench['model']}, {bench['requests']} "
      f"requests, {bench['nanovllm_tok_s']:,.0f} output tok/s offline, mean decode batch "
      f"{bench['mean_decode_batch']:.0f}, mean decode step {bench['mean_decode_step_ms']:.2f} ms")
print(f"   command: {bench['command']}")
serve_h200 = data / "serve_h200.json"
if serve_h200.exists():
    recorded = json.loads(serve_h200.read_text())
    print(f"server load test ({recorded['device']}, {recorded['date']}): {recorded['command']}")
    for run in recorded["runs"]:
        print(f"   rate {run['rate']}: {run['request_throughput_rps']:.1f} req/s, "
              f"TTFT p99 {1e3 * run['ttft']['p99']:.0f} ms, "
              f"TPOT p99 {1e3 * run['tpot']['p99']:.1f} ms, goodput {run['goodput_rps']:.1f}")
tp = json.loads((data / "tp_h200x2.json").read_text())
print(f"tensor parallelism ({tp['device']}, {tp['runs'][-1]['date'][:10]}), nano-vllm workload, "
      "40 GiB of KV cache per GPU (chapter 09's own runs, TP=1 included):")
for run in tp["engines"]:
    graphs_ms = {row["batch"]: row["graphs_ms"] for row in run["decode"]}
    print(f"   {run['model']:11s} TP={run['tp']}: {run['output_tok_s']:7,.0f} output tok/s, decode "
          f"step {graphs_ms[1]:.2f} ms at batch 1, {graphs_ms[64]:.2f} ms at batch 64")

# %% [markdown]
# Reading these records, with some reasoning where they stop:
#
# - The server saturates long before the engine does: at "inf" it delivers about 3,900
#   output tok/s, while the same engine offline runs the larger nano-vllm workload several
#   times faster (the first line above, chapter 11's record). Its TPOT jumps from ~2 ms to
#   ~30 ms between 16 and 64 requests/s. The server and
#   the engine share one Python process (one GIL): parsing requests, formatting a JSON chunk
#   per token per stream and the event loop compete with the engine's step loop. This is
#   why vLLM runs its API server and its engine core in separate processes; §8 builds that
#   split and measures it.
# - A replica shares nothing with its neighbours, so N replicas serve about N times the rate
#   of one at the *same* latency, as long as the load balancer spreads requests evenly (and
#   sends requests that share a prefix to the same replica, or the prefix cache of chapter 04
#   is split N ways). Each replica's latency-vs-rate curve is the single-GPU curve above.
# - TP should make *one* step faster: each GPU reads 1/N of the weights and 1/N of the KV
#   cache, but every layer adds two all-reduces whose cost does not shrink with N. Measured,
#   it did not: at TP=2 a decode step took longer than at TP=1 for both shapes (chapter 09
#   breaks the step down: the all-reduces and the per-step message from rank 0 to its worker
#   sit on the critical path). What TP=2 did buy is throughput on the whole workload
#   (1.26x for Qwen3-0.6B, 1.55x for Qwen3-8B): twice the KV memory admits larger batches,
#   and prefill's matmuls split across two GPUs. It is the answer when the model and its KV
#   cache **do not fit** on one GPU, or to raise one server's capacity for a big model.
# - For a 0.6B model, whose weights (about 1.2 GB in bf16) are a sliver of an H200's memory,
#   two replicas give each request a full GPU and should reach about twice one GPU's rate:
#   more than TP=2's 1.26x (that replica figure is reasoning from the single-GPU curve, not a
#   measurement).
#
# The numbers that would settle it for a given model are the latency-vs-rate curve of one
# replica (recorded above for Qwen3-0.6B) and the same curve of a TP=2 server (`nanovllm serve
# --tensor-parallel-size 2`), which is not recorded yet.

# %% [markdown]
# ## 8. One process or two: the engine core on its own
#
# §7 found the server delivering a fraction of what its engine does offline. The reason is
# Python's global interpreter lock: the engine thread of §1 and the event loop of §3 run in one
# process, so while the loop parses a request or formats a JSON chunk, the next step waits, and
# the GPU idles. vLLM's answer (its "v1" engine) is two processes: an **engine core** that loops
# on `step()` and never waits for the web server, and the **API process** (FastAPI, uvicorn)
# that validates, tokenizes, detokenizes and streams. `nanovllm serve` works that way by
# default (`--in-process-engine` keeps the thread):
#
# - `nanovllm/engine/core_proc.py` is the child's loop: read every waiting command (add,
#   abort, shutdown), run a step, send one message with the step's outputs;
# - `nanovllm/engine/core_client.py` stands in for the `LLMEngine` that `AsyncEngine` drives:
#   `make_sequences` validates in the API process (with the limits the core reports when it
#   starts), `add_sequences` queues, and `step()` does not compute anything: it collects what
#   the core has finished since the last call.
#
# What crosses the boundary matters: one message per step (or per command), never one per
# token of every request. A step's outputs travel as plain tuples, pickled together:

# %%
# NBVAL_CHECK_OUTPUT
import pickle

from nanovllm.engine.core_proc import decode, encode
from nanovllm.engine.output_processor import EngineCoreOutput

step_outputs = [EngineCoreOutput(str(i), [1000 + i]) for i in range(256)]  # one decode step
wire = pickle.dumps(("step", [encode(o) for o in step_outputs], [], None))
print(f"a decode step of 256 requests: one message of {len(wire):,} bytes "
      f"({len(wire) / 256:.0f} per request)")
print("round trip equal:", [decode(w)[0] for w in pickle.loads(wire)[1]] == step_outputs)

# %% [markdown]
# The package's two modes must give the same answers. We run the same greedy and seeded requests
# through an engine on a thread and through an engine core in its own process (the child
# imports the package and builds its own engine: a few seconds):

# %%
# NBVAL_CHECK_OUTPUT
same_params = [SamplingParams(temperature=0, max_tokens=12),
               SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=2)]
same_prompts = ["The capital of France is", "Once upon a time"]
answers = {}
for mode in ("thread", "process"):
    with AsyncEngine.from_model(str(TINY), engine_process=mode == "process",
                                load_format="dummy", dtype="float32", seed=0,
                                num_kv_blocks=64, max_num_seqs=4) as two_mode_engine:
        outs = [two_mode_engine.submit(p, sp).result(120)
                for p, sp in zip(same_prompts, same_params)]
        answers[mode] = [[c.token_ids for c in o.outputs] for o in outs]
print("engine core in its own process gives the thread's tokens:",
      answers["process"] == answers["thread"])

# %% [markdown]
# Two more changes keep the API process's work per token small. The engine thread hands a
# step's tokens to the event loop in one batch (one wake-up of the loop per step, not one per
# request: `LoopBridge` in `nanovllm/engine/stream.py`), and a stream whose reader fell behind
# reads everything that has arrived as one chunk (`coalesce`): one detokenization and one
# server-sent event for several tokens.
#
# **Measured on the H200.** `python -m nanovllm.benchmarks.serve_compare` runs offline
# `LLM.generate` and then the server in each mode on the same requests, in one sitting, with
# four load-generator processes (so that the client is not the bottleneck: it records their
# CPU seconds, and those of the API process and of the engine core):

# %%
# NBVAL_IGNORE_OUTPUT
def compare_table(report: dict) -> None:
    """Offline vs each server mode, whole and streamed, and latency against rate."""
    print(f"{report['device']}, {report['date'][:10]}, commit {report['git_commit']}")
    print(f"   command: {report['command']}")
    for name, off in report["offline"].items():
        size = f"{off['num_requests']} x {report['config']['input_len']} -> " \
               f"{off['output_tokens'] // off['num_requests']}"
        print(f"{name} set ({size}): offline {off['output_throughput_tps']:,.0f} tok/s")
        for mode, runs in report["servers"].items():
            for run in runs:
                if run["set"] == name and run["rate"] == "inf":
                    share = run["output_throughput_tps"] / off["output_throughput_tps"]
                    how = "streamed" if run["stream"] else "whole   "
                    cpu = ", ".join(f"{k} {v:.1f}" for k, v in run["server_cpu_s"].items())
                    print(f"   {mode:7s} {how} {run['output_throughput_tps']:8,.0f} tok/s "
                          f"({share:4.0%}) in {run['duration_s']:.2f} s; CPU s: {cpu}; "
                          f"clients {max(run['client_cpu_s']):.1f} s max")
    for mode, runs in report["servers"].items():
        streamed = [r for r in runs if r["set"] == "small" and r["stream"]]
        print(f"{mode}: " + "; ".join(
            f"rate {r['rate']}: TPOT p50 {1e3 * r['tpot']['p50']:.1f} ms, TTFT p99 "
            f"{1e3 * r['ttft']['p99']:.0f} ms" for r in streamed))


from nanovllm.benchmarks import serve_compare

h200_compare = load_record("serve_compare_h200.json")
compare_table(h200_compare)

# %%
# NBVAL_IGNORE_OUTPUT
fig = serve_compare.plot(h200_compare)
figure(fig, "10_serving_one_or_two_processes",
       "The server on the H200 (Qwen3-0.6B shape, dummy weights, 256 streamed requests of 128"
       " -> 64 tokens): output tokens per second (left) and TPOT p50 (right) against the"
       " request rate, with the engine on a thread of the API process and in an engine-core"
       " process of its own; the dashed line is offline LLM.generate on the same requests"
       " (figures/data/serve_compare_h200.json).")

# %% [markdown]
# Reading Figure 10.4: the split is what lets the server keep up at the high rates. At the low rates
# both modes deliver what is asked (the curves coincide); at the higher ones the thread mode's
# TPOT climbs steeply while the engine waits for the event loop, and the process mode's
# climbs much less. Yet even two processes stay well short of offline `LLM.generate` when
# every request arrives at once, and further from it when streamed. The CPU seconds show
# why: the API process is now the busy one -- nearly one full core for the length of the
# streamed run, a single Python thread's worth, while the engine core has time to spare.
# Where does the API process spend it? A sampling profiler (py-spy) attached to it while it
# streams (on this project's CPU, with the tiny model, so that the API process is the only
# bottleneck; the work per token does not depend on the device):

# %%
# NBVAL_IGNORE_OUTPUT
api_profile = load_record("serve_profile_cpu.json")
print(f"{api_profile['device']}, {api_profile['date'][:10]}: {api_profile['samples']} samples")
for thread, share in api_profile["threads"]:
    print(f"   {share:5.1%}  {thread}")
print("most samples on top of the stack:")
for frame, share in api_profile["self"][:12]:
    print(f"   {share:5.1%}  {frame}")

# %% [markdown]
# The event loop's share goes to the web stack's per-event path (uvicorn's `send`, starlette's
# response wrappers), building and dumping a pydantic model per chunk, JSON encoding and
# detokenization; the engine thread's to reading the core's messages and handing tokens to the
# streams. So the next steps are in the API process. The first is taken since that profile:
# a plain chunk (text and tokens, no logprobs) is written into an event string preformatted
# once per request (`EventTemplate` in `nanovllm/serve/formats.py`) instead of a pydantic
# model built and dumped per token; `tests/test_serve_events.py` holds both to the same bytes,
# and the cell below times both on this machine. Still to do: detokenization off the event
# loop (vLLM detokenizes in the output handler, in bulk per step) and, beyond that, more than
# one API process in front of one engine core (vLLM's `--api-server-count`). The book records
# the gap rather than hiding it: a server as fast as its engine is not reached yet.

# %%
# NBVAL_IGNORE_OUTPUT
from nanovllm.outputs import StreamChunk
from nanovllm.serve.formats import CompletionFormat

fmt = CompletionFormat("cmpl-demo", "smollm2", logprobs=False, token_ids=False)
stream = [StreamChunk("demo", [i], f" word{i}") for i in range(2000)]
ways = {"preformatted template": fmt.chunk, "pydantic model": fmt.model_chunk}
best = dict.fromkeys(ways, float("inf"))
for _ in range(5):  # interleaved rounds, the best of each: a shared machine's noise is one-sided
    for label, write in ways.items():
        start = time.perf_counter()
        for chunk in stream:
            write(0, chunk, None)
        best[label] = min(best[label], (time.perf_counter() - start) / len(stream))
for label, seconds in best.items():
    print(f"{label:>22}: {seconds * 1e6:5.1f} µs per event")
#
# The same comparison on this project's 2-core CPU, with SmolLM2 (32 requests, 2 clients:
# small enough for a chapter). Two cores are shared by the engine core, the API process, the
# clients and whatever else runs (the record says how loaded the machine was): read it as the
# tool at work on a laptop-sized machine, not as a measurement of the split.

# %%
# NBVAL_IGNORE_OUTPUT
compare_table(load_record("serve_compare_cpu.json"))

# %% [markdown]
# ## Assignments
#
# In the course edition of this book (`make student`; see the README's *Start here*) you write
# this part of the package yourself: the token bucket's refill, which every rate limit of the
# server relies on. The function's docstring is the handout; the project's tests grade your
# code on a fake clock (`make check CHAPTERS=10` in your edition), and once they pass this notebook
# runs on your own server.

# %%
# NBVAL_CHECK_OUTPUT
from nanovllm.course import assignment_table

print(assignment_table("10"))

# %% [markdown]
# ## Exercises
#
# **Exercise 1 — a token bucket.** Write `token_bucket(rate, capacity, clock)`, returning two
# functions `(wait_time, take)` that share one bucket, full at the start: `wait_time(amount)` is
# the seconds until the bucket holds `amount` (capped at `capacity`; 0 means now) and
# `take(amount)` removes `amount` (which may leave it below zero: a debt). `clock()` returns
# seconds. Keep the bucket lazy: refill from the clock inside each call. The check drives it
# with a fake clock and compares against values worked out by hand (all exact in binary).

# %% tags=["exercise"]
def token_bucket(rate: float, capacity: float, clock):
    """A bucket of at most `capacity` tokens refilled at `rate` per second: (wait_time, take)."""
    raise NotImplementedError("exercise 10.token_bucket")


# %% tags=["check", "raises-exception"]
class TestClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


clock = TestClock(50.0)
wait_time, take = token_bucket(rate=2, capacity=4, clock=clock)
assert wait_time(4) == 0, "a new bucket starts full"
assert wait_time(9) == 0, "asking for more than the capacity is capped at the capacity"
take(4)
assert wait_time(1) == 0.5, f"empty, rate 2/s: 1 token in 0.5 s, got {wait_time(1)}"
clock.now += 0.25
assert wait_time(1) == 0.25, "half a token has flowed in after 0.25 s"
assert wait_time(1) == 0.25, "asking twice at the same instant changes nothing"
clock.now += 100
assert wait_time(4) == 0, "an idle bucket refills..."
take(4)
assert wait_time(1) == 0.5, "...but never above its capacity"
clock.now += 100
take(10)  # 6 tokens of debt
assert wait_time(1) == 3.5, f"a debt of 6 plus 1 token at 2/s: 3.5 s, got {wait_time(1)}"
for _ in range(7):  # 7 half-seconds, one at a time: each interval must count exactly once
    clock.now += 0.5
    wait_time(1)
assert wait_time(1) == 0, "after 3.5 s the debt is paid and one token is there"
assert wait_time(2) == 0.5, "exactly one token, no more"
# a burst of 3, then one every 0.5 s, when asked every 0.125 s (worked out by hand)
clock, admitted = TestClock(), []
wait_time, take = token_bucket(rate=2, capacity=3, clock=clock)
for i in range(12):
    clock.now = 0.125 * i
    if wait_time(1) == 0:
        take(1)
        admitted.append(clock.now)
assert admitted == [0.0, 0.125, 0.25, 0.5, 1.0], f"a burst of 3, then 0.5 and 1.0: {admitted}"
print("Exercise 1 passed: burst, rate, cap and debt behave as a token bucket")

# %% [markdown]
# **Exercise 2 — what should `Retry-After` say?** A key has two buckets: requests
# (`req_rate` per second, capacity `req_burst`) and tokens per minute (`tpm`, refilled evenly,
# capacity `tpm`). Write `retry_after(req_level, tok_level, prompt_tokens, req_rate, req_burst,
# tpm)`: the seconds until a request of `prompt_tokens` tokens can enter, given both buckets'
# current levels (0 if it can enter now; the token need is capped at `tpm`, as the server's
# bucket caps it). Both buckets must hold enough, so the answer is the *larger* of the two
# waits. The check uses hand-worked cases and properties on seeded random inputs.

# %% tags=["exercise"]
def retry_after(req_level, tok_level, prompt_tokens, req_rate, req_burst, tpm):
    """Seconds until both buckets allow one request of `prompt_tokens` tokens; 0 means now."""
    raise NotImplementedError("exercise 10.retry_after")


# %% tags=["check", "raises-exception"]
import math
import random

assert retry_after(2, 1000, 100, 1, 3, 6000) == 0, "both buckets hold enough: enter now"
assert math.isclose(retry_after(0, 1000, 100, 2, 3, 6000), 0.5), "no request token, rate 2/s"
assert math.isclose(retry_after(1, 0, 100, 1, 3, 6000), 1.0), "100 tokens at 100 tokens/s"
assert math.isclose(retry_after(-1, 0, 100, 1, 3, 600), 10.0), "tokens: 100 at 10/s = 10 s"
assert math.isclose(retry_after(0, -300, 9999, 1, 3, 600), 90.0), "need capped at 600 (+300 debt)"
rng = random.Random(10)
for _ in range(200):
    args = (rng.uniform(-3, 3), rng.uniform(-500, 600), rng.randint(1, 900),
            rng.uniform(0.1, 5), rng.randint(1, 5), rng.choice([60, 600, 6000]))
    wait = retry_after(*args)
    req_level, tok_level, prompt, rate, burst, tpm = args
    assert wait >= 0
    # after `wait` seconds both buckets hold enough (the levels grow linearly)...
    assert req_level + wait * rate >= 1 - 1e-9
    assert tok_level + wait * tpm / 60 >= min(prompt, tpm) - 1e-6
    # ...and a moment earlier at least one does not (the wait is the smallest that works)
    if wait > 1e-6:
        early = wait - 1e-4
        assert req_level + early * rate < 1 or tok_level + early * tpm / 60 < min(prompt, tpm)
print("Exercise 2 passed: the wait is exactly when both buckets first hold enough")

# %% [markdown]
# ## Analysis questions
#
# Predict, then measure. For each question below, write a number and your reasoning in
# `analysis/10.json` *before* measuring; then `make analysis CH=10 MEASURE=1` measures it
# with your own code and fills in `measured`. The grader measures again on your code and
# checks that the numbers agree (a point each, beside the assignment points); how close your
# prediction came is not graded: it is for your writeup and the discussion.

# %%
from nanovllm.course import analysis

analysis.ask("10")

# %% [markdown]
# ## Summary
#
# - A server runs the engine loop on its own thread and the network on an asyncio event loop;
#   `AsyncEngine` connects them as producer/consumer: `submit` puts requests in an inbox, the
#   engine thread steps and hands each request's new tokens to its stream, and the scheduler
#   of chapter 06 batches whatever arrived by the next step boundary.
# - Streaming over HTTP is server-sent events: `data: {json}` lines on one response, ending with
#   `data: [DONE]`. We read them from a raw socket and got the same text as `LLM.generate`.
# - `nanovllm serve` speaks OpenAI's API: the official client works unchanged (completion,
#   stream, errors in OpenAI's shape with OpenAI's status codes).
# - Token buckets give each key a burst and an average rate, lazily refilled, with an exact
#   `Retry-After`; the queue-depth gate protects the server itself.
# - Key classes carry priorities: under load, the priority policy keeps interactive latency
#   near its own generation time while FCFS makes it wait for the whole backlog.
# - The Poisson load generator measures TTFT, TPOT and goodput against the offered rate; the
#   knee of that curve is what one replica can promise. On one H200 our server's knee is set
#   by its single Python process, not by the GPU. Replicas scale the rate; tensor parallelism
#   fits larger models and, measured on two H200s, raised workload throughput (section 7's ratios)
#   without shortening a decode step.

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(saved_threads)
shutil.rmtree(TINY, ignore_errors=True)
print(f"chapter ran in {time.perf_counter() - chapter_start:.0f} s; server threads left: "
      f"{sum(t.name == 'nanovllm-server' and t.is_alive() for t in threading.enumerate())}")

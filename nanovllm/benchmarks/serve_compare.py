"""The server against its own engine: offline ``LLM.generate`` and ``nanovllm serve`` with the
engine core on a thread or in a process of its own, on the same requests, in one sitting
(chapter 10 §8).

    python -m nanovllm.benchmarks.serve_compare nanovllm/configs/qwen3-0.6b \\
        --option load_format=dummy --option gpu_memory_utilization=0.45 \\
        --rates 4 16 64 inf --num-requests 256 --input-len 128 --output-len 64 \\
        --large 1024 128 --clients 4 --json serve_compare.json --figure serve_compare.png

For each engine mode it starts ``python -m nanovllm.serve`` (with ``--in-process-engine`` for
"thread"), warms it up, then sends the requests from ``--clients`` load-generator processes
(``serve.py``'s streamed client, each with an equal share of the requests and of the rate):
streamed at every rate, then all at once as whole (non-streamed) responses, and the
``--large`` set the same two ways. Offline ``LLM.generate`` runs the same prompts first, in
this process, whose GPU memory it gives back before any server starts. Each run records the
CPU seconds of every client (is the load generator the bottleneck?) and, on Linux, of the
server's API process and of its engine-core process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.serve import Record, make_prompts, one_request, summarize


async def one_whole_request(client: httpx.AsyncClient, url: str, body: dict) -> Record:
    """A non-streamed request: only its end-to-end latency and token count are known."""
    record, start = Record(), time.perf_counter()
    try:
        response = await client.post(url, json={**body, "stream": False})
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return record
        record.e2e = time.perf_counter() - start
        record.output_tokens = response.json()["usage"]["completion_tokens"]
        record.ttft, record.ok = record.e2e, True  # (no first token is seen apart)
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"
    return record


async def _send(base_url: str, prompts: list[list[int]], rate: float, output_len: int,
                stream: bool, seed: int, start_at: float) -> list[Record]:
    import random

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30)) as c:
        url = f"{base_url}/v1/completions"
        await asyncio.sleep(max(0.0, start_at - time.time()))  # every client at once
        tasks = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                    "temperature": 0, "stream": stream,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            if not stream:
                body.pop("stream_options")
            send = one_request if stream else one_whole_request
            tasks.append(asyncio.create_task(send(c, url, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def client_main(args: tuple) -> tuple[list[Record], float, float]:
    """One load-generator process's share: (its records, its CPU seconds, when it ended)."""
    cpu = time.process_time()
    records = asyncio.run(_send(*args))
    return records, time.process_time() - cpu, time.time()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return math.nan


def engine_cores(pid: int) -> list[int]:
    """The server's engine-core process (multiprocessing's spawned child; not its resource
    tracker), if it has one: Linux /proc."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    except OSError:
        return []


def run_load(pool, base_url: str, prompts: list[list[int]], rate: float, output_len: int,
             stream: bool, server: subprocess.Popen, seed: int) -> dict:
    """One measured run from ``pool``'s clients; the summary with CPU seconds."""
    k = pool._processes
    shares = [prompts[i::k] for i in range(k)]
    start_at = time.time() + 0.5
    pids = {"api_process": server.pid}
    cores = engine_cores(server.pid)  # (none when the engine steps on a thread)
    if cores:
        pids["engine_core"] = cores[0]
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    results = pool.map(client_main, [(base_url, share, rate / k, output_len, stream, seed + i,
                                      start_at) for i, share in enumerate(shares)])
    duration = max(end for _, _, end in results) - start_at
    records = [r for recs, _, _ in results for r in recs]
    summary = summarize(records, duration, rate, math.inf, math.inf)
    summary.pop("slo"), summary.pop("goodput_rps")
    summary["stream"] = stream
    if not stream:  # only the whole answer's arrival is seen
        for key in ("ttft", "tpot", "itl"):
            summary.pop(key)
    summary["num_requests"] = len(prompts)
    summary["client_cpu_s"] = [cpu for _, cpu, _ in results]
    summary["server_cpu_s"] = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, options: list[str], mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm.serve", model, "--port", str(port),
           "--log-level", "warning", "--max-queue-depth", "100000"]
    cmd += [a for o in options for a in ("--option", o)]
    if mode == "thread":
        cmd.append("--in-process-engine")
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server ({mode}) did not start")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.5)


def offline(model: str, options: list[str], sets: list[tuple]) -> dict:
    """``LLM.generate`` on each set's prompts (after a warm-up), then the GPU given back."""
    import yaml

    from nanovllm import LLM, SamplingParams

    kwargs = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in options)}
    report = {}
    with LLM(model, **kwargs) as llm:
        for name, prompts, output_len in sets:
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            llm.generate(prompts[:16], params, use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            duration = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            report[name] = {"num_requests": len(prompts), "duration_s": duration,
                            "output_tokens": tokens, "output_throughput_tps": tokens / duration}
            print(f"offline {name}: {tokens / duration:.0f} tok/s", flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m nanovllm.benchmarks.serve_compare",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--modes", nargs="+", default=["thread", "process"],
                   choices=["thread", "process"])
    p.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, 64.0, math.inf])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--large", nargs=2, type=int, metavar=("N", "OUTPUT_LEN"),
                   help="a second set, all at once: N requests of OUTPUT_LEN tokens")
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--json")
    p.add_argument("--figure")
    args = p.parse_args(argv)
    sets = [("small", make_prompts(args.num_requests, args.input_len, 0), args.output_len)]
    if args.large:
        sets.append(("large", make_prompts(args.large[0], args.input_len, 1), args.large[1]))
    report = {**run_metadata("nanovllm.benchmarks.serve_compare", argv),
              "config": {k: v for k, v in vars(args).items() if k not in ("json", "figure")},
              "offline": {}, "servers": {}}
    report["config"]["rates"] = [r if math.isfinite(r) else "inf" for r in args.rates]
    report["offline"] = offline(args.model, args.option, sets)
    save = (lambda: Path(args.json).write_text(json.dumps(report, indent=1))) if args.json \
        else (lambda: None)  # after every run: a cut-short sitting keeps what it measured
    pool = multiprocessing.get_context("spawn").Pool(args.clients)
    try:
        for mode in args.modes:
            server, url = start_server(args.model, args.option, mode)
            runs = report["servers"][mode] = []
            try:
                run_load(pool, url, sets[0][1][:32], math.inf, 8, True, server, 99)  # warm-up
                plan = [(sets[0], rate, True) for rate in args.rates]
                plan += [(s, math.inf, stream) for s in sets for stream in (False, True)
                         if not (s is sets[0] and stream and math.inf in args.rates)]
                for (name, prompts, out_len), rate, stream in plan:
                    run = run_load(pool, url, prompts, rate, out_len, stream, server, len(runs))
                    run["set"] = name
                    runs.append(run)
                    save()
                    print(f"{mode} {name} rate {run['rate']} {'stream' if stream else 'whole'}: "
                          f"{run['completed']}/{len(prompts)} ok, "
                          f"{run['output_throughput_tps']:.0f} tok/s, TPOT p50 "
                          f"{1e3 * run.get('tpot', {}).get('p50', math.nan):.1f} ms, TTFT p99 "
                          f"{1e3 * run.get('ttft', {}).get('p99', math.nan):.0f} ms, "
                          f"CPU s {run['server_cpu_s']}", flush=True)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(120)
    finally:
        pool.terminate()
    save()
    if args.figure:
        plot(report).savefig(args.figure)
    return report


def plot(report: dict):
    """Output tok/s and TPOT p50 against request rate, one line per engine mode, with the
    offline rate as a ceiling (Figure 10.4)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rates = report["config"]["rates"]
    xs = range(len(rates))
    for mode, runs in report["servers"].items():
        streamed = {r["rate"]: r for r in runs if r["set"] == "small" and r["stream"]}
        label = {"thread": "engine on a thread (one process)",
                 "process": "engine-core process (two processes)"}[mode]
        left.plot(xs, [streamed[r]["output_throughput_tps"] for r in rates], "o-", label=label)
        right.plot(xs, [1e3 * streamed[r]["tpot"]["p50"] for r in rates], "o-", label=label)
    left.axhline(report["offline"]["small"]["output_throughput_tps"], color="gray", ls="--",
                 label="offline LLM.generate, same requests")
    for ax, title in ((left, "output tok/s (streamed)"), (right, "TPOT p50 (ms)")):
        ax.set_xticks(list(xs), [str(r) for r in rates])
        ax.set_xlabel("requests per second")
        ax.set_title(title)
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()

"""A load generator for the OpenAI-compatible server: latency percentiles at given request
rates (chapter 10).

    python -m nanovllm.benchmarks.serve --base-url http://127.0.0.1:8000 \\
        --rates 1 4 16 inf --num-requests 200 --input-len 128 --output-len 64 \\
        --slo-ttft 0.5 --slo-tpot 0.05 --json load.json --figure load.png
    python -m nanovllm.benchmarks.serve --launch nanovllm/configs/qwen3-0.6b \\
        --option load_format=dummy ...          # start a server in this process first

At each rate, requests arrive as a Poisson process (exponential gaps; ``inf`` sends them all
at once). Each is a streamed ``/v1/completions`` request of ``input-len`` random token ids
with exactly ``output-len`` tokens (``ignore_eos``), so any model -- random weights
included -- gives the same work. Per request it measures TTFT (time to the first token),
TPOT (mean time per token after the first), ITL (every gap between token-bearing chunks)
and end-to-end latency; per rate it reports their mean, p50, p90 and p99, throughput in
requests and output tokens per second, and goodput: requests per second that met the SLO
(TTFT <= slo-ttft and TPOT <= slo-tpot; DistServe's definition). ``--launch`` shares this
process (and its GIL) with the server: fine on a GPU, but for a CPU measurement start
``nanovllm serve`` separately and point ``--base-url`` at it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import time
from dataclasses import dataclass, field

import httpx

from nanovllm.benchmarks.metadata import run_metadata


@dataclass
class Record:
    """One request's timeline (seconds since it was sent)."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_prompts(n: int, input_len: int, seed: int, vocab: int = 10_000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Record:
    record, start = Record(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = event["error"]["message"]
                    return record
                usage = event.get("usage") or {}
                tokens = usage.get("completion_tokens", record.output_tokens)
                now = time.perf_counter() - start
                if tokens > record.output_tokens:  # a chunk that brought tokens
                    if record.ttft is None:
                        record.ttft = now
                    else:
                        record.itl.append(now - last)
                    last, record.output_tokens = now, tokens
        record.e2e = time.perf_counter() - start
        record.ok = record.ttft is not None
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"
    return record


async def run_rate(base_url: str, model: str | None, prompts: list[list[int]], rate: float,
                   output_len: int, seed: int, api_key: str | None = None,
                   ) -> tuple[list[Record], float]:
    """Send every prompt at Poisson arrivals of ``rate`` per second; (records, duration)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        url = f"{base_url.rstrip('/')}/v1/completions"
        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            if model is not None:
                body["model"] = model
            tasks.append(asyncio.create_task(one_request(client, url, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"count": len(ordered), "mean": sum(ordered) / len(ordered),
            "p50": at(50), "p90": at(90), "p99": at(99)}


def summarize(records: list[Record], duration: float, rate: float, slo_ttft: float,
              slo_tpot: float) -> dict:
    done = [r for r in records if r.ok]
    good = [r for r in done if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    tokens = sum(r.output_tokens for r in done)
    return {
        "rate": rate if math.isfinite(rate) else "inf",
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "request_throughput_rps": len(done) / duration,
        "output_throughput_tps": tokens / duration,
        "goodput_rps": len(good) / duration,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "ttft": percentiles([r.ttft for r in done]),
        "tpot": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl": percentiles([gap for r in done for gap in r.itl]),
        "e2e": percentiles([r.e2e for r in done]),
    }


def plot(report: dict, path: str | None = None):
    """Latency percentiles and throughput against the offered rate; saved to ``path`` if
    given. Returns the matplotlib ``Figure`` (drawn without pyplot: no backend is touched)."""
    from matplotlib.figure import Figure

    from nanovllm.viz.style import book_style

    runs = report["runs"]
    labels = [str(r["rate"]) for r in runs]
    with book_style():
        fig = Figure(figsize=(13, 3.6), layout="constrained")
        axes = fig.subplots(1, 3)
        for ax, metric, title in zip(axes, ("ttft", "tpot"), ("TTFT", "TPOT")):
            for q in ("p50", "p90", "p99"):
                ax.plot(labels, [1e3 * r[metric].get(q, float("nan")) for r in runs],
                        marker="o", label=q)
            ax.set(title=title, xlabel="offered rate (requests/s)", ylabel="ms")
            ax.legend()
        ax = axes[2]
        ax.plot(labels, [r["request_throughput_rps"] for r in runs], marker="o",
                label="throughput")
        ax.plot(labels, [r["goodput_rps"] for r in runs], marker="s", label="goodput (SLO met)")
        ax.set(title="requests served", xlabel="offered rate (requests/s)", ylabel="requests/s")
        ax.legend()
        fig.suptitle(f"{report['model'] or 'server'}: {report['config']['num_requests']} "
                     f"requests, {report['config']['input_len']} in / "
                     f"{report['config']['output_len']} out tokens")
        if path is not None:
            fig.savefig(path)
    return fig


def launch(model: str, options: list[str]):
    """A server for ``model`` in this process (``--launch``); returns (server, engine)."""
    import yaml

    from nanovllm.engine.async_engine import AsyncEngine
    from nanovllm.serve import ServeConfig, ServerThread, build_app

    engine_options = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in options)}
    engine = AsyncEngine.from_model(model, **engine_options)
    config = ServeConfig(model=model, engine=engine_options)
    return ServerThread(build_app(engine, config)).start(), engine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanovllm.benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="MODEL", help="start a server for MODEL here")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineConfig field for --launch (repeatable)")
    p.add_argument("--model", help="the model name to send (default: the server's)")
    p.add_argument("--api-key")
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0, math.inf],
                   help="requests per second; inf: all at once")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--figure", help="plot the report here (needs matplotlib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    server = engine = None
    device = None
    if args.launch:
        server, engine = launch(args.launch, args.option)
        device = engine.engine.config.device
        if device.startswith("cuda"):
            import torch

            device = f"{device} ({torch.cuda.get_device_name(device)})"
    base_url = server.url if server else args.base_url
    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    runs = []
    try:
        for i, rate in enumerate(args.rates):
            records, duration = asyncio.run(run_rate(base_url, args.model, prompts, rate,
                                                     args.output_len, args.seed + i, args.api_key))
            runs.append(summarize(records, duration, rate, args.slo_ttft, args.slo_tpot))
            r = runs[-1]
            print(f"rate {r['rate']}: {r['completed']}/{len(records)} ok, "
                  f"{r['request_throughput_rps']:.2f} req/s, {r['output_throughput_tps']:.0f} "
                  f"tok/s, goodput {r['goodput_rps']:.2f} req/s, TTFT p50 "
                  f"{1e3 * r['ttft'].get('p50', math.nan):.0f} ms, TPOT p50 "
                  f"{1e3 * r['tpot'].get('p50', math.nan):.1f} ms", flush=True)
    finally:
        if server is not None:
            server.stop()
            engine.shutdown(wait=False)
    report = {
        **run_metadata("nanovllm.benchmarks.serve", argv,
                       device_label=device or "see the server"),
        "client_host": platform.node(),
        "base_url": base_url if not args.launch else f"launched: {args.launch}",
        "model": args.model or args.launch,
        "config": {k: vars(args)[k] for k in ("num_requests", "input_len", "output_len",
                                              "seed", "option")},
        "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.figure:
        plot(report, args.figure)
    return report


if __name__ == "__main__":
    main()

"""Latency beside throughput: requests let in over time or a few at a time, and the
percentiles of their time to first token and time per output token (chapters 06, 10, 11).

``LLM.generate`` hands the engine every request at once: right for throughput, but then a
request's time to first token is mostly its wait behind the others. ``drive`` instead runs a
workload through the engine's own step loop (``LLMEngine.add_sequence`` and ``step``, as
``LLM.generate`` does, in this process: no server, no network), letting a request in

- when its arrival time has passed (``Workload.arrival_times``: the ``arrivals`` workload, or
  any workload with ``--request-rate``): an open loop, as clients that do not wait for each
  other. A request's clock starts at its nominal arrival, so the end of the step that was
  running when it arrived counts in its TTFT, as it would for a real client;
- with ``concurrency=N``, as soon as fewer than N requests are unfinished: a closed loop, as N
  clients that each send their next request when the previous answer is complete.

``latency_stats`` turns the requests' ``RequestMetrics`` (``nanovllm/outputs.py``) into the
mean, p50, p90 and p99 of TTFT, TPOT, end-to-end latency and queue time (with
``engine/metrics.latency_summary``); ``sweep_concurrency`` measures output tok/s and those at
several concurrencies (``--concurrency 1 8 64`` of ``python -m nanovllm.benchmarks.throughput``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nanovllm import LLM
from nanovllm.benchmarks.timing import stopwatch
from nanovllm.benchmarks.workload import Workload, request_params, warm_up
from nanovllm.engine.metrics import latency_summary
from nanovllm.engine.output_processor import RequestState
from nanovllm.outputs import RequestMetrics, RequestOutput

# Short names in the recorded JSON for latency_summary's figures (all in seconds).
FIGURES = {
    "ttft_s": "time_to_first_token",
    "tpot_s": "time_per_output_token",
    "e2e_s": "e2e_latency",
    "queue_s": "queue_time",
}
# Requests per sweep level: WAVES times the concurrency (each slot serves several requests in
# turn, so most requests start while others run), at least MIN_LEVEL_REQUESTS.
WAVES, MIN_LEVEL_REQUESTS = 4, 16


@dataclass
class Run:
    seconds: float  # from the first request's arrival to the last one's end
    outputs: list[RequestOutput]  # in the workload's order
    peak_concurrency: int  # most unfinished requests in the engine at once


def drive(
    llm: LLM, work: Workload, sampling: dict | None = None, concurrency: int | None = None
) -> Run:
    """Run ``work`` through ``llm``'s engine, each request let in at its arrival time (if the
    workload has them) and only while fewer than ``concurrency`` are unfinished (if given).
    No warm-up here: call ``workload.warm_up`` first."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    engine, arrivals = llm.engine, work.arrival_times
    # Validate every request before the clock starts (as LLM.generate does).
    params = request_params(work, sampling)
    seqs = [engine.make_sequence(p, sp) for p, sp in zip(work.prompts, params)]
    pending, states, unfinished, peak = deque(seqs), {}, 0, 0
    try:
        with stopwatch(llm.config.device) as watch:
            start = time.perf_counter()
            due = [start + t for t in arrivals] if arrivals is not None else None
            while pending or unfinished:
                now = time.perf_counter()
                while (pending and (due is None or due[len(states)] <= now)
                       and (concurrency is None or unfinished < concurrency)):
                    seq = pending.popleft()
                    # Its clock starts when its client sent it, not when this loop noticed.
                    seq.metrics.arrival_time = now if due is None else due[len(states)]
                    engine.add_sequence(seq)  # (claims its id)
                    states[seq.parent_id] = RequestState(seq, llm.tokenizer)
                    unfinished += 1
                    peak = max(peak, len(engine.requests))  # the engine's own count
                if not unfinished:  # idle until the next arrival
                    time.sleep(max(0.0, due[len(states)] - time.perf_counter()))
                    continue
                for out in engine.step():
                    state = states.get(out.request_id)
                    if state is None:
                        continue  # another caller's request
                    state.update(out)
                    if out.finished and state.finished:
                        unfinished -= 1
    except BaseException:  # Ctrl-C included: leave none of these requests in the engine
        engine.abort_request(list(states))
        raise
    outputs = [state.output() for state in states.values()]  # in the workload's order
    if any(o.error for o in outputs):
        raise RuntimeError(f"a request failed: {next(o.error for o in outputs if o.error)}")
    assert sum(len(o.token_ids) for o in outputs) == work.output_tokens
    return Run(watch.seconds, outputs, peak)


def latency_stats(metrics: Iterable[RequestMetrics]) -> dict[str, dict[str, float]]:
    """``{"ttft_s", "tpot_s", "e2e_s", "queue_s"}``, each ``{count, mean, p50, p90, p99}``
    in seconds (``{"count": 0}`` where no request defines it)."""
    summary = latency_summary(metrics, percentiles=(50, 90, 99))
    return {short: summary[name] for short, name in FIGURES.items()}


def prefix_cache_stats(outputs: Sequence[RequestOutput]) -> dict[str, float]:
    """Prompt tokens, those found in the prefix cache at admission (the engine's
    ``RequestMetrics.num_cached_prompt_tokens``, chapter 04) and their fraction."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.metrics.num_cached_prompt_tokens for o in outputs)
    return {"prompt_tokens": prompt, "cached_prompt_tokens": cached,
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0}


def run_summary(work: Workload, run: Run) -> dict:
    """What a run recorded: output tok/s, peak concurrency, latencies, prefix-cache hits."""
    return {
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "seconds": run.seconds,
        "output_tok_s": work.output_tokens / run.seconds,
        "peak_concurrency": run.peak_concurrency,
        **prefix_cache_stats(run.outputs),
        **latency_stats(o.metrics for o in run.outputs),
    }


def level_requests(concurrency: int) -> int:
    """How many requests a sweep level runs (the caller may cap it): ``WAVES`` times the
    concurrency, at least ``MIN_LEVEL_REQUESTS``."""
    return max(MIN_LEVEL_REQUESTS, WAVES * concurrency)


def sweep_concurrency(
    llm: LLM, levels: Iterable[tuple[int, Workload]], sampling: dict | None = None
) -> list[dict]:
    """One closed-loop run per ``(concurrency, requests)`` level: ``run_summary`` and its
    ``concurrency``. Give each level its own requests (another seed): those an earlier run
    computed would be found in the prefix cache (blocks stay cached after their request
    ends), and their prefill skipped. Arrival times are ignored: a request enters when a
    slot frees."""
    warm_up(llm, sampling)
    rows = []
    for level, work in levels:
        work = dataclasses.replace(work, arrival_times=None)
        run = drive(llm, work, sampling, concurrency=level)
        rows.append({"concurrency": level, **run_summary(work, run)})
    return rows


def brief(row: dict) -> str:
    """One line of a run's numbers for the terminal (the JSON holds them all)."""
    ms = lambda fig: "/".join(f"{1e3 * row[fig][q]:.3g}" for q in ("p50", "p90", "p99"))  # noqa: E731
    figures = ", ".join(f"{fig[:-2]} {ms(fig)} ms" for fig in ("ttft_s", "tpot_s")
                        if row[fig]["count"])
    return f"{row['output_tok_s']:.4g} tok/s, p50/p90/p99 {figures}"

"""``python -m nanovllm.benchmarks.profiling``: where the time of a decode step goes (chapter 11).

Runs the benchmark workload until every request is decoding, then records a few engine steps
with ``torch.profiler``: what the CPU does (schedule, prepare and launch, wait for the
tokens, apply them: ``Scheduler.update_from_output``) and when the GPU is busy. It prints,
per mode (async scheduling off and on), the wall time per step, the fraction of it the GPU
spends computing, kernels per step and the most expensive kernels, and can save the spans
for the chapter's timeline figure. The engine is not modified: its methods are wrapped in
profiler ranges from outside. """

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.workload import free, make_workload
from nanovllm.configs import config_path

CPU_PHASES = {  # (object path, method) -> label in the timeline
    ("scheduler", "schedule"): "schedule",
    ("runner", "launch"): "launch",
    ("runner", "prepare"): "prepare",  # inside launch
    ("runner", "collect"): "wait for tokens",
    ("scheduler", "update_from_output"): "apply tokens",
}


def _instrument(engine) -> None:
    for (owner, method), label in CPU_PHASES.items():
        obj = engine if owner is None else getattr(engine, owner)
        original = getattr(obj, method)

        @functools.wraps(original)
        def wrapped(*args, _original=original, _label=label, **kwargs):
            with record_function(_label):
                return _original(*args, **kwargs)

        setattr(obj, method, wrapped)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint sorted intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _add_workload(engine, num_requests: int) -> None:
    work = make_workload("nano-vllm", num_requests)
    for prompt, n in zip(work.prompts, work.output_lens):
        engine.add_request(
            None, prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
        )


def _prefill_all(engine) -> None:
    """Step until every request has its prompt computed."""
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()


def profile_decode_steps(
    model: str, num_requests: int, steps: int, async_scheduling: bool, warm_steps: int = 20,
    prefill: bool = False,
) -> dict:
    """Profile ``steps`` decode steps, or with ``prefill`` the workload's first ``steps``
    steps (prompt chunks), after one untimed pass over every prompt (compiles, allocations)."""
    llm = LLM(
        str(config_path(model)),
        load_format="dummy",
        gpu_memory_utilization=0.5,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    _add_workload(engine, num_requests)
    _prefill_all(engine)
    if prefill:  # the same prompts again, computed afresh
        engine.abort_request([s.parent_id for s in engine.requests.values()])
        llm.reset_prefix_cache()
        _add_workload(engine, num_requests)
    else:
        for _ in range(warm_steps):
            engine.step()
    _instrument(engine)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    batch = len(engine.scheduler.running)
    free(llm)

    events = prof.events()
    labels = set(CPU_PHASES.values())
    # A profiler range also shows up on the GPU's timeline (as an annotation): not a kernel.
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in labels]
    phases = [e for e in events if e.device_type == DeviceType.CPU and e.name in labels]
    cpu_ms = {
        label: sum(e.time_range.elapsed_us() for e in phases if e.name == label) / steps / 1e3
        for label in CPU_PHASES.values()
    }
    cpu_ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    t0 = min(e.time_range.start for e in phases)
    t1 = max(e.time_range.end for e in kernels + phases)
    wall_us = t1 - t0
    busy = _merge([(e.time_range.start, e.time_range.end) for e in kernels])
    busy_us = sum(end - start for start, end in busy)
    per_kernel: dict[str, float] = {}
    for e in kernels:
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    spans = [("CPU", e.name, e.time_range.start, e.time_range.end) for e in phases]
    spans += [("GPU", "busy", start, end) for start, end in busy]
    return {
        "async_scheduling": async_scheduling,
        "batch": batch,
        "steps": steps,
        "ms_per_step": wall_us / steps / 1e3,
        "gpu_busy_fraction": busy_us / wall_us,
        "kernels_per_step": len(kernels) / steps,
        "cpu_ms_per_step": cpu_ms,
        "cpu_ops_table": cpu_ops,
        "top_kernels_ms_per_step": [(name[:80], us / steps / 1e3) for name, us in top],
        "spans_ms": [(lane, name, (s - t0) / 1e3, (e - t0) / 1e3) for lane, name, s, e in spans],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first steps (prompt chunks) instead of decode steps")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profiling a decode step needs a CUDA GPU")
    runs = [
        profile_decode_steps(args.model, args.num_requests, args.steps, mode,
                             prefill=args.prefill)
        for mode in (False, True)
    ]
    print(f"{'async':>6} {'batch':>6} {'ms/step':>8} {'GPU busy':>9} {'kernels/step':>13}")
    for r in runs:
        print(
            f"{str(r['async_scheduling']):>6} {r['batch']:>6} {r['ms_per_step']:>8.2f} "
            f"{r['gpu_busy_fraction']:>9.1%} {r['kernels_per_step']:>13.0f}"
        )
    for r in runs:
        print(
            f"async={r['async_scheduling']}: CPU ms/step",
            {k: round(v, 3) for k, v in r["cpu_ms_per_step"].items()},
        )
    for name, ms in runs[-1]["top_kernels_ms_per_step"]:
        print(f"  {ms:7.3f} ms/step  {name}")
    print(runs[-1]["cpu_ops_table"])
    if args.out:
        meta = run_metadata("nanovllm.benchmarks.profiling", argv, "cuda")
        args.out.write_text(json.dumps({**meta, "runs": runs}))


if __name__ == "__main__":
    main()

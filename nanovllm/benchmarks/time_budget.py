"""``python -m nanovllm.benchmarks.time_budget``: where a workload's time goes (chapter 11).

The throughput benchmark gives one number and its distance from the bandwidth bound
(``workload.bandwidth_bound_seconds``). This tool splits that distance into parts:

1. **Cold start.** It runs the workload ``--runs`` times in one fresh process, each run after
   the benchmark's usual warm-up and with the prefix cache reset (else a repeat would find
   every prompt cached), and keeps every run's seconds, the sum of its prefill-step and
   decode-step wall times (``EngineStats``), the Triton kernels it compiled (a kernel is
   compiled on its first call with new constant arguments; chapter 05) and the engine's
   construction time. The first run pays what the warm-up did not compile or allocate; a
   repeat run does not.
2. **The GPU's time.** One more run under ``torch.profiler`` sums the device time of every
   kernel by kind (decode attention, prefill attention, matrix multiplies, the fused
   norm/RoPE/activation/cache-store kernels, sampling, and the rest). Everything runs on one
   stream, so the last unprofiled run's wall time minus the summed kernel time is the time
   the GPU sat idle, waiting for the host.
3. **Ideal times.** The decode-attention kernels must read each sequence's KV cache at every
   decode step, and the decode steps must read the weights: those bytes at the measured copy
   bandwidth are the bound's two parts, to set beside the kernels that move them.

    python -m nanovllm.benchmarks.time_budget --model qwen3-0.6b --runs 3 --out budget.json

It needs a GPU (on a CPU there is no bound and no device timeline).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.throughput import copy_bandwidth
from nanovllm.benchmarks.timing import stopwatch
from nanovllm.benchmarks.workload import (
    bound_bytes,
    make_workload,
    request_params,
    resolve_model,
    warm_up,
)
from nanovllm.configs import SHIPPED

# Kernel kinds, matched in order against each kernel's name (the first match wins).
KERNEL_KINDS = (
    ("decode attention", ("_decode_split_kernel", "_combine_splits_kernel")),
    ("prefill attention", ("_prefill_attention_kernel", "flash_fwd", "FlashAttention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "_int8_gemm_kernel", "splitKreduce")),
    ("norm, RoPE, activation, KV store", (
        "_rmsnorm_kernel", "_qk_norm_rope_kernel", "_silu_mul_kernel", "_store_kv_kernel",
    )),
    ("sampling", ("softmax", "SoftMax", "argmax", "ArgMax", "exponential", "distribution")),
)
OTHER = "other kernels and copies"


def kernel_kind(name: str) -> str:
    """The kind of a device kernel (or copy) by its name; ``OTHER`` if none matches."""
    for kind, patterns in KERNEL_KINDS:
        if any(p in name for p in patterns):
            return kind
    return OTHER


class CompileLog:
    """Records each Triton kernel compiled while it is installed: its name and how long the
    compilation (or the load from Triton's disk cache) took."""

    def __init__(self) -> None:
        self.compiled: list[dict] = []
        self._started: float | None = None

    def _before(self, *, fn, **_) -> bool:
        self._started = time.perf_counter()
        return False  # (True would skip the compilation)

    def _after(self, *, fn, repr, **_) -> None:  # noqa: A002 (Triton's keyword)
        seconds = time.perf_counter() - (self._started or time.perf_counter())
        self.compiled.append({"kernel": fn.name, "seconds": seconds, "signature": repr})

    def __enter__(self) -> CompileLog:
        triton.knobs.runtime.jit_cache_hook = self._before
        triton.knobs.runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_cache_hook = None
        triton.knobs.runtime.jit_post_compile_hook = None


def run_summary(llm: LLM, seconds: float, output_tokens: int) -> dict:
    """One timed run: its seconds and tok/s, and the wall time of its steps by kind."""
    steps = llm.engine.stats.to_records()
    prefill = [s for s in steps if s["num_prefill_tokens"] > 0]
    return {
        "seconds": seconds,
        "tok_s": output_tokens / seconds,
        "steps": len(steps),
        "prefill_steps": len(prefill),
        "prefill_step_seconds": sum(s["end"] - s["start"] for s in prefill),
        "decode_step_seconds": sum(
            s["end"] - s["start"] for s in steps if s["num_prefill_tokens"] == 0
        ),
    }


def device_time_by_kind(llm: LLM, work, params) -> tuple[dict[str, float], float]:
    """Seconds of device time per kernel kind over one run of ``work``, and the run's wall
    seconds under the profiler (longer than unprofiled: tracing costs host time)."""
    llm.engine.stats.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(work.prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA or event.self_device_time_total <= 0:
            continue
        kind = kernel_kind(event.key)
        totals[kind] = totals.get(kind, 0.0) + event.self_device_time_total / 1e6
    return totals, wall


def kv_and_weight_bytes(llm: LLM, work) -> tuple[int, int]:
    """The bound's two byte counts for ``llm``'s model (``workload.bound_bytes``)."""
    runner = llm.engine.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return bound_bytes(work, llm.engine.model_config, weights, runner.kv_dtype.itemsize)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b",
                        help=f"a model folder or a shipped config ({', '.join(SHIPPED)})")
    parser.add_argument("--workload", default="nano-vllm")
    parser.add_argument("--runs", type=int, default=3, help="timed runs in this process")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("time_budget needs a GPU")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    path, load_format = resolve_model(args.model, "cuda")
    work = make_workload(args.workload, None)
    options = {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    start = time.perf_counter()
    llm = LLM(path, load_format=load_format, **options)
    construction = time.perf_counter() - start
    runs, params = [], request_params(work)
    for i in range(args.runs):
        llm.reset_prefix_cache()
        warm_up(llm)  # as the throughput benchmark does before its timed run
        with CompileLog() as log, stopwatch("cuda") as watch:
            llm.generate(work.prompts, params, use_tqdm=False)
        seconds = watch.seconds
        runs.append({**run_summary(llm, seconds, work.output_tokens), "compiled": log.compiled})
        print(f"run {i + 1}: {seconds:.3f} s, {runs[-1]['tok_s']:,.0f} tok/s, "
              f"{len(log.compiled)} kernels compiled", flush=True)
    llm.reset_prefix_cache()
    kinds, profiled_wall = device_time_by_kind(llm, work, params)
    bandwidth = copy_bandwidth("cuda")
    kv_bytes, weight_bytes = kv_and_weight_bytes(llm, work)
    last = runs[-1]["seconds"]
    busy = sum(kinds.values())
    result = {
        **run_metadata("nanovllm.benchmarks.time_budget", argv, "cuda"),
        "model": args.model,
        "workload": args.workload,
        "max_num_batched_tokens": llm.config.max_num_batched_tokens,
        "output_tokens": work.output_tokens,
        "construction_seconds": construction,
        "runs": runs,
        "first_over_last": runs[0]["seconds"] / last,
        "device_seconds_by_kind": kinds,
        "device_busy_seconds": busy,
        "device_idle_seconds": last - busy,  # one stream: the rest of the last run's wall
        "profiled_wall_seconds": profiled_wall,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "ideal_kv_read_seconds": kv_bytes / bandwidth,
        "ideal_weight_read_seconds": weight_bytes / bandwidth,
        "bound_seconds": (kv_bytes + weight_bytes) / bandwidth,
        "fraction_of_bound": (kv_bytes + weight_bytes) / bandwidth / last,
    }
    print(f"{'part':<36}{'seconds':>9}")
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<36}{seconds:>9.3f}")
    print(f"{'GPU idle (last run wall - busy)':<36}{result['device_idle_seconds']:>9.3f}")
    print(f"{'ideal: KV reads at copy bandwidth':<36}{result['ideal_kv_read_seconds']:>9.3f}")
    print(f"{'ideal: weight reads':<36}{result['ideal_weight_read_seconds']:>9.3f}")
    print(f"first run {runs[0]['seconds']:.3f} s, last {last:.3f} s "
          f"({result['first_over_last']:.3f}x); {result['fraction_of_bound']:.1%} of the bound")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

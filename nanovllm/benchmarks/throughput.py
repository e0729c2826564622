"""``python -m nanovllm.benchmarks.throughput`` (alias ``python -m nanovllm.bench``): output
tokens/s of nanovllm against transformers (chapter 11).

The workloads (``nano-vllm`` on a GPU, ``cpu`` on a CPU, or ``--workload long-prompts``,
``shared-prefix``, ``arrivals``) are those of ``workload.py``; ``--length-scale`` shrinks the
last three (CPU tests), ``--request-rate R`` lets any workload's requests arrive as a Poisson
process of R per second (``arrivals``: 16 by default), through the engine's step loop
(``latency.drive``; output tok/s then counts the time spent waiting for arrivals). The engine's
``max_model_len`` grows to the workload's longest request where the default is too short
(``long-prompts``, whose warm-up also runs one request that long). The result holds, beside
tok/s, the TTFT / TPOT / e2e / queue-time percentiles of the requests (``latency``) and the
prompt tokens found in the prefix cache. ``--concurrency 1 8 64`` adds a closed-loop sweep
(``concurrency_sweep``): at most N requests in the engine at once, the next let in when one
finishes, each level with fresh requests of the same workload. ``--attention-backend`` picks
the engine's attention implementation.

``--peer hf`` runs transformers on the same requests in the same process: its continuous
batching on a GPU, its padded batched ``generate`` on a CPU. Its throughput counts only
the requested tokens, not the padding it computes. On a GPU the result also holds the
bandwidth bound (``workload.bandwidth_bound_seconds``) and the fraction of it reached.

``--quantization {int8,fp8}`` and ``--kv-cache-dtype fp8`` run the engine quantized
(chapter 08; recorded in the JSON with the KV capacity in blocks; the peer runs unquantized).

``--logprobs K`` and ``--penalties`` make every nanovllm request also ask for its tokens'
logprobs (top K) or apply repetition/presence/frequency penalties, to measure what those
cost (chapter 11): compare ``nanovllm_tok_s`` with a run without the flag. The peer runs
without them.

``--decode-step`` instead times single engine decode steps (``decode_step.py``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks import decode_step
from nanovllm.benchmarks.hf_peer import run_hf_continuous, run_hf_padded
from nanovllm.benchmarks.latency import (
    brief,
    drive,
    latency_stats,
    level_requests,
    prefix_cache_stats,
    sweep_concurrency,
)
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import time_calls
from nanovllm.benchmarks.workload import (
    DEFAULT_REQUEST_RATE,
    WORKLOADS,
    Workload,
    bandwidth_bound_seconds,
    free,
    make_workload,
    resolve_model,
    run_nanovllm,
    run_workload,
    warm_up,
)
from nanovllm.config import ATTENTION_BACKENDS
from nanovllm.configs import SHIPPED
from nanovllm.engine.llm_engine import MAX_DEFAULT_MODEL_LEN
from nanovllm.layers.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS

# --penalties: what every request then uses (vLLM's names; all three on at once)
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)


def copy_bandwidth(device: str) -> float:
    """Measured device memory bandwidth in bytes/s (bytes read + written by a large copy)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = time_calls(lambda: dst.copy_(src), reps=10, warmup=1, device=device)
    return 2 * src.numel() * src.element_size() / sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nanovllm throughput benchmark")
    parser.add_argument(
        "--model",
        default=None,
        help=f"a model folder or a shipped config ({', '.join(SHIPPED)}) for random weights",
    )
    parser.add_argument("--workload", choices=WORKLOADS, default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="multiply the lengths of long-prompts, shared-prefix, arrivals")
    parser.add_argument("--request-rate", type=float, default=None, metavar="R",
                        help="requests arrive as a Poisson process of R/s (inf: all at once)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="N",
                        help="also sweep: at most N requests in the engine at once (TTFT, TPOT)")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--peer", choices=["hf", "none"], default="none")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="make the CPU wait for each step's tokens before planning the next",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="every nanovllm request also asks for its tokens' logprobs and top K (0..20)",
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="every nanovllm request uses repetition_penalty=1.1, presence_penalty=0.5, "
        "frequency_penalty=0.5",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="quantize the linear layers at load time (chapter 08; default: none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: an e4m3 KV cache (chapter 08)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="run the peer (and nanovllm again) on only the first N requests",
    )
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="instead: time decode steps eager vs CUDA graphs (GPU)",
    )
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    quant = dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.decode_step:
        meta = run_metadata("nanovllm.benchmarks.throughput", argv)
        decode_step.record(args.model or "qwen3-0.6b", args.out, meta, **quant)
        return
    path, load_format = resolve_model(args.model, device)
    name = args.workload or ("nano-vllm" if device == "cuda" else "cpu")
    try:  # bad sizes fail here, before a model loads
        work = make_workload(name, args.num_requests, length_scale=args.length_scale,
                             request_rate=args.request_rate)
        sizes = [min(level_requests(n), args.num_requests or level_requests(n))
                 for n in args.concurrency or ()]
        sweep = [  # each level its own requests (seed 1, 2, ...): see sweep_concurrency
            (n, make_workload(name, size, 1 + i, length_scale=args.length_scale))
            for i, (n, size) in enumerate(zip(args.concurrency or (), sizes))
        ]
    except ValueError as err:
        parser.error(str(err))
    if args.peer == "hf" and work.arrival_times is not None:
        parser.error("--peer hf runs every request at once: not with arrivals")
    options = dict(
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=False if args.no_async_scheduling else None,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **quant,
    )
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    longest = max(w.max_model_len for w in [work] + [w for _, w in sweep])
    if longest > MAX_DEFAULT_MODEL_LEN:  # (long-prompts) beyond the engine's default length
        options["max_model_len"] = longest
    sampling = {} if args.logprobs is None else {"logprobs": args.logprobs}
    if args.penalties:
        sampling.update(PENALTIES)
    try:  # a bad --logprobs fails here, before a model loads
        SamplingParams(**sampling)
    except ValueError as err:
        parser.error(str(err))
    llm = LLM(path, load_format=load_format, **options)
    if name == "long-prompts":  # (its own prompt: the workload's would then be in the cache)
        warm_up(llm, sampling, longest=work.max_model_len)
    if work.arrival_times is None:  # all at once, through LLM.generate
        ours, outs = run_workload(llm, work, sampling)
    else:
        warm_up(llm, sampling)
        run = drive(llm, work, sampling)
        ours, outs = run.seconds, run.outputs
    results = {
        **run_metadata("nanovllm.benchmarks.throughput", argv, device),
        "model": args.model or path,
        "workload": name,
        **({"length_scale": args.length_scale} if args.length_scale != 1 else {}),
        **({"request_rate": rate_label(args.request_rate)} if work.arrival_times else {}),
        "requests": len(work.prompts),
        "output_tokens": work.output_tokens,
        "nanovllm_seconds": ours,
        "nanovllm_tok_s": work.output_tokens / ours,
        "quantization": llm.config.quantization,
        "kv_cache_dtype": llm.config.kv_cache_dtype,
        "num_kv_blocks": llm.engine.runner.num_kv_blocks,
        "attention_backend": llm.engine.runner.backend.name,
        "cuda_graphs": bool(getattr(llm.engine.runner, "graphs", None)),
        "async_scheduling": llm.config.async_scheduling,
        **({"sampling": sampling} if sampling else {}),  # only with --logprobs / --penalties
        "max_model_len": llm.config.max_model_len,
        **llm.engine.stats.summary(),
        **prefix_cache_stats(outs),
        "latency": latency_stats(o.metrics for o in outs),
    }
    if device == "cuda" and work.arrival_times is None:  # (waiting for arrivals: no bound)
        bw = copy_bandwidth(device)
        weight_bytes = sum(
            p.numel() * p.element_size() for p in llm.engine.runner.model.parameters()
        )
        kv_elem = llm.engine.runner.kv_dtype.itemsize  # 1 for an fp8 cache
        bound = bandwidth_bound_seconds(work, llm.engine.model_config, weight_bytes, kv_elem, bw)
        results.update(
            copy_bandwidth_gb_s=bw / 1e9,
            bound_tok_s=work.output_tokens / bound,
            fraction_of_bound=bound / ours,
        )
    if sweep:
        results["concurrency_sweep"] = sweep_concurrency(llm, sweep, sampling)
    free(llm)
    report(results, args.out)
    if args.peer == "hf":
        if args.peer_requests:  # the same subset for both engines, so the ratio is fair
            work = Workload(
                work.prompts[: args.peer_requests], work.output_lens[: args.peer_requests]
            )
            ours, llm = run_nanovllm(path, load_format, work, sampling, **options)
            free(llm)
            results.update(
                subset_requests=len(work.prompts),
                subset_output_tokens=work.output_tokens,
                nanovllm_subset_tok_s=work.output_tokens / ours,
            )
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        runner = run_hf_continuous if device == "cuda" else run_hf_padded
        try:
            theirs = runner(path, load_format, work, dtype, device)
        except Exception as err:  # the peer's API moves between releases: report, don't die
            results.update(hf_method=runner.__name__, hf_error=repr(err))
        else:
            results.update(
                hf_method=runner.__name__,
                hf_seconds=theirs,
                hf_tok_s=work.output_tokens / theirs,
                speedup=theirs / ours,
            )
    report(results, args.out)


def rate_label(rate: float | None) -> float | str:
    """The request rate as recorded (JSON has no infinity)."""
    rate = DEFAULT_REQUEST_RATE if rate is None else rate
    return rate if math.isfinite(rate) else "inf"


def report(results: dict, out: Path | None) -> None:
    """Print the results (and write them as JSON): called after each stage, so a failing
    peer never loses our numbers."""
    if out:
        out.write_text(json.dumps(results, indent=2))
    lines = []
    for k, v in results.items():
        if k == "latency":
            v = brief({"output_tok_s": results["nanovllm_tok_s"], **v})
        elif k == "concurrency_sweep":
            v = "; ".join(f"{row['concurrency']}: {brief(row)}" for row in v)
        lines.append(f"{k:>22}: {v:.4g}" if isinstance(v, float) else f"{k:>22}: {v}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

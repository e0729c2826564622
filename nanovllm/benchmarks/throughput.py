"""``python -m nanovllm.benchmarks.throughput`` (alias ``python -m nanovllm.bench``): output
tokens/s of nanovllm against transformers (chapter 11).

The workloads (``nano-vllm`` on a GPU, ``cpu`` on a CPU) are those of ``workload.py``.
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
from pathlib import Path

import torch

from nanovllm import SamplingParams
from nanovllm.benchmarks import decode_step
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import stopwatch, time_calls
from nanovllm.benchmarks.workload import (
    Workload,
    bandwidth_bound_seconds,
    free,
    make_workload,
    resolve_model,
    run_nanovllm,
)
from nanovllm.configs import SHIPPED
from nanovllm.layers.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS

# --penalties: what every request then uses (vLLM's names; all three on at once)
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)


def _hf_model(path: str, load_format: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_padded(path: str, load_format: str, work: Workload, dtype, device: str) -> float:
    """transformers' batched generate: left-padded prompts, all run to the longest output."""
    model = _hf_model(path, load_format, dtype, device)
    width = max(map(len, work.prompts))
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(work.output_lens)
    with stopwatch(device) as watch:
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=0.6,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
        )
    return watch.seconds


def run_hf_continuous(path: str, load_format: str, work: Workload, dtype, device: str) -> float:
    """transformers' continuous batching (paged attention), one request per prompt. (Not
    under inference_mode: its generation thread updates tensors created here.)"""
    from transformers import GenerationConfig

    model = _hf_model(path, load_format, dtype, device)
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        max_new_tokens=max(work.output_lens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    with (model.continuous_batching_context_manager(generation_config=config) as manager,
          stopwatch(device) as watch):
        for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        generated = 0
        for _ in range(len(work.prompts)):
            result = manager.get_result(timeout=600)
            if result is None or result.error:
                raise RuntimeError(f"transformers' continuous batching failed: {result}")
            generated += len(result.generated_tokens)
    if generated != work.output_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens, not {work.output_tokens}")
    return watch.seconds


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
    parser.add_argument("--workload", choices=["nano-vllm", "cpu"], default=None)
    parser.add_argument("--num-requests", type=int, default=None)
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
    work = make_workload(
        args.workload or ("nano-vllm" if device == "cuda" else "cpu"), args.num_requests
    )
    options = dict(
        enforce_eager=args.enforce_eager,
        async_scheduling=False if args.no_async_scheduling else None,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **quant,
    )
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    sampling = {} if args.logprobs is None else {"logprobs": args.logprobs}
    if args.penalties:
        sampling.update(PENALTIES)
    try:  # a bad --logprobs fails here, before a model loads
        SamplingParams(**sampling)
    except ValueError as err:
        parser.error(str(err))
    ours, llm = run_nanovllm(path, load_format, work, sampling, **options)
    results = {
        **run_metadata("nanovllm.benchmarks.throughput", argv, device),
        "model": args.model or path,
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
        **llm.engine.stats.summary(),
    }
    if device == "cuda":
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


def report(results: dict, out: Path | None) -> None:
    """Print the results (and write them as JSON): called after each stage, so a failing
    peer never loses our numbers."""
    if out:
        out.write_text(json.dumps(results, indent=2))
    print(
        "\n".join(
            f"{k:>22}: {v:.4g}" if isinstance(v, float) else f"{k:>22}: {v}"
            for k, v in results.items()
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

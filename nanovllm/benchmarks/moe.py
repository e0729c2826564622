"""``python -m nanovllm.benchmarks.moe {layer,workload}``: chapter 16's measurements.

``layer``: one MoE layer of a model's shape (default ``qwen3-30b-a3b``: 128 experts, 8 per
token, hidden 2048, expert width 768), random weights, at 1, 16, 64 and 256 tokens per step,
three ways: ``fused`` (the Triton kernel, ``kernels/fused_moe.py``), ``loop`` (one expert at a
time, ``layers/fused_moe.py``'s reference) and ``grouped`` (``torch.nn.functional.grouped_mm``
over the expert-sorted tokens, where this torch has it). Each: seconds per call, the bytes it
must read (the touched experts' weights, the activations in and out), its FLOPs
(``2 * T * k * 3 * H * I``), and the achieved bytes/s and FLOP/s.

``workload``: the nano-vllm workload (``workload.py``) on a MoE shape with random weights:
output tok/s and a bandwidth bound derived for experts. A decode step reads the dense weights
(attention, norms, router, embeddings) once and, in every MoE layer, only the experts its batch
touches: with routing spread uniformly, ``E * (1 - (1 - k/E)^b)`` of them for a batch of ``b``
tokens (at ``b = 256``, ``k = 8``, ``E = 128``: all but ~1e-7 of them; at ``b = 1``: 8). The batch
shrinks as requests finish, so each step's batch is the number of requests still generating;
the KV reads are the dense bound's (``workload.bound_bytes``). Also the load per expert, counted
by hooks on the routers over a prefill of the workload's first 16 prompts (reversed, so that
the prefix cache does not skip them). ``--peer hf`` adds
transformers on the first ``--peer-requests`` requests (and nanovllm again on those).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import time_calls
from nanovllm.benchmarks.workload import (
    Workload,
    bound_bytes,
    free,
    make_workload,
    resolve_model,
    run_workload,
)
from nanovllm.layers.fused_moe import FusedMoE, moe_reference
from nanovllm.layers.router import Router, route
from nanovllm.models import ModelConfig

# torch 2.13 names it; 2.11 has it as a private op.
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def moe_grouped_mm(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The MoE layer through torch's grouped GEMM: tokens sorted by expert, one ``grouped_mm``
    for gate/up and one for down (``offs``: where each expert's rows end), then scattered back."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    gate, up = GROUPED_MM(x[order // top_k], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    down = GROUPED_MM((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
    scaled = down.float() * topk_weights.flatten()[order, None]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // top_k, scaled).to(x.dtype)


def layer_methods(device: str) -> dict:
    """Name -> MoE function: ``fused`` where Triton can launch (CUDA, or the interpreter)."""
    methods = {"loop": moe_reference}
    if GROUPED_MM is not None:
        methods["grouped"] = moe_grouped_mm
    try:
        from nanovllm.kernels import check_launchable
        from nanovllm.kernels.fused_moe import _grouped_gemm_kernel, fused_moe

        check_launchable(torch.empty(0, device=device), _grouped_gemm_kernel)
        methods["fused"] = fused_moe
    except (ImportError, RuntimeError):
        pass
    return methods


def layer_benchmark(num_experts: int, top_k: int, hidden: int, inter: int, tokens: list[int],
                    dtype: torch.dtype, device: str, reps: int = 20, seed: int = 0) -> list[dict]:
    """One row per (tokens, method): seconds (median), bytes, FLOPs and their rates."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device)
           * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device)
          * inter**-0.5).to(dtype)
    elem = w13.element_size()
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device=device).to(dtype)
        weights, ids = route(torch.randn(t, num_experts, generator=gen, device=device), top_k,
                             True)
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * hidden * inter * elem + 2 * t * hidden * elem
        flops = 2 * t * top_k * 3 * hidden * inter
        reference = moe_reference(x, w13, w2, weights, ids).float()
        for name, fn in layer_methods(device).items():
            out = fn(x, w13, w2, weights, ids).float()
            error = float((out - reference).abs().max()) if t else 0.0
            call = functools.partial(fn, x, w13, w2, weights, ids)
            times = time_calls(call, reps, 3, device, events=device == "cuda")
            seconds = statistics.median(times)
            rows.append(dict(tokens=t, method=name, seconds=seconds, experts_touched=touched,
                             bytes=nbytes, flops=flops, bytes_per_s=nbytes / seconds,
                             flops_per_s=flops / seconds, max_abs_diff_vs_loop=error))
    return rows


def moe_bound_bytes(work: Workload, cfg: ModelConfig, dense_bytes: int,
                    expert_bytes: int, elem: int) -> tuple[float, float]:
    """(KV bytes, weight bytes) a run of ``work`` must read: ``expert_bytes`` is one expert's
    weights summed over the MoE layers, ``dense_bytes`` everything else (module docstring)."""
    experts, k = cfg.moe.num_experts, cfg.moe.top_k
    weights = 0.0
    for step in range(max(work.output_lens)):
        batch = sum(n > step for n in work.output_lens)
        touched = experts * (1 - (1 - k / experts) ** batch)
        weights += dense_bytes + touched * expert_bytes
    return bound_bytes(work, cfg, 0, elem)[0], weights


def expert_load(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Assignments per expert in each MoE layer over a prefill of ``prompts`` (eager steps:
    hooks on the routers see them; CUDA-graph replays would not)."""
    routers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Router)]
    counts = [torch.zeros(r.weight.shape[0], dtype=torch.int64) for r in routers]

    def hook(layer: int):
        def count(_module, _args, output):
            ids = output[1].flatten().cpu()
            counts[layer] += torch.bincount(ids, minlength=len(counts[layer]))
        return count

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return [c.tolist() for c in counts]


def load_summary(load: list[list[int]]) -> dict:
    """How uneven the load is: per layer the busiest expert's share over the mean's."""
    ratios = [max(c) / (sum(c) / len(c)) for c in load if sum(c)]
    return dict(max_over_mean_per_layer=ratios, max_over_mean=statistics.mean(ratios),
                idle_experts_per_layer=[sum(n == 0 for n in c) for c in load])


def weight_split(model: torch.nn.Module) -> tuple[int, int]:
    """(dense bytes, one expert's bytes summed over the MoE layers)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    experts = sum(p.numel() * p.element_size() for m in moe for p in m.parameters())
    per_expert = sum((m.w13.weight[0].numel() + m.w2.weight[0].numel())
                     * m.w13.weight.element_size() for m in moe)
    return total - experts, per_expert


def workload_benchmark(path: str, load_format: str, work: Workload, **options) -> dict:
    llm = LLM(path, load_format=load_format, **options)
    seconds, _ = run_workload(llm, work)
    cfg, device = llm.engine.model_config, llm.config.device
    dense, per_expert = weight_split(llm.engine.runner.model)
    result = dict(
        model=Path(path).name, requests=len(work.prompts), output_tokens=work.output_tokens,
        seconds=seconds, tok_s=work.output_tokens / seconds, dense_weight_bytes=dense,
        expert_weight_bytes=per_expert * cfg.moe.num_experts,
        num_experts=cfg.moe.num_experts, top_k=cfg.moe.top_k,
        **llm.engine.stats.summary(),
    )
    # Reversed: the prefix cache holds the prompts themselves since the timed run.
    load = expert_load(llm, [p[::-1] for p in work.prompts[:16]])
    result.update(expert_load=load, **load_summary(load))
    if torch.device(device).type == "cuda":
        from nanovllm.benchmarks.throughput import copy_bandwidth

        bw = copy_bandwidth(device)
        kv, weights = moe_bound_bytes(work, cfg, dense, per_expert,
                                      llm.engine.runner.kv_dtype.itemsize)
        bound = (kv + weights) / bw
        result.update(copy_bandwidth_gb_s=bw / 1e9, bound_seconds=bound,
                      bound_tok_s=work.output_tokens / bound, fraction_of_bound=bound / seconds)
    free(llm)
    return result


def peer_run(path: str, load_format: str, work: Workload, n: int, **options) -> dict:
    """transformers and nanovllm on the first ``n`` requests, one after the other."""
    from nanovllm.benchmarks.hf_peer import run_hf_continuous, run_hf_padded

    subset = Workload(work.prompts[:n], work.output_lens[:n])
    llm = LLM(path, load_format=load_format, **options)
    ours, _ = run_workload(llm, subset)
    device, dtype = llm.config.device, getattr(torch, llm.config.dtype)
    free(llm)
    runner = run_hf_continuous if torch.device(device).type == "cuda" else run_hf_padded
    peer = dict(requests=n, nanovllm_tok_s=subset.output_tokens / ours, hf_method=runner.__name__)
    try:
        theirs = runner(path, load_format, subset, dtype, device)
        peer.update(hf_tok_s=subset.output_tokens / theirs, speedup=theirs / ours)
    except Exception as err:  # the peer's API moves between releases: report, don't die
        peer["hf_error"] = repr(err)
    return peer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=["layer", "workload"])
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help="a shipped config (random weights) or a model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--workload", default=None, help="default: nano-vllm (GPU), cpu (CPU)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--peer", choices=["hf", "none"], default="none")
    parser.add_argument("--peer-requests", type=int, default=32)
    parser.add_argument("--dummy", action="store_true", help="random weights for a folder too")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    path, load_format = resolve_model(args.model, args.device)
    load_format = "dummy" if args.dummy else load_format
    cfg = ModelConfig.from_pretrained(path)
    if cfg.moe is None:
        parser.error(f"{args.model} has no experts")
    record = {**run_metadata("nanovllm.benchmarks.moe", argv, args.device),
              "section": args.section, "model": args.model}
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.section == "layer":
        shape = dict(num_experts=cfg.moe.num_experts, top_k=cfg.moe.top_k,
                     hidden=cfg.hidden_size, inter=cfg.moe.intermediate_size)
        record.update(shape=shape, dtype=str(dtype).removeprefix("torch."), rows=layer_benchmark(
            **shape, tokens=args.tokens, dtype=dtype, device=args.device, reps=args.reps))
    else:
        name = args.workload or ("nano-vllm" if args.device == "cuda" else "cpu")
        work = make_workload(name, args.num_requests)
        record["workload"] = name
        record.update(workload_benchmark(path, load_format, work, device=args.device))
        if args.peer == "hf":
            save(record, args.out)  # a peer that never finishes loses none of our numbers
            record["peer"] = peer_run(path, load_format, work, args.peer_requests,
                                      device=args.device)
    save(record, args.out)
    return record


def save(record: dict, out: Path | None) -> None:
    text = json.dumps(record, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text if len(text) < 4000 else text[:4000] + " ...")


if __name__ == "__main__":
    main()

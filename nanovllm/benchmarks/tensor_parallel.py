"""Tensor parallelism measured: parity, all-reduce cost, decode steps, throughput (chapter 09).

    python -m nanovllm.benchmarks.tensor_parallel --sizes 1 2 --out tp.json
    python -m nanovllm.benchmarks.tensor_parallel --sections allreduce --sizes 2 4 8

Sections (``--sections``, default all):

- ``parity``: the first ``--models`` shape in float32 with random weights, CUDA graphs on
  (GPU): greedy tokens and the top-5 logprobs of every generated token at each size
  against the first size;
- ``allreduce``: ``torch.distributed.all_reduce`` of bf16 messages from 2 KB to 256 MB
  (CPU: float32, gloo, to 4 MB), eager and (GPU) replayed from a CUDA graph: latency and
  bus bandwidth, ``2 (n-1)/n * bytes / time`` (NCCL's definition);
- ``decode``: one engine decode step at batch 1 and 64 (CPU: 8) with a context of 1024,
  eager and with CUDA graphs, then the ``--workload`` (``workload.py``: output tokens
  per second), for each ``--models`` shape and size.

Every result goes to one JSON file with the device, date and command. NCCL runs with
NVLink multicast off (``NCCL_NVLS_ENABLE=0``), as on the machines this was written for.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import time_calls
from nanovllm.benchmarks.workload import free, make_workload, time_workload
from nanovllm.configs import config_path
from nanovllm.engine.executor import free_port

# KV bytes per rank, every engine alike (several engines share one process)
KV_CACHE_BYTES = (40 << 30) if torch.cuda.is_available() else (1 << 30)
GPU_SIZES = [2 << 10 << (2 * k) for k in range(9)]  # 2 KB .. 128 MB, then 256 MB below
CPU_SIZES = [2 << 10 << (2 * k) for k in range(6)]  # 2 KB .. 2 MB (gloo is slow)


def spawn_ranks(target, world: int, args: tuple, results: int, timeout: float = 600) -> list:
    """Run ``target(rank, *args, queue)`` in ``world`` spawned processes and return the
    ``results`` objects they put on ``queue``. A rank that fails is an error at once, not a
    wait of ``timeout`` seconds for what it will never send."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out, deadline, ok = [], time.monotonic() + timeout, False
    try:
        while len(out) < results:
            try:
                out.append(queue.get(timeout=1))
            except Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
                if failed:
                    rank, code = failed[0]
                    raise RuntimeError(
                        f"rank {rank} exited with code {code} (its error is above)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks sent no results within {timeout:.0f} s") from None
        ok = True
    finally:
        for p in procs:
            if ok:
                p.join(60)
            if p.is_alive():
                p.kill()
    return out


def _allreduce_rank(rank: int, world: int, port: int, sizes: list[int], iters: int,
                    cuda: bool, queue) -> None:
    if cuda:
        torch.cuda.set_device(rank)
    else:  # the ranks share the host's cores
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    rows = []
    for size in sizes:
        x = torch.ones(size // dtype.itemsize, dtype=dtype, device=device)
        row = {"bytes": size, "eager_us": _time(lambda x=x: dist.all_reduce(x), cuda, iters)}
        if cuda:  # ten all-reduces captured in one graph, as a decode step captures them
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    dist.all_reduce(x)
            row["graph_us"] = _time(graph.replay, cuda, iters) / 10
        for mode in ("eager", "graph"):
            if f"{mode}_us" in row:
                row[f"{mode}_busbw_gbs"] = 2 * (world - 1) / world * size / row[f"{mode}_us"] / 1e3
        rows.append(row)
    if rank == 0:
        queue.put(rows)
        queue.close()
        queue.join_thread()  # the rows must leave before os._exit ends this process
    dist.barrier()
    os._exit(0)  # skip NCCL teardown, which can hang at exit


def _time(fn, cuda: bool, iters: int = 20) -> float:
    """Median microseconds of ``fn`` (after warm-up), synchronizing around each call."""
    times = time_calls(fn, iters, warmup=3, device="cuda" if cuda else None)
    return sorted(times)[iters // 2] * 1e6


def allreduce_sweep(world: int, sizes: list[int] | None = None, iters: int = 20,
                    device: str | None = None) -> list[dict]:
    """All-reduce latency and bus bandwidth by message size over ``world`` processes
    (medians of ``iters`` calls): NCCL with one GPU per rank on ``device="cuda"`` (the
    default where there is a GPU), gloo on ``"cpu"``."""
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if cuda and world > torch.cuda.device_count():
        raise ValueError(f"an all-reduce over {world} GPUs needs {world} GPUs; this machine "
                         f"has {torch.cuda.device_count()} (device='cpu' measures gloo)")
    sizes = sizes or (GPU_SIZES + [256 << 20] if cuda else CPU_SIZES)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    [rows] = spawn_ranks(_allreduce_rank, world, (world, free_port(), sizes, iters, cuda),
                         results=1)
    return rows


def parity(model: str, sizes: list[int], num_prompts: int = 8, max_tokens: int = 32) -> dict:
    """Greedy tokens and top-5 logprobs at each size against the first size (float32)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 300, (num_prompts,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    runs = {}
    for n in sizes:
        with LLM(str(config_path(model)), load_format="dummy", dtype="float32",
                 tensor_parallel_size=n, kv_cache_memory=1 << 30, max_model_len=1024) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[n] = [(o.token_ids, [{t: lp.logprob for t, lp in step.items()}
                                      for step in o.outputs[0].logprobs]) for o in outs]
            free(llm)
    base = runs[sizes[0]]
    result = {"model": f"{model} (random weights)", "dtype": "float32", "prompts": num_prompts,
              "max_tokens": max_tokens, "distinct_tokens": len({t for ids, _ in base for t in ids})}
    for n in sizes[1:]:
        equal = sum(a == b for (x, _), (y, _) in zip(base, runs[n]) for a, b in zip(x, y))
        diffs = [abs(sa[t] - sb[t]) for (_, x), (_, y) in zip(base, runs[n])
                 for sa, sb in zip(x, y) for t in sa.keys() & sb.keys()]
        result[f"tp{n}"] = {"tokens_equal": equal, "tokens": len(base) * max_tokens,
                            "max_abs_logprob_diff": max(diffs)}
    return result


def engine_numbers(model: str, n: int, workload: str, num_requests: int | None) -> dict:
    """Decode-step times and workload throughput of one shape at one size (bf16)."""
    from nanovllm.benchmarks.decode_step import decode_step_benchmark

    llm = LLM(str(config_path(model)), load_format="dummy", tensor_parallel_size=n,
              kv_cache_memory=KV_CACHE_BYTES, max_model_len=2048)
    try:
        batches = [1, 64] if torch.cuda.is_available() else [1, 8]  # what 1 GiB holds on CPU
        rows = decode_step_benchmark(llm, batches, context=1024, unfused=False)
        work = make_workload(workload, num_requests)
        seconds = time_workload(llm, work)
        return {"model": model, "tp": n, "decode": rows, "workload": workload,
                "requests": len(work.prompts), "output_tokens": work.output_tokens,
                "seconds": seconds, "output_tok_s": work.output_tokens / seconds}
    finally:
        free(llm)
        llm.shutdown()
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["parity", "allreduce", "decode"],
                        choices=["parity", "allreduce", "decode"],
                        help="decode: decode steps and workload throughput")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("--workload", default="nano-vllm")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    record = {
        **run_metadata("nanovllm.benchmarks.tensor_parallel", argv, device_label=(
            f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if gpu
            else f"CPU ({os.cpu_count()} cores, {platform.machine()})")),
        "software": f"torch {torch.__version__}",
    }
    if "parity" in args.sections:
        record["parity"] = parity(args.models[0], args.sizes)
        print("parity", record["parity"], flush=True)
    if "allreduce" in args.sections:
        record["allreduce"] = {str(n): allreduce_sweep(n) for n in args.sizes if n > 1}
        for n, rows in record["allreduce"].items():
            for row in rows:
                print(f"all-reduce n={n}", row, flush=True)
    if "decode" in args.sections:
        record["engines"] = []
        for model in args.models:
            for n in args.sizes:
                numbers = engine_numbers(model, n, args.workload, args.num_requests)
                record["engines"].append(numbers)
                print(f"{model} tp={n}: {numbers['output_tok_s']:,.0f} tok/s;",
                      [(r["batch"], round(r.get("eager_ms", 0), 3), round(r.get("graphs_ms", 0), 3))
                       for r in numbers["decode"]], flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

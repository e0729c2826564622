"""Cache-aware routing against round-robin, measured (chapter 17 §5):

    python -m nanovllm.benchmarks.routing --replicas 2 --out figures/data/routing_cpu.json

builds ``--replicas`` engines of one model in this process, replays the multi-tenant
shared-prefix workload (``fleet.tenant_workload``) through each router in turn (prefix
caches emptied between them) and writes each router's prefix-cache hit rate, time to first
token and throughput (``fleet.FleetResult.summary``), with the device, date and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from nanovllm import LLM
from nanovllm.benchmarks.fleet import run_fleet, tenant_workload
from nanovllm.benchmarks.workload import resolve_model, warm_up
from nanovllm.configs import config_path
from nanovllm.deploy.router import PrefixAwareRouter, RoundRobinRouter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanovllm.benchmarks.routing",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder, a shipped config name (random weights) or "
                   "'small' (SmolLM2's shape cut to 4 layers of width 256, random weights); "
                   "default: SmolLM2-135M on a CPU, qwen3-0.6b on a GPU")
    p.add_argument("--replicas", type=int, nargs="+", default=[2],
                   help="fleet sizes to measure, one after the other")
    p.add_argument("--tenants", type=int, default=8, help="distinct system prompts")
    p.add_argument("--per-tenant", type=int, default=8, help="requests per tenant")
    p.add_argument("--length-scale", type=float, default=1 / 16,
                   help="scales the shared-prefix workload's lengths (1: a 2,048-token prefix)")
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second, all tenants")
    p.add_argument("--num-kv-blocks", type=int, help="each replica's KV cache, in blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                   help="each replica's share of the GPU")
    p.add_argument("--slack", type=int, default=4, help="PrefixAwareRouter's load slack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results here (JSON)")
    return p.parse_args(argv)


def small_model() -> str:
    """A folder with SmolLM2-135M's config cut to 4 layers of width 256 (random weights):
    enough arithmetic per token that prefill shows, cheap enough for a CPU's minutes."""
    folder = Path(tempfile.mkdtemp(prefix="smollm2-small-"))
    config = json.loads((config_path("smollm2-135m") / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=4, head_dim=64)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def make_engines(args: argparse.Namespace, device: str, replicas: int, path: str,
                 load_format: str) -> list[LLM]:
    options = {"load_format": load_format, "async_scheduling": False}
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    if device == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["dtype"] = "float32"
    llms = [LLM(path, **options) for _ in range(replicas)]
    for llm in llms:
        if device == "cuda":
            warm_up(llm)  # compile every kernel shape before timing (chapter 11)
        else:  # (a CPU compiles nothing: one short request loads the code paths)
            llm.generate([[1, 2, 3] * 11], use_tqdm=False)
    return llms


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = tenant_workload(args.tenants, args.per_tenant, length_scale=args.length_scale,
                           request_rate=args.rate, seed=args.seed)
    if args.model == "small":
        path, load_format = small_model(), "dummy"
    else:
        path, load_format = resolve_model(args.model, device)
    runs = []
    for replicas in args.replicas:
        llms = make_engines(args, device, replicas, path, load_format)
        engines = [llm.engine for llm in llms]
        block_size, num_blocks = engines[0].config.block_size, engines[0].block_manager.num_blocks
        routers = [RoundRobinRouter(replicas),
                   PrefixAwareRouter(replicas, block_size, num_blocks, slack=args.slack)]
        for router in routers:
            for engine in engines:
                assert engine.reset_prefix_cache()
            result = run_fleet(engines, router, work).summary()
            print(json.dumps(result))
            runs.append(result)
        for llm in llms:
            llm.shutdown()
    record = {
        "what": "cache-aware routing vs round-robin: engine replicas in one process, each on "
                "its own clock of measured step times (nanovllm/benchmarks/fleet.py)",
        "clock": "wall-clock seconds" if device == "cuda" else
                 "CPU seconds of this process (all torch threads), not wall-clock",
        "device": torch.cuda.get_device_name() if device == "cuda" else
                  f"CPU ({platform.processor() or platform.machine()}, "
                  f"{torch.get_num_threads()} torch threads)",
        "date": datetime.date.today().isoformat(),
        # (other jobs on the machine: a CPU clock leaves them out, a GPU one does not)
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "command": "python -m nanovllm.benchmarks.routing " + shlex.join(argv or sys.argv[1:]),
        "model": args.model or path, "block_size": block_size,
        "kv_blocks_per_replica": num_blocks,
        "workload": {"tenants": args.tenants, "per_tenant": args.per_tenant,
                     "length_scale": args.length_scale, "request_rate": args.rate,
                     "shared_prefix_len": work.shared_prefix_len, "seed": args.seed},
        "results": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()

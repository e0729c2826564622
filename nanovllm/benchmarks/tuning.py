"""``python -m nanovllm.benchmarks.tuning``: the benchmark under different engine settings
(chapter 11).

Runs the nano-vllm workload (``workload.py``) once per setting of one knob, everything else
at the benchmark's defaults, and prints throughput, steps, preemptions and latency. The
default setting runs twice, so the spread between two identical runs is on the same table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from nanovllm import LLM
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.workload import free, make_workload, run_workload
from nanovllm.config import EngineConfig, default_max_num_batched_tokens
from nanovllm.configs import config_path
from nanovllm.engine.metrics import latency_summary

KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enforce_eager")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in KNOBS}
SETTINGS = [  # one knob changed per run; {} = the benchmark's defaults
    {},
    {},
    {"max_num_seqs": 64},
    {"max_num_seqs": 128},
    {"max_num_batched_tokens": 1024},
    {"max_num_batched_tokens": 4096},
    {"block_size": 64},
    {"block_size": 256},
    {"gpu_memory_utilization": 0.06},  # about 5 GB of KV cache: too small for all at once
    {"enforce_eager": True},
]


def run_setting(model: str, knobs: dict, num_requests: int | None) -> dict:
    work = make_workload("nano-vllm", num_requests)
    options = {"gpu_memory_utilization": 0.5, **knobs}
    llm = LLM(str(config_path(model)), load_format="dummy", **options)
    seconds, outs = run_workload(llm, work)
    latency = latency_summary(o.metrics for o in outs)
    row = {
        "knobs": knobs,
        "seconds": seconds,
        "tok_s": work.output_tokens / seconds,
        "kv_blocks": llm.engine.block_manager.num_blocks,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "ttft_mean_s": latency["time_to_first_token"]["mean"],
        "tpot_mean_s": latency["time_per_output_token"]["mean"],
        **llm.engine.stats.summary(),
    }
    free(llm)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the tuning sweep runs the GPU benchmark: it needs a CUDA GPU")
    defaults = {**DEFAULTS, "gpu_memory_utilization": 0.5,  # the step budget: by device
                "max_num_batched_tokens": default_max_num_batched_tokens("cuda")}
    meta = {**run_metadata("nanovllm.benchmarks.tuning", argv, "cuda"), "defaults": defaults}
    rows = []
    print(f"{'setting':36s} {'tok/s':>8} {'steps':>6} {'preempt':>8} {'TTFT s':>7} {'TPOT ms':>8}")
    for knobs in SETTINGS:
        row = run_setting(args.model, knobs, args.num_requests)
        rows.append(row)
        print(
            f"{json.dumps(knobs) if knobs else 'defaults':36s} {row['tok_s']:8,.0f} "
            f"{row['steps']:6d} {row['preemptions']:8d} {row['ttft_mean_s']:7.2f} "
            f"{row['tpot_mean_s'] * 1e3:8.2f}",
            flush=True,
        )
        if args.out:  # after every row: a later failure keeps the earlier ones
            args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

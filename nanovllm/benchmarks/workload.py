"""The benchmark's requests and how an engine runs them, timed (chapters 03 and 11).

Two workloads, both with fixed output lengths (``ignore_eos``), so that the number of
generated tokens is known in advance and speed does not depend on weight values:

- ``nano-vllm`` (default on a GPU): 256 requests, prompt lengths uniform in 100..1024 with
  token ids in 0..10000, output lengths uniform in 100..1024, seed 0 -> 133,966 output
  tokens. The workload nano-vllm publishes numbers for.
- ``cpu`` (default on a CPU): 32 requests of 64..256 prompt tokens and 64..128 new tokens.

``throughput`` (``python -m nanovllm.benchmarks.throughput``), ``tuning``, ``profiling``,
``quantization`` and ``tensor_parallel`` all send these requests; ``run_workload`` times them
(after ``warm_up``) the same way for each.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.timing import stopwatch, synchronize
from nanovllm.configs import SHIPPED, config_path
from nanovllm.models import ModelConfig
from nanovllm.outputs import RequestOutput


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name == "nano-vllm":
        n, prompt_range, output_range = num_requests or 256, (100, 1024), (100, 1024)
    elif name == "cpu":
        n, prompt_range, output_range = num_requests or 32, (64, 256), (64, 128)
    else:
        raise ValueError(f"unknown workload {name!r}")
    # Same draw order as nano-vllm's bench.py, so seed 0 gives its exact requests.
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    output_lens = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, output_lens)


def resolve_model(model: str | None, device: str) -> tuple[str, str]:
    """(folder, load_format): a shipped config name means random weights."""
    if model is None:
        if device == "cuda":
            model = "qwen3-0.6b"
        else:
            from nanovllm.weights.smollm2 import smollm2_path

            return str(smollm2_path()), "safetensors"
    if model in SHIPPED:
        return str(config_path(model)), "dummy"
    return model, "safetensors"


def warm_up(llm: LLM, sampling: dict | None = None) -> None:
    """Run a few requests of different lengths before timing: Triton compiles each kernel on
    its first use, and prefill, mixed and decode steps each need their own kernels.
    ``sampling``: extra ``SamplingParams`` fields, as the timed requests use them."""
    prompts = [[(7 * i + j) % 10000 for j in range(n)] for i, n in enumerate((3, 17, 70, 300))]
    params = SamplingParams(max_tokens=8, ignore_eos=True, **(sampling or {}))
    llm.generate(prompts, params, use_tqdm=False)
    synchronize(llm.config.device)
    llm.engine.stats.reset()


def run_nanovllm(
    path: str, load_format: str, work: Workload, sampling: dict | None = None, **options
) -> tuple[float, LLM]:
    """Seconds to run the workload (after a warm-up) and the engine; ``sampling``: extra
    ``SamplingParams`` fields for every request (``--logprobs``, ``--penalties``)."""
    llm = LLM(path, load_format=load_format, **options)
    return time_workload(llm, work, sampling), llm


def run_workload(
    llm: LLM, work: Workload, sampling: dict | None = None
) -> tuple[float, list[RequestOutput]]:
    """Seconds ``llm`` takes to run the workload, after a warm-up, and the outputs (sampled at
    temperature 0.6, every request to its fixed length)."""
    sampling = sampling or {}
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **sampling)
        for n in work.output_lens
    ]
    warm_up(llm, sampling)
    with stopwatch(llm.config.device) as watch:
        outs = llm.generate(work.prompts, params, use_tqdm=False)
    assert sum(len(o.token_ids) for o in outs) == work.output_tokens
    return watch.seconds, outs


def time_workload(llm: LLM, work: Workload, sampling: dict | None = None) -> float:
    """Seconds ``llm`` takes to run the workload, after a warm-up (see ``run_workload``)."""
    return run_workload(llm, work, sampling)[0]


def free(llm: LLM) -> None:
    """Give an engine's GPU memory back before the next engine or the peer starts (other
    references to ``llm`` may live on, so drop the tensors themselves)."""
    runner = llm.engine.runner
    runner.graphs = runner.kv_cache = runner.model = None
    for layer in runner.attention_layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bandwidth_bound_seconds(
    work: Workload, cfg: ModelConfig, weight_bytes: int, elem: int, bandwidth: float
) -> float:
    """Least time to run the workload if every decode step must read all weights once and
    every sequence's KV cache so far, with all requests decoding together."""
    kv_token_reads = sum(
        p * n + n * (n - 1) // 2 for p, n in zip(map(len, work.prompts), work.output_lens)
    )
    total = kv_token_reads * cfg.kv_bytes_per_token(elem) + max(work.output_lens) * weight_bytes
    return total / bandwidth

"""The benchmark's requests and how an engine runs them, timed (chapters 03 and 11).

Two workloads, both with fixed output lengths (``ignore_eos``), so that the number of
generated tokens is known in advance and speed does not depend on weight values:

- ``nano-vllm`` (default on a GPU): 256 requests, prompt lengths uniform in 100..1024 with
  token ids in 0..10000, output lengths uniform in 100..1024, seed 0 -> 133,966 output
  tokens. The workload nano-vllm publishes numbers for.
- ``cpu`` (default on a CPU): 32 requests of 64..256 prompt tokens and 64..128 new tokens.
- ``long-prompts``: 16 requests of 8,192..32,768 prompt tokens and 128 new tokens each:
  prefill-bound, and beyond the engine's default ``max_model_len`` (see ``max_model_len``).
- ``shared-prefix``: 128 requests that all start with the same 2,048-token system prompt,
  then 64..256 tokens of their own, with 64..256 new tokens: prefix caching (chapter 04)
  computes the system prompt once.
- ``arrivals``: 256 requests of mixed lengths (prompts log-uniform in 16..4,096 tokens,
  outputs in 16..1,024) arriving as a Poisson process of ``request_rate`` per second
  (default 16); ``latency.drive`` lets each in when its time has come.

``length_scale`` multiplies every length of the last three (at least 1 token each), so a CPU
test runs their shape small; ``request_rate`` gives any workload Poisson arrival times. The
first two stay exactly nano-vllm's draws (recorded results depend on them).

``throughput`` (``python -m nanovllm.benchmarks.throughput``), ``tuning``, ``profiling``,
``quantization`` and ``tensor_parallel`` all send these requests; ``run_workload`` times them
(after ``warm_up``) the same way for each.
"""

from __future__ import annotations

import gc
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.timing import stopwatch, synchronize
from nanovllm.configs import SHIPPED, config_path
from nanovllm.models import ModelConfig
from nanovllm.outputs import RequestOutput

WORKLOADS = ("nano-vllm", "cpu", "long-prompts", "shared-prefix", "arrivals")
WARM_UP_SHORT = 40  # short warm-up prompts: > 32 decodes, a batch that needs no split-KV
DEFAULT_REQUEST_RATE = 16.0  # requests/s of ``arrivals`` when no rate is given


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    # seconds after the start at which each request arrives (None: all at once)
    arrival_times: list[float] | None = None
    shared_prefix_len: int = 0  # leading tokens every prompt shares (``shared-prefix``)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine must hold."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))


def make_workload(
    name: str,
    num_requests: int | None = None,
    seed: int = 0,
    *,
    length_scale: float = 1.0,
    request_rate: float | None = None,
) -> Workload:
    """The requests of workload ``name`` (see the module docstring); ``request_rate``:
    Poisson arrivals at that many requests per second (``inf``: all at once)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    rng = random.Random(seed)
    if name in ("nano-vllm", "cpu"):
        if length_scale != 1:
            raise ValueError(f"length_scale applies to the other workloads, not {name!r}")
        work = _nano_vllm_draws(name, num_requests, rng)
    else:
        work = _DRAWS[name](num_requests, rng, lambda n: max(1, round(n * length_scale)))
    if name == "arrivals" and request_rate is None:
        request_rate = DEFAULT_REQUEST_RATE
    if request_rate is not None:  # drawn last: the lengths do not depend on the rate
        gaps = [0.0] + [
            rng.expovariate(request_rate) if math.isfinite(request_rate) else 0.0
            for _ in work.prompts[1:]
        ]
        work.arrival_times = list(itertools.accumulate(gaps))
    return work


def _nano_vllm_draws(name: str, num_requests: int | None, rng: random.Random) -> Workload:
    if name == "nano-vllm":
        n, prompt_range, output_range = num_requests or 256, (100, 1024), (100, 1024)
    else:
        n, prompt_range, output_range = num_requests or 32, (64, 256), (64, 128)
    # Same draw order as nano-vllm's bench.py, so seed 0 gives its exact requests.
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    output_lens = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, output_lens)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 10000) for _ in range(n)]


Scale = Callable[[int], int]  # a length in the full-size workload -> the length drawn


def _long_prompts(num_requests: int | None, rng: random.Random, scale: Scale) -> Workload:
    n = num_requests or 16
    prompts = [_tokens(rng, rng.randint(scale(8192), scale(32768))) for _ in range(n)]
    return Workload(prompts, [scale(128)] * n)


def _shared_prefix(num_requests: int | None, rng: random.Random, scale: Scale) -> Workload:
    n = num_requests or 128
    system = _tokens(rng, scale(2048))
    prompts = [system + _tokens(rng, rng.randint(scale(64), scale(256))) for _ in range(n)]
    output_lens = [rng.randint(scale(64), scale(256)) for _ in range(n)]
    return Workload(prompts, output_lens, shared_prefix_len=len(system))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """Many short, few long: uniform in log(length) (real traffic has a long tail)."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _arrivals(num_requests: int | None, rng: random.Random, scale: Scale) -> Workload:
    n = num_requests or 256
    prompts = [_tokens(rng, _log_uniform(rng, scale(16), scale(4096))) for _ in range(n)]
    output_lens = [_log_uniform(rng, scale(16), scale(1024)) for _ in range(n)]
    return Workload(prompts, output_lens)


_DRAWS = {"long-prompts": _long_prompts, "shared-prefix": _shared_prefix, "arrivals": _arrivals}


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


def warm_up(llm: LLM, sampling: dict | None = None, longest: int = 0) -> None:
    """Run requests shaped like every kind of step before timing: Triton compiles a kernel on
    its first call with new constant arguments (chapter 05), and the timed run must not pay
    for that (``time_budget`` lists what a run compiles). Two rounds of 8 new tokens each:

    1. 40 short prompts and long ones that spill past the step's token budget: a prefill
       step, then a mixed step (40 decodes, more than split-KV needs, beside a long prompt's
       last chunk, which attends to its own cached start), then CUDA-graph decodes;
    2. one short prompt and long ones: a mixed step with a single decode (split-KV).

    ``sampling``: extra ``SamplingParams`` fields, as the timed requests use them.
    ``longest``: also one request that long (prompt and 8 new tokens), for what only long
    contexts use (the decode kernel splits a long context over several programs, chapter 05)."""
    engine = llm.engine
    budget = llm.config.max_num_batched_tokens
    capacity = engine.block_manager.num_blocks * llm.config.block_size
    limit = min(llm.config.max_model_len, capacity) - 8  # a prompt, with room for 8 tokens

    def prompts(first: int, lengths: list[int]) -> list[list[int]]:
        return [[(7 * (first + i) + j) % 10000 for j in range(n)] for i, n in enumerate(lengths)]

    def spilling(tokens: int) -> list[int]:  # prompt lengths (<= limit) adding up to tokens
        return [limit] * (tokens // limit) + ([tokens % limit] if tokens % limit else [])

    short = [3 + 5 * (i % 8) for i in range(WARM_UP_SHORT)]
    rounds = [
        prompts(0, short + spilling(max(budget - sum(short), 0) + 64)),
        prompts(100, [5] + spilling(budget + 59)),
    ]
    if longest > 308:
        rounds[0] += prompts(200, [min(longest - 8, limit)])
    params = SamplingParams(max_tokens=8, ignore_eos=True, **(sampling or {}))
    for batch in rounds:
        llm.generate(batch, params, use_tqdm=False)
    synchronize(llm.config.device)
    engine.stats.reset()


def run_nanovllm(
    path: str, load_format: str, work: Workload, sampling: dict | None = None, **options
) -> tuple[float, LLM]:
    """Seconds to run the workload (after a warm-up) and the engine; ``sampling``: extra
    ``SamplingParams`` fields for every request (``--logprobs``, ``--penalties``)."""
    llm = LLM(path, load_format=load_format, **options)
    return time_workload(llm, work, sampling), llm


def request_params(work: Workload, sampling: dict | None = None) -> list[SamplingParams]:
    """Each request's parameters: temperature 0.6, exactly its output length (``ignore_eos``)
    and the extra ``SamplingParams`` fields in ``sampling``."""
    return [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **(sampling or {}))
        for n in work.output_lens
    ]


def run_workload(
    llm: LLM, work: Workload, sampling: dict | None = None
) -> tuple[float, list[RequestOutput]]:
    """Seconds ``llm`` takes to run the workload, after a warm-up, and the outputs (sampled at
    temperature 0.6, every request to its fixed length)."""
    params = request_params(work, sampling)
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


def bound_bytes(
    work: Workload, cfg: ModelConfig, weight_bytes: int, elem: int
) -> tuple[int, int]:
    """The bytes the bound counts: every sequence's KV cache so far at each of its decode
    steps, and all the weights once per step, with all requests decoding together."""
    kv_token_reads = sum(
        p * n + n * (n - 1) // 2 for p, n in zip(map(len, work.prompts), work.output_lens)
    )
    return kv_token_reads * cfg.kv_bytes_per_token(elem), max(work.output_lens) * weight_bytes


def bandwidth_bound_seconds(
    work: Workload, cfg: ModelConfig, weight_bytes: int, elem: int, bandwidth: float
) -> float:
    """Least time to run the workload if every decode step must read all weights once and
    every sequence's KV cache so far (``bound_bytes``), at ``bandwidth`` bytes/s."""
    return sum(bound_bytes(work, cfg, weight_bytes, elem)) / bandwidth

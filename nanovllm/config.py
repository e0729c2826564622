"""``EngineConfig``: every knob of the engine, named once and validated (chapter 00).

Each component of the book can be switched on or off from here, so a chapter can measure
exactly what its component buys: ``attention_backend``, ``enable_prefix_caching``,
``enable_chunked_prefill``, ``enforce_eager``, ``async_scheduling``, ``scheduler_policy``,
``quantization`` and ``kv_cache_dtype`` (chapter 08) and the KV budget.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from nanovllm.layers.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from nanovllm.validation import (
    Rule,
    check_fields,
    is_bool,
    is_number,
    is_positive_int,
    is_seed,
    one_of,
    optional,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


# The built-in scheduling policies (chapter 06), named here so that the config can check a
# name without importing the engine, which imports the config; engine/policies.py maps each
# name to its class.
SCHEDULER_POLICIES = ("fcfs", "priority", "fair", "mixed")


def _power_of_two(x: object) -> bool:
    return is_positive_int(x) and x & (x - 1) == 0


def check_scheduler_policy(policy: object) -> None:
    """Raise ``ValueError`` unless ``policy`` is a name in ``SCHEDULER_POLICIES``, an object
    with an ``order(seqs, now)`` method, or such a function (``engine/policies.py``)."""
    if isinstance(policy, type):
        # A class has an `order` attribute too, but calling it would fail at the first step.
        name = policy.__name__
        raise ValueError(f"scheduler_policy got the class {name}; pass an instance, e.g. {name}()")
    if isinstance(policy, str):
        if policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"unknown scheduler_policy {policy!r}; choose from {sorted(SCHEDULER_POLICIES)}"
            )
    elif not callable(getattr(policy, "order", None)) and not callable(policy):
        raise ValueError(
            "scheduler_policy must be a name, an object with order(seqs, now), or such a function"
        )


def default_max_num_batched_tokens(device: str) -> int:
    """The step's token budget when none is given: the larger, the fewer (eager, host-bound)
    prefill steps a burst of prompts takes; on the H200, 16384 ran the nano-vllm workload 15%
    faster than 4096 (``figures/data/time_budget_*``). The CPU keeps 4096."""
    if device == "cpu":
        return 4096
    try:
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    except (AssertionError, RuntimeError):  # a device that cannot be queried: the smaller one
        return 8192
    return 16384 if total >= 70 * 2**30 else 8192


_RULES: tuple[Rule, ...] = (
    ("model", lambda x: isinstance(x, str | os.PathLike), "a path to a model folder"),
    ("device", lambda x: isinstance(x, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", x),
     "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("dtype", *one_of(("auto", *DTYPES))),
    ("load_format", *one_of(LOAD_FORMATS)),
    ("max_model_len", optional(is_positive_int), "None or an int >= 1"),
    ("max_num_seqs", is_positive_int, "an int >= 1"),
    ("max_num_batched_tokens", optional(is_positive_int), "None or an int >= 1"),
    ("block_size", _power_of_two, "a power of two (an int)"),
    ("enable_prefix_caching", is_bool, "a bool"),
    ("enable_chunked_prefill", is_bool, "a bool"),
    ("attention_backend", *one_of(ATTENTION_BACKENDS)),
    ("enforce_eager", is_bool, "a bool"),
    ("async_scheduling", optional(is_bool), "None (on for CUDA) or a bool"),
    ("gpu_memory_utilization", lambda x: is_number(x) and 0 < x <= 1, "a number in (0, 1]"),
    ("num_kv_blocks", optional(is_positive_int), "None or an int >= 1"),
    ("kv_cache_memory", optional(is_positive_int), "None or a number of bytes >= 1"),
    ("tensor_parallel_size", is_positive_int, "an int >= 1"),
    ("distributed_executor_backend", *one_of(("mp", "ray"))),
    ("logprobs_mode", *one_of(LOGPROBS_MODES)),
    ("quantization", optional(one_of(QUANTIZATION_METHODS)[0]),
     f"None or one of {QUANTIZATION_METHODS}"),
    ("kv_cache_dtype", *one_of(KV_CACHE_DTYPES)),
    ("seed", is_seed, "an int in [-2**63, 2**64 - 1]"),
)


@dataclass
class EngineConfig:
    """All engine settings. Unknown names are rejected, never silently dropped.

    Every field is checked on construction (type, range, and what this machine and the
    chosen attention backend can run); a bad value raises ``ValueError`` naming the field,
    the value and what is allowed. ``"auto"`` values are resolved here, except
    ``attention_backend``, which the model runner resolves by the same rule.
    """

    model: str
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"  # "dummy" = random weights (benchmarks)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped
    max_num_seqs: int = 256
    # Token budget of one engine step. None: 4096 on a CPU; on a GPU vLLM's offline defaults,
    # 16384 (8192 below 70 GiB of memory): fewer, larger prefill steps (chapter 11).
    max_num_batched_tokens: int | None = None
    block_size: int = 16  # tokens per KV-cache block
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "auto": Triton on CUDA, torch elsewhere; "flash_attn": FlashAttention-4 (flash-attn-4,
    # Hopper or newer, bf16/fp16), never chosen by "auto" (nanovllm/layers/attention_backends.py).
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True disables CUDA graphs
    # Plan step n+1 on the CPU while the GPU computes step n (chapter 11); None: on for CUDA.
    async_scheduling: bool | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # KV budget in blocks (overrides the byte budget)
    kv_cache_memory: int | None = None  # KV budget in bytes (CPU default: 1 GiB)
    scheduler_policy: Any = "fcfs"  # a policy name or a Policy object (chapter 06)
    tensor_parallel_size: int = 1
    # Who starts ranks 1..N-1: "mp", child processes on this host (chapter 09), or "ray",
    # workers Ray places on any node of its cluster (nanovllm/engine/ray_executor.py, ch. 17)
    distributed_executor_backend: str = "mp"
    seed: int = 0
    # Which distribution SamplingParams.logprobs report (vLLM's names): the model's own
    # ("raw_logprobs"), or "processed_logprobs": after penalties, bias, masks and temperature
    # but before top-k/top-p/min-p (vLLM applies those too; chapter 01, section 2.5).
    logprobs_mode: str = "raw_logprobs"
    # Chapter 08, vLLM's names. quantization: None (the checkpoint's own: None, or "fp8" for
    # an fp8 checkpoint), "int8" (int8 weights, W8A16) or "fp8" (e4m3 weights and per-token
    # activations, W8A8): linear layers are quantized at load time, per output channel;
    # embeddings and the LM head keep ``dtype``. "fp8" needs a GPU of compute capability
    # >= 8.9 (Ada, Hopper); on CPU it runs an emulation (fp8 values, fp32 matmul) that gives
    # fp8's accuracy but not its speed. kv_cache_dtype: "auto" (= dtype) or "fp8" (e4m3, one
    # scale per layer), which halves KV bytes; with the Triton attention kernels on a GPU it
    # needs compute capability >= 8.9 too (the torch backend runs it anywhere).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # Speculative decoding (chapter 14), vLLM's keys: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} or
    # {"method": "draft_layers", "num_layers": n, "num_speculative_tokens": k} or
    # {"model": draft_folder, "num_speculative_tokens": k}. Parsed into a
    # ``SpeculativeConfig`` here (``nanovllm/speculative_config.py``).
    speculative_config: Any = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, turning a misspelled option into a helpful ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        check_fields(self, _RULES)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(
                f"model {self.model!r} is not a folder with a config.json; pass the path of a "
                "Hugging Face model folder (nanovllm.smollm2_path() gives one)"
            )
        self._resolve_device()
        self._check_tensor_parallel()
        self._check_quantization()
        self._check_speculative()
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self._check_backend()
        check_scheduler_policy(self.scheduler_policy)  # the scheduler builds the policy
        if self.max_num_batched_tokens is None:  # last: every check above may raise first
            self.max_num_batched_tokens = default_max_num_batched_tokens(self.device)

    def _resolve_device(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            return
        if not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device is {self.device!r} but CUDA is not available")
        index = torch.device(self.device).index
        if index is not None and index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"EngineConfig.device is {self.device!r} but there are {count} GPUs")

    def _check_tensor_parallel(self) -> None:
        """One rank per GPU of this machine, unless a launcher placed ranks elsewhere."""
        n = self.tensor_parallel_size
        if n == 1 or not self.device.startswith("cuda"):
            return
        if self.device != "cuda":
            raise ValueError(
                f"EngineConfig.device is {self.device!r}: with tensor_parallel_size={n} pass "
                "device='cuda' (rank r uses GPU r; choose GPUs with CUDA_VISIBLE_DEVICES)"
            )
        on_one_host = "WORLD_SIZE" not in os.environ and self.distributed_executor_backend == "mp"
        if on_one_host and n > torch.cuda.device_count():
            raise ValueError(
                f"EngineConfig.tensor_parallel_size is {n} but this machine has "
                f"{torch.cuda.device_count()} GPU(s); ranks on other hosts need WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT (see nanovllm/engine/worker.py)"
            )

    def _check_quantization(self) -> None:
        """Take an fp8 checkpoint's own method; refuse what the device cannot run."""
        from nanovllm.layers.quantization.fp8 import MIN_FP8_CAPABILITY, fp8_supported
        from nanovllm.layers.quantization.fp8_checkpoint import read_checkpoint_quantization

        if read_checkpoint_quantization(self.model) is not None:  # (raises for gptq etc.)
            if self.quantization not in (None, "fp8"):
                raise ValueError(
                    f"EngineConfig.quantization is {self.quantization!r} but {self.model} "
                    "holds an fp8 checkpoint (config.json quantization_config); pass "
                    "quantization=None or 'fp8'"
                )
            self.quantization = "fp8"
        if self.quantization == "fp8" and not fp8_supported(self.device):
            major, minor = torch.cuda.get_device_capability(self.device)
            need = ".".join(map(str, MIN_FP8_CAPABILITY))
            raise ValueError(
                f"quantization='fp8' needs a GPU with fp8 support (compute capability >= "
                f"{need}: Ada, Hopper or newer); {self.device} has {major}.{minor}. Use "
                "quantization='int8', or device='cpu' for the (slow) emulated fp8 path"
            )

    def _check_speculative(self) -> None:
        """Parse ``speculative_config``; refuse what speculation does not run with, and fall
        back, with a warning, from what it cannot use (chapter 14)."""
        from nanovllm.speculative_config import parse_speculative_config

        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is None:
            return

    def _check_backend(self) -> None:
        """Refuse, now rather than at the first step, what the chosen backend cannot run: each
        backend's own ``check`` says why (``nanovllm/layers/attention_backends.py``)."""
        # Imported when checked, so that importing the config does not import the layers.
        from nanovllm.layers.attention_backends import resolve_backend

        resolve_backend(self, torch.device(self.device))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

"""``EngineConfig``: every knob of the engine, named once and validated (chapter 00).

Each component of the book can be switched on or off from here, so a chapter can measure
exactly what its component buys: ``attention_backend``, ``enable_prefix_caching``,
``enable_chunked_prefill``, ``enforce_eager``, ``async_scheduling``, ``scheduler_policy``
and the KV budget.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class EngineConfig:
    """All engine settings. Unknown names are rejected, never silently dropped."""

    model: str
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"  # "dummy" = random weights (benchmarks)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # token budget of one engine step
    block_size: int = 16  # tokens per KV-cache block
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True disables CUDA graphs
    # Plan step n+1 on the CPU while the GPU computes step n (chapter 11); None: on for CUDA.
    async_scheduling: bool | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # KV budget in blocks (overrides the byte budget)
    kv_cache_memory: int | None = None  # KV budget in bytes (CPU default: 1 GiB)
    scheduler_policy: Any = "fcfs"  # a policy name or a Policy object (chapter 06)
    tensor_parallel_size: int = 1
    seed: int = 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build a config, turning a misspelled option into a helpful ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if not os.path.isfile(os.path.join(str(self.model), "config.json")):
            raise ValueError(
                f"model {self.model!r} is not a folder with a config.json; pass the path of a "
                "Hugging Face model folder (nanovllm.smollm2_path() gives one)"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 is not supported yet")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

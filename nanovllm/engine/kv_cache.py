"""How many KV-cache blocks fit, and the one tensor that holds them (chapters 03 and 11).

On a GPU, ``gpu_memory_utilization`` is this engine's share of the device, as in vLLM (two
engines at 0.45 share one GPU): the cache gets what is left of the share after the weights, the
largest step's activations and the CUDA graphs, counted in PyTorch's own numbers so that other
processes never enter the budget. On a CPU, or with ``kv_cache_memory``, the budget is a number
of bytes. The cache is one zeroed tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

import gc
import math

import torch

from nanovllm import distributed
from nanovllm.config import EngineConfig
from nanovllm.engine.cuda_graphs import graph_rows
from nanovllm.models import ModelConfig

CPU_KV_CACHE_BYTES = 1 << 30
SIZING_TOKENS = 4096  # tokens of the pass that sizes the activations (activation_bytes)
GiB = 2**30


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of this rank's cache (its 1/tp_size of the KV heads)."""
    per_token = model_config.kv_bytes_per_token(kv_dtype.itemsize)
    return per_token // distributed.tp_size() * block_size


def claim_gpu_share(config: EngineConfig, device: torch.device) -> int | None:
    """Before the engine loads anything: check that its share of the GPU fits in what is
    free, and return PyTorch's allocated bytes, from which ``engine_bytes`` counts what the
    engine takes (None: the budget is not a share of a GPU)."""
    if device.type != "cuda" or config.num_kv_blocks is not None or (
        config.kv_cache_memory is not None
    ):
        return None
    gc.collect()  # an engine dropped with `del llm` may wait for the collector: free it now
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    share = config.gpu_memory_utilization * total
    # PyTorch's cached blocks (e.g. of an engine shut down) are this process's to reuse
    available = free + torch.cuda.memory_reserved(device) - allocated
    if share > available:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} asks for "
            f"{share / GiB:.2f} GiB of the GPU's {total / GiB:.2f} GiB, but only "
            f"{available / GiB:.2f} GiB are free: other processes, or another engine in this "
            f"process, hold the rest. Lower gpu_memory_utilization (at most "
            f"{math.floor(100 * available / total) / 100} here), free that memory (an engine "
            "in this process: llm.shutdown() or del llm), or pass kv_cache_memory= explicitly")
    return allocated


def activation_bytes(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> float:
    """GPU memory the largest step's activations need: one forward pass without a cache.

    Without a cache the pass is one causal sequence, whose attention grows with its square,
    while a real step's tokens come from many sequences. So it runs at most ``SIZING_TOKENS``
    tokens, and the peak is scaled up to the step's token budget: the activations that
    dominate (the matmuls') grow linearly with the tokens."""
    torch.cuda.reset_peak_memory_stats(device)
    budget = config.max_num_batched_tokens
    n = min(budget, config.max_model_len, SIZING_TOKENS)
    _sizing_pass(model, n, config.max_num_seqs, device)
    stats = torch.cuda.memory_stats(device)
    return (stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]) * budget / n


@torch.inference_mode()
def _sizing_pass(model: torch.nn.Module, n: int, rows: int, device: torch.device) -> None:
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(n, device=device))
    model.compute_logits(hidden[:rows])
    torch.cuda.synchronize(device)  # (its tensors are freed on return: the peak stays)


def engine_bytes(allocated_at_start: int | None, config: EngineConfig, device: torch.device,
                 activations: float, with_graphs: bool) -> float:
    """What this engine takes of the GPU besides its cache, in PyTorch's own numbers, from
    ``allocated_at_start`` (``claim_gpu_share``; None: 0): the tensors it holds (weights,
    buffers), the largest step's ``activations``, and the decode CUDA graphs' memory pool
    (``with_graphs``; estimated as the activations of their largest batch, since the graphs
    are captured once the cache exists). Not from the driver's free memory: another process
    may allocate meanwhile (a replica starting beside this one), and that is not ours."""
    if allocated_at_start is None:
        return 0.0
    rows = graph_rows(config)
    graphs = activations * rows / config.max_num_batched_tokens if with_graphs else 0.0
    return torch.cuda.memory_allocated(device) - allocated_at_start + activations + graphs


def kv_budget_in_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int,
                        used: float = 0.0) -> int:
    """Whole blocks of cache this rank can hold; ``used``: what the engine takes besides
    the cache (``engine_bytes``), which comes out of its share of a GPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
        why = f"kv_cache_memory={budget}"
    elif device.type == "cuda":
        share = config.gpu_memory_utilization * torch.cuda.mem_get_info(device)[1]
        budget = share - used
        why = (f"gpu_memory_utilization={config.gpu_memory_utilization} gives this engine "
               f"{share / GiB:.2f} GiB; its weights, activations and CUDA graphs take "
               f"{used / GiB:.2f} GiB of it. Raise gpu_memory_utilization, lower "
               "max_num_batched_tokens, or pass num_kv_blocks= or kv_cache_memory=")
    else:
        budget = CPU_KV_CACHE_BYTES
        why = "the CPU default"
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"no room for one KV-cache block of {bytes_per_block} bytes: {why}")
    return blocks


def allocate_kv_cache(model_config: ModelConfig, layers: list, num_blocks: int,
                      block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cache of every layer in one tensor; each attention layer gets its K and V slices."""
    heads = model_config.num_kv_heads // distributed.tp_size()  # this rank's share
    shape = (2, model_config.num_layers, num_blocks, block_size, heads, model_config.head_dim)
    # Zeros, not empty: the torch backend reads (masked) padding slots, and garbage
    # NaNs there would survive the mask (0 * NaN = NaN).
    cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache

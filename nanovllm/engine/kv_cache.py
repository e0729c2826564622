"""How many KV-cache blocks fit, and the one tensor that holds them (chapters 03 and 11).

On a GPU the engine loads the weights, runs one forward pass of its largest step to measure
the activations, and gives the cache what is left of the allowed share of the memory
(``gpu_memory_utilization``); on a CPU, or with ``kv_cache_memory``, the budget is a number
of bytes. Either way it is rounded down to whole blocks. The cache is then one zeroed tensor
``[2, layers, blocks, block_size, kv_heads, head_dim]``, and each attention layer holds its
two slices. ``ModelRunner`` (``model_runner.py``) calls these once, at start-up.
"""

from __future__ import annotations

import torch

from nanovllm import distributed
from nanovllm.config import EngineConfig
from nanovllm.models import ModelConfig

CPU_KV_CACHE_BYTES = 1 << 30
SIZING_TOKENS = 4096  # tokens of the pass that sizes the activations (activation_bytes)


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of this rank's cache (its 1/tp_size of the KV heads)."""
    per_token = model_config.kv_bytes_per_token(kv_dtype.itemsize)
    return per_token // distributed.tp_size() * block_size


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


def kv_budget_in_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int,
                        activations: float = 0.0) -> int:
    """Whole blocks of cache this rank can hold (``activations``: ``activation_bytes``)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Room the activations took during the sizing pass must stay free for real steps.
        budget = free - (1 - config.gpu_memory_utilization) * total - activations
    else:
        budget = CPU_KV_CACHE_BYTES
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"the KV-cache budget ({budget / 2**30:.2f} GiB) does not hold one block; on a "
            "GPU another engine in this process may hold the memory (delete it), or pass "
            "num_kv_blocks= or kv_cache_memory= explicitly"
        )
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

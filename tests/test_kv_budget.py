"""The KV-cache budget on a GPU, on a faked device (``nanovllm/engine/kv_cache.py``).

``gpu_memory_utilization`` is an engine's share of the GPU, as in vLLM: the cache gets that
share less what the engine itself takes (weights, activations, graphs). Other processes'
memory, and other engines' in this process, must not shrink it, only be refused when the
share does not fit in what is free. ``FakeGPU`` stands in for ``torch.cuda``'s memory
queries: a 140 GiB card, with other processes' memory and this process's tensors.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.config import EngineConfig
from nanovllm.configs import config_path
from nanovllm.engine import kv_cache
from nanovllm.engine.kv_cache import GiB, claim_gpu_share, engine_bytes, kv_budget_in_blocks

CUDA = torch.device("cuda", 0)
BLOCK = 2 * GiB // 1024  # bytes of one block: 2 MiB, so blocks = GiB * 512
WEIGHTS, ACTIVATIONS = 3 * GiB, 1 * GiB


class FakeGPU:
    """A card of ``total`` bytes; ``others`` taken by other processes; this process's
    tensors (``allocated``) sit in PyTorch's reserved blocks, whose growth the driver sees."""

    def __init__(self, total: int = 140 * GiB, others: int = 0) -> None:
        self.total, self.others = total, others
        self.allocated = self.reserved = 0
        self.context = GiB // 2  # CUDA's context: the first query creates it

    def take(self, nbytes: int) -> None:  # a tensor: a new reserved block
        self.allocated += nbytes
        self.reserved += nbytes

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.others - self.context - self.reserved, self.total

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)


def config(util: float, **options) -> EngineConfig:
    return EngineConfig(model=str(config_path("smollm2-135m")), device="cpu",
                        gpu_memory_utilization=util, max_num_seqs=256,
                        max_num_batched_tokens=8192, **options)


def start_engine(gpu: FakeGPU, util: float) -> int:
    """What the model runner does: snapshot, load, size, allocate; returns its blocks."""
    cfg = config(util)
    at_start = claim_gpu_share(cfg, CUDA)
    gpu.take(WEIGHTS)
    used = engine_bytes(at_start, cfg, CUDA, ACTIVATIONS, with_graphs=True)
    blocks = kv_budget_in_blocks(cfg, CUDA, BLOCK, used)
    gpu.take(blocks * BLOCK + int(ACTIVATIONS))  # the cache, and room for the largest step
    return blocks


def test_the_budget_is_the_share_less_what_the_engine_takes(monkeypatch):
    gpu = FakeGPU(others=60 * GiB)  # another process: it must not enter the budget
    gpu.install(monkeypatch)
    blocks = start_engine(gpu, 0.4)
    graphs = ACTIVATIONS * 256 / 8192
    assert blocks == int((0.4 * 140 * GiB - WEIGHTS - ACTIVATIONS - graphs) // BLOCK)


def test_two_engines_at_045_share_one_gpu(monkeypatch):
    gpu = FakeGPU()
    gpu.install(monkeypatch)
    first, second = start_engine(gpu, 0.45), start_engine(gpu, 0.45)
    assert first == second > 0
    assert gpu.allocated <= 0.9 * gpu.total  # both within their shares


def test_two_processes_at_045_share_one_gpu(monkeypatch):
    """The second process sees the first one's memory as another process's."""
    first = FakeGPU()
    first.install(monkeypatch)
    start_engine(first, 0.45)
    second = FakeGPU(others=first.reserved + first.context)
    second.install(monkeypatch)
    assert start_engine(second, 0.45) > 0


def test_a_share_larger_than_what_is_free_is_refused_naming_both(monkeypatch):
    FakeGPU(others=70 * GiB).install(monkeypatch)  # another process holds half the card
    with pytest.raises(ValueError) as err:
        claim_gpu_share(config(0.9), CUDA)
    message = str(err.value)
    assert "gpu_memory_utilization=0.9" in message and "126.00 GiB" in message
    assert "69.50 GiB are free" in message and "at most 0.49 here" in message


def test_a_third_engine_in_the_process_is_refused(monkeypatch):
    gpu = FakeGPU()
    gpu.install(monkeypatch)
    start_engine(gpu, 0.45)
    start_engine(gpu, 0.45)
    with pytest.raises(ValueError, match="another engine in this process"):
        start_engine(gpu, 0.2)


def test_pytorchs_cached_blocks_count_as_free(monkeypatch):
    """An engine shut down without ``empty_cache`` left its blocks in PyTorch's cache."""
    gpu = FakeGPU()
    gpu.install(monkeypatch)
    gpu.reserved = 100 * GiB  # cached, no live tensor
    assert claim_gpu_share(config(0.9), CUDA) is not None


def test_a_share_too_small_for_the_weights_says_why(monkeypatch):
    gpu = FakeGPU()
    gpu.install(monkeypatch)
    with pytest.raises(ValueError, match=r"gives this engine 1\.40 GiB.*take 4\.03 GiB"):
        start_engine(gpu, 0.01)


def test_explicit_budgets_skip_the_share(monkeypatch):
    FakeGPU(others=139 * GiB).install(monkeypatch)  # nearly full: explicit budgets still go
    assert claim_gpu_share(config(0.9, kv_cache_memory=GiB), CUDA) is None
    assert kv_budget_in_blocks(config(0.9, kv_cache_memory=GiB), CUDA, BLOCK) == 512
    assert kv_budget_in_blocks(config(0.9, num_kv_blocks=7), CUDA, BLOCK) == 7
    assert engine_bytes(None, config(0.9), CUDA, ACTIVATIONS, True) == 0.0


def test_another_process_allocating_meanwhile_changes_nothing(monkeypatch):
    """Two replicas starting together: the other's cache appears while this one loads."""
    gpu = FakeGPU()
    gpu.install(monkeypatch)
    cfg = config(0.45)
    at_start = claim_gpu_share(cfg, CUDA)
    gpu.take(WEIGHTS)
    gpu.others += 60 * GiB
    assert engine_bytes(at_start, cfg, CUDA, 0.0, with_graphs=False) == WEIGHTS


def test_cpu_budget_is_unchanged():
    assert kv_budget_in_blocks(config(0.9), torch.device("cpu"), BLOCK) == (
        kv_cache.CPU_KV_CACHE_BYTES // BLOCK)

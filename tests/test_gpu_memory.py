"""An engine gives its memory back, and engines share a GPU by ``gpu_memory_utilization``.

``LLM.shutdown()`` (also leaving ``with LLM(...)``, and ``AsyncEngine.shutdown``) frees the
KV cache, the CUDA graphs and the weights, so a second engine in the same process gets the
memory; ``del llm`` frees the same, without waiting for the garbage collector. On a CPU the
tests check that the tensors are gone; on a GPU (``@pytest.mark.gpu``) that
``torch.cuda.memory_allocated()`` comes back, and that two engines at 0.45 each, in one
process or in two, fit on one GPU and generate (replicas, chapter 17). The budget formula
itself is ``tests/test_kv_budget.py``'s.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path
from nanovllm.context import attention_metadata, get_attention_metadata
from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.engine.model_runner import EngineShutDownError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 20, list(range(1000, 1003))]
MiB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """SmolLM2's shape with 2 layers and no tokenizer: random (dummy) weights, CPU-sized."""
    config = json.loads((config_path("smollm2-135m") / "config.json").read_text())
    config["num_hidden_layers"] = 2
    folder = tmp_path_factory.mktemp("tiny-smollm2")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def cpu_llm(path: str) -> LLM:
    return LLM(path, load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=32,
               max_model_len=256)


def device_state(llm: LLM) -> dict[str, weakref.ref]:
    runner = llm.engine.runner
    return {"model": weakref.ref(runner.model), "kv_cache": weakref.ref(runner.kv_cache)}


def test_shutdown_frees_the_model_and_cache_and_later_use_raises(tiny):
    llm = cpu_llm(tiny)
    reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    state = device_state(llm)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert all(ref() is None for ref in state.values())
    with pytest.raises(EngineShutDownError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.engine.requests  # the failed call left nothing behind
    with cpu_llm(tiny) as second:  # a second engine works as the first did
        state = device_state(second)
        assert [o.token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)] == [
            o.token_ids for o in reference]
    assert all(ref() is None for ref in state.values())  # leaving `with` shut it down


def test_del_frees_without_the_garbage_collector(tiny):
    """No reference cycle holds the runner: `del llm` frees its tensors at once."""
    llm = cpu_llm(tiny)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    state = {**device_state(llm), "runner": weakref.ref(llm.engine.runner)}
    gc.disable()
    try:
        del llm
        assert {name: ref() is None for name, ref in state.items()} == dict.fromkeys(state, True)
    finally:
        gc.enable()


def test_async_engine_shutdown_frees_its_engine(tiny):
    engine = AsyncEngine(cpu_llm(tiny).engine)
    assert engine.submit(PROMPTS[0], GREEDY).result(60).finish_reason == "length"
    state = {"model": weakref.ref(engine.engine.runner.model)}
    engine.shutdown()
    assert state["model"]() is None and not engine.is_running


def _generate_concurrently(engines: list[AsyncEngine]) -> list[list[list[int]]]:
    """Each engine's greedy tokens for PROMPTS, all engines submitting at once."""
    results: list = [None] * len(engines)

    def client(i: int) -> None:
        streams = [engines[i].submit(p, GREEDY) for p in PROMPTS]
        results[i] = [s.result(120).token_ids for s in streams]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_each_thread_reads_its_own_attention_metadata():
    """Two engines in one process step on their own threads at the same time (replicas):
    each layer must read its own engine's step, not the one set last (context.py)."""
    mine, theirs = object(), object()
    entered, done = threading.Event(), threading.Event()

    def other_engine() -> None:
        with attention_metadata(theirs):
            entered.set()
            done.wait(10)

    thread = threading.Thread(target=other_engine)
    with attention_metadata(mine):
        thread.start()
        assert entered.wait(10)
        seen = get_attention_metadata()
        done.set()
    thread.join()
    assert seen is mine and get_attention_metadata() is None


# -- on a GPU -----------------------------------------------------------------------------
SMOLLM2 = str(config_path("smollm2-135m"))  # the whole shape, dummy weights
GPU_OPTIONS = dict(load_format="dummy", max_num_seqs=64)


@pytest.fixture(scope="module")
def warm_process():
    """One engine built and shut down first: what the process keeps for good after its first
    engine (cuBLAS's workspaces, one per stream) is then in the baseline."""
    LLM(SMOLLM2, gpu_memory_utilization=0.3, **GPU_OPTIONS).shutdown()


def _clean_gpu() -> tuple[int, int]:
    """Free what earlier tests left in PyTorch's cache; (allocated, free) bytes now."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("release", ["shutdown", "del"])
@pytest.mark.gpu
def test_a_second_engine_gets_the_memory_back(release, warm_process):
    allocated, free = _clean_gpu()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(SMOLLM2, gpu_memory_utilization=0.8, **GPU_OPTIONS)
    kv = llm.engine.runner.kv_cache
    kv_bytes = kv.numel() * kv.element_size()
    assert llm.engine.runner.graphs is not None and kv_bytes > 0.7 * total
    del kv
    reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    if release == "shutdown":
        llm.shutdown()
        with pytest.raises(EngineShutDownError):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm  # (after a shutdown: the Python object only)
    after = torch.cuda.memory_allocated()
    print(f"\n[{release}] allocated {allocated / MiB:.1f} MiB before, {after / MiB:.1f} MiB "
          f"after (KV cache {kv_bytes / 2**30:.1f} GiB); driver free "
          f"{free / 2**30:.2f} -> {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")
    assert after - allocated < kv_bytes / 100  # the cache at once
    # Seen on the H200 after `del` alone: the weights' size (~260 MiB) waited for the
    # garbage collector (a reference cycle on the GPU path only; the CPU path has none).
    gc.collect()
    assert torch.cuda.memory_allocated() - allocated < 8 * MiB
    second = LLM(SMOLLM2, gpu_memory_utilization=0.8, **GPU_OPTIONS)  # 0.8 + 0.8 > 1
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    second.shutdown()
    assert torch.cuda.memory_allocated() - allocated < 8 * MiB


@pytest.mark.gpu
def test_two_engines_at_045_in_one_process():
    _clean_gpu()
    engines = [AsyncEngine.from_model(SMOLLM2, gpu_memory_utilization=0.45, **GPU_OPTIONS)
               for _ in range(2)]
    try:
        blocks = [e.engine.runner.num_kv_blocks for e in engines]
        print(f"\ntwo engines at 0.45 in one process: {blocks} KV blocks")
        assert abs(blocks[0] - blocks[1]) < 0.02 * blocks[0]
        first, second = _generate_concurrently(engines)
        assert first == second and all(len(t) == GREEDY.max_tokens for t in first)
    finally:
        for engine in engines:
            engine.shutdown()


REPLICA = """
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], load_format="dummy", max_num_seqs=64, gpu_memory_utilization=0.45)
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps({"blocks": llm.engine.runner.num_kv_blocks, "tokens": out[0].token_ids}))
"""


@pytest.mark.gpu
def test_two_processes_at_045_start_together():
    _clean_gpu()
    env = {**os.environ, "TQDM_DISABLE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", REPLICA, SMOLLM2], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\ntwo processes at 0.45: {[r['blocks'] for r in results]} KV blocks")
    assert results[0]["tokens"] == results[1]["tokens"]

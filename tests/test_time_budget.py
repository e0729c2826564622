"""Repeating a workload as if on a fresh engine (``reset_prefix_cache``) and the pieces of
``python -m nanovllm.benchmarks.time_budget`` that run on a CPU (issue 17; chapter 11)."""

from __future__ import annotations

import pytest
from test_scheduler import make_tiny_llama, one_torch_thread  # noqa: F401 (autouse fixture)

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.time_budget import OTHER, kernel_kind, main, run_summary
from nanovllm.benchmarks.workload import make_workload, run_workload
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sliding_window import SlidingWindowBlockManager

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 300 + 1 for j in range(40 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return LLM(str(path), device="cpu", num_kv_blocks=64, block_size=16)


def cached_tokens(outs) -> list[int]:
    return [o.metrics.num_cached_prompt_tokens for o in outs]


def test_reset_prefix_cache_makes_a_repeat_compute_its_prompts_again(llm):
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(n > 0 for n in cached_tokens(again))  # without a reset: served from the cache
    assert llm.reset_prefix_cache()
    fresh = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert cached_tokens(fresh) == [0, 0, 0]
    assert [o.token_ids for o in fresh] == [o.token_ids for o in first]


def test_reset_prefix_cache_is_refused_while_a_request_runs(llm):
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    engine.step()
    hashes = dict(engine.block_manager.hash_to_block)
    assert hashes and not llm.reset_prefix_cache()
    assert engine.block_manager.hash_to_block == hashes  # nothing changed
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() and not engine.block_manager.hash_to_block


def test_reset_keeps_the_sliding_window_null_block():
    bm = SlidingWindowBlockManager(8, 4, window=6)
    seq = Sequence(list(range(1, 14)), GREEDY)
    assert bm.allocate(seq, 13)
    seq.num_computed_tokens = 13  # as if the step ran: free keeps the computed blocks' hashes
    assert not bm.reset_prefix_cache()
    bm.free(seq)
    assert bm.hash_to_block and bm.reset_prefix_cache()
    assert not bm.hash_to_block and bm.null_block not in bm.free_ids
    assert bm.blocks[bm.null_block].ref_count == 1 and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    "name, kind",
    [
        ("_decode_split_kernel", "decode attention"),
        ("_combine_splits_kernel", "decode attention"),
        ("_prefill_attention_kernel", "prefill attention"),
        ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", "matmul"),
        ("_int8_gemm_kernel", "matmul"),
        ("_store_kv_kernel", "norm, RoPE, activation, KV store"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampling"),
        ("Memcpy HtoD (Pinned -> Device)", OTHER),
    ],
)
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_run_summary_splits_a_run_into_prefill_and_decode_steps(llm):
    llm.reset_prefix_cache()
    work = make_workload("cpu", 4)
    seconds, _ = run_workload(llm, work)
    summary = run_summary(llm, seconds, work.output_tokens)
    steps = llm.engine.stats.to_records()
    assert summary["steps"] == len(steps) > summary["prefill_steps"] > 0
    wall = sum(s["end"] - s["start"] for s in steps)
    assert summary["prefill_step_seconds"] + summary["decode_step_seconds"] == pytest.approx(wall)
    assert summary["tok_s"] == pytest.approx(work.output_tokens / seconds)


def test_the_tool_refuses_to_run_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["--runs", "1"])
    assert "needs a GPU" in capsys.readouterr().err

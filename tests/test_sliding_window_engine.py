"""Blocks outside a sliding window go back to the pool: the engine with a tiny random Mistral
(nanovllm/engine/sliding_window.py, chapter 12 §4; the manager alone: test_sliding_window.py).

Greedy tokens equal to transformers' with prompts several windows long, under chunked
prefill, preemption, prefix caching (also adopting blocks a running sequence released) and
async scheduling; a long sequence holding about ceil(W / block_size) + 1 blocks where chapter
04's manager holds them all; more sequences decoding at once; released blocks filled with NaN
without changing a token, on the torch and the Triton backend (and one block released too
early does change them); the leak check's window rules. The leak check (tests/conftest.py)
runs after every engine step throughout.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.invariants import InvariantError, check_invariants
from nanovllm.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")


def _tiny_mistral(path, window: int):
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=window, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:  # larger weights than the default init: greedy tokens that vary
                p.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=[20, 16], ids=["W20", "W16"])
def mistral(request, tmp_path_factory):
    window = request.param
    path = tmp_path_factory.mktemp(f"mistral-w{window}")
    return window, _tiny_mistral(path, window), path, {}


def _prompts(n_each: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (40,), generator=gen).tolist()  # a prefix two prompts share
    return [shared + torch.randint(0, 256, (n - 40,), generator=gen).tolist() if n > 40
            else torch.randint(0, 256, (n,), generator=gen).tolist() for n in n_each]


def _expected(mistral, prompt: list[int], n: int) -> list[int]:
    _, hf, _, memo = mistral
    key = (tuple(prompt), n)
    if key not in memo:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        memo[key] = out[0, len(prompt):].tolist()
    return memo[key]


def _run(path, prompts, max_tokens, free_window=True, **options):
    """Generate step by step; returns (tokens per prompt, llm, peak blocks each held, most
    sequences decoding at once). ``free_window=False``: chapter 04's manager instead."""
    # an explicit KV budget: on a GPU the default takes most of its memory, engine after engine
    llm = LLM(path, dtype="float32", attention_backend="torch",
              **{"num_kv_blocks": 64, **options})
    engine = llm.engine
    if not free_window:  # the same engine with a manager that frees nothing before the end
        old = engine.block_manager
        engine.block_manager = engine.scheduler.block_manager = BlockManager(
            len(old.blocks), old.block_size, old.enable_prefix_caching)
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True)) for p in prompts]
    seqs = {i: engine.requests[i] for i in ids}
    tokens, peak, running = {i: [] for i in ids}, Counter(), 0
    null = engine.block_manager.null_block
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        running = max(running, sum(1 for s in engine.scheduler.running
                                   if s.num_computed_tokens >= s.num_prompt_tokens))
        for i, seq in seqs.items():
            peak[i] = max(peak[i], sum(1 for b in seq.block_table if b != null))
    return [tokens[i] for i in ids], llm, [peak[i] for i in ids], running


OPTIONS = {
    "chunked": dict(block_size=8, max_num_batched_tokens=16),
    "chunked-async": dict(block_size=16, max_num_batched_tokens=24, async_scheduling=True),
    "preempt": dict(block_size=8, num_kv_blocks=14, max_num_batched_tokens=32,
                    enable_prefix_caching=False),
    "preempt-prefix-async": dict(block_size=8, num_kv_blocks=14, async_scheduling=True,
                                 max_num_batched_tokens=32),
    "prefix-cache": dict(block_size=16, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_greedy_tokens_equal_transformers_with_blocks_released(mistral, name):
    window, _, path, _ = mistral
    options = OPTIONS[name]
    prompts = _prompts((70, 45, 90, 23, 80, 60) if "preempt" in name else (70, 45, 90, 23))
    if name == "prefix-cache":  # the same prompts twice: the second round adopts the chains
        prompts = prompts + prompts
    outs, llm, _, _ = _run(path, prompts, 12, **options)
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    assert bm.num_released > 0
    if "preempt" in name:
        assert sched.num_preemptions > 0
    if name == "prefix-cache":
        assert bm.prefix_hit_rate > 0.3
    for prompt, out in zip(prompts, outs):
        assert out == _expected(mistral, prompt, 12)
    assert bm.num_free_blocks == bm.num_blocks  # everything back, the null block aside


def test_released_blocks_of_a_running_sequence_serve_a_later_request(mistral):
    window, _, path, _ = mistral
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=8, num_kv_blocks=64,
              max_num_batched_tokens=32)
    engine, first = llm.engine, _prompts((90,))[0]
    later = first[:72] + [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {"first": [], "later": []}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    engine.add_request("first", first, params)
    while engine.requests["first"].num_released_blocks * 8 < 64:
        step()
    engine.add_request("later", later, params)
    step()
    # "first" still runs; "later" adopted the 9 blocks of their 72 shared tokens, at least 8
    # of them blocks "first" had released
    assert "first" in engine.requests
    assert engine.requests["later"].metrics.num_cached_prompt_tokens == 72
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"first": _expected(mistral, first, 12),
                      "later": _expected(mistral, later, 12)}


def test_a_long_sequence_holds_about_a_window_of_blocks(mistral):
    window, _, path, _ = mistral
    bs, chunk, n = 8, 16, 40
    prompts = _prompts((120, 5))  # a long prompt in chunks; a short one, then decodes only
    outs, llm, (long_peak, short_peak), _ = _run(path, prompts, n, block_size=bs,
                                                 max_num_batched_tokens=chunk)
    assert outs == [_expected(mistral, p, n) for p in prompts]
    # the window, the step's chunk, and a block of misalignment
    assert long_peak <= math.ceil((window - 1 + chunk) / bs) + 1
    assert short_peak <= math.ceil(window / bs) + 1  # decodes: the window and one block
    # the plain manager (chapter 04) holds every block until the end (seen between steps:
    # the last step, which computes token len + n - 2, frees them as it ends)
    _, _, plain_peaks, _ = _run(path, prompts, n, free_window=False, block_size=bs,
                                max_num_batched_tokens=chunk)
    assert plain_peaks == [math.ceil((len(p) + n - 2) / bs) for p in prompts]
    assert plain_peaks[0] > 3 * long_peak


def test_more_sequences_run_at_once(mistral):
    window, _, path, _ = mistral
    prompts, n = _prompts((60, 61, 62, 63, 64, 65)), 30
    options = dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=32)
    freed, llm, _, decoding = _run(path, prompts, n, **options)
    kept, plain, _, plain_decoding = _run(path, prompts, n, free_window=False, **options)
    assert freed == kept == [_expected(mistral, p, n) for p in prompts]
    assert decoding == len(prompts) > plain_decoding
    assert llm.engine.scheduler.num_preemptions < plain.engine.scheduler.num_preemptions


def _poison_released(llm: LLM, too_early: bool = False) -> None:
    """Fill every block the window releases (and nobody else holds) with NaN, as if another
    request had written garbage there; ``too_early``: also the first block still visible."""
    bm, cache = llm.engine.block_manager, llm.engine.runner.kv_cache
    release = bm.release_outside_window

    def poisoning(seq: Sequence) -> int:
        start = seq.num_released_blocks
        before = list(seq.block_table)
        released = release(seq)
        for b in before[start : start + released + too_early]:
            if bm.blocks[b].ref_count <= too_early:
                cache[:, :, b] = float("nan")
        return released

    bm.release_outside_window = poisoning


@pytest.mark.parametrize("backend, block_size, async_scheduling", [
    ("torch", 8, False), ("torch", 8, True),
    # Triton (the interpreter on CPU): its prefill tiles of 32 keys start in released slots
    pytest.param("triton", 16, False, marks=pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs triton")),
], ids=["torch-sync", "torch-async", "triton"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaNs
def test_no_query_reads_a_released_block(mistral, backend, block_size, async_scheduling):
    window, _, path, _ = mistral
    prompts, n = _prompts((70, 45)), 16
    options = dict(dtype="float32", attention_backend=backend, block_size=block_size,
                   max_num_batched_tokens=16 if backend == "torch" else 32,
                   enable_prefix_caching=False, async_scheduling=async_scheduling,
                   enforce_eager=True, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    expected = [_expected(mistral, p, n) for p in prompts]
    for too_early in (False, True):
        llm = LLM(path, **options)
        _poison_released(llm, too_early)
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.block_manager.num_released > 0
        # released blocks are never read; one block more and the NaN reaches the tokens
        assert (outs == expected) is not too_early


def test_leak_check_understands_released_slots(mistral):
    window, _, path, _ = mistral
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=8, num_kv_blocks=64,
              max_num_batched_tokens=16)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("long", _prompts((90,))[0], SamplingParams(max_tokens=8))
    for _ in range(4):
        engine.step()
    seq = engine.requests["long"]
    assert seq.num_released_blocks > 0
    check_invariants(engine)  # silent on a correct state
    bm.window = 1  # a release that ignores the window frees blocks a query still sees
    bm.release_outside_window(seq)
    bm.window = window
    with pytest.raises(InvariantError, match="a future query still sees"):
        check_invariants(engine)
    engine.abort_request("long")
    # a released slot given a real block behind the manager's back, and the null block freed
    engine.add_request("again", _prompts((90,))[0], SamplingParams(max_tokens=8))
    for _ in range(4):
        engine.step()
    seq = engine.requests["again"]
    seq.block_table[0] = next(iter(bm.free_ids))
    bm.free_ids[bm.null_block] = None
    with pytest.raises(InvariantError) as err:
        check_invariants(engine)
    text = str(err.value)
    assert "not exactly its" in text and "free list" in text

"""The leak check (nanovllm/engine/invariants.py, chapter 13): silent on correct runs with
prefix caching, preemption, aborts and async scheduling; loud, naming the request and the
blocks, on a planted leak, a double free and a corrupted prefix index. And the engine's
autograd guard: no tensor of a step requires grad, even with autograd enabled around it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from course_ids import ENGINE, FIRST_STEP
from test_scheduler import PROMPTS, make_llm, make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.invariants import (
    InvariantError,
    check_invariants,
    check_refcounts,
    checked_steps,
)
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence

CHECK = "13.check_refcounts"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-invariants"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# -- check_refcounts alone (reaches only the 13.check_refcounts region) ------------------
def _held(bm: BlockManager, tokens: list[int], request_id: str) -> Sequence:
    """A sequence given fresh blocks by hand (no other assignment's code runs)."""
    seq = Sequence(tokens, greedy(4), request_id=request_id)
    for _ in range(bm.blocks_needed(len(tokens))):
        block_id, _ = bm.free_ids.popitem(last=False)
        bm.blocks[block_id].ref_count = 1
        seq.block_table.append(block_id)
    return seq


@pytest.mark.assignment(CHECK)
def test_check_refcounts_finds_leaks_double_frees_and_free_list_errors():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = _held(bm, list(range(10)), "a"), _held(bm, list(range(5)), "b")
    assert check_refcounts(bm, [a, b]) == []
    # a holder the check is not told about: its blocks look leaked
    leaked = check_refcounts(bm, [a])
    assert len(leaked) == len(b.block_table)
    assert all("leaked" in p and "ref_count 1 but 0" in p for p in leaked)
    assert all(f"block {blk} " in " ".join(leaked) for blk in b.block_table)
    # a block counted by two holders but referenced once: a double free in the making
    c = Sequence(list(range(4)), greedy(1), request_id="c")
    c.block_table = [a.block_table[0]]
    [under] = check_refcounts(bm, [a, b, c])
    assert "under-counted" in under and "'a'" in under and "'c'" in under
    # a held block that also sits in the free list
    bm.free_ids[a.block_table[1]] = None
    [listed] = check_refcounts(bm, [a, b])
    assert f"block {a.block_table[1]} " in listed and "in the free list" in listed
    del bm.free_ids[a.block_table[1]]
    # the same block twice in one table
    a.block_table.append(a.block_table[0])
    bm.blocks[a.block_table[0]].ref_count += 1
    assert any("'a' holds block(s)" in p and "twice" in p for p in check_refcounts(bm, [a, b]))


@pytest.mark.assignment(CHECK)
def test_check_refcounts_changes_nothing():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = _held(bm, list(range(9)), "x")
    before = ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_ids), seq.block_table[:])
    check_refcounts(bm, [])
    assert ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_ids),
            seq.block_table) == before


def _manager(held: dict[int, int], num_blocks: int = 10) -> BlockManager:
    """A manager whose blocks ``held`` (id -> ref_count) are out of the free list, by hand."""
    bm = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    for block_id, ref_count in held.items():
        del bm.free_ids[block_id]
        bm.blocks[block_id].ref_count = ref_count
    return bm


def _holder(request_id: str, *blocks: int) -> SimpleNamespace:
    """Anything with a request_id and a block_table holds blocks (check_invariants passes
    such stand-ins for a sliding window's manager)."""
    return SimpleNamespace(request_id=request_id, block_table=list(blocks))


def _mentions(problem: str, number: int) -> bool:
    return re.search(rf"(?<![\w.]){number}(?![\w.])", problem) is not None


@pytest.mark.assignment(CHECK)
def test_check_refcounts_silent_on_fresh_and_shared_blocks():
    """All free, nobody holding: fine. A prefix block shared by three requests (ref_count 3)
    and a table holding blocks in any order: fine."""
    assert check_refcounts(BlockManager(num_blocks=5, block_size=4), []) == []
    bm = _manager({7: 3, 2: 1, 5: 1, 0: 2})
    holders = [_holder("ann", 7, 2), _holder("bob", 7, 5, 0), _holder("cy", 7, 0)]
    assert check_refcounts(bm, holders) == []
    assert check_refcounts(bm, reversed(holders)) == []  # any iterable, any order


@pytest.mark.assignment(CHECK)
def test_check_refcounts_names_block_counts_and_holders_of_a_leaked_shared_block():
    """Block 6 has ref_count 3 but only two holders: one problem, naming block 6, the
    ref_count 3, the 2 holders and who they are."""
    bm = _manager({6: 3, 8: 1})
    [problem] = check_refcounts(bm, [_holder("ann", 6, 8), _holder("bob", 6)])
    assert _mentions(problem, 6) and _mentions(problem, 3) and _mentions(problem, 2), problem
    assert "ann" in problem and "bob" in problem
    # and the other way: ref_count 1 under three holders (a double free in the making)
    bm = _manager({6: 1, 8: 1})
    [problem] = check_refcounts(bm, [_holder("ann", 6, 8), _holder("bob", 6), _holder("cy", 6)])
    assert _mentions(problem, 6) and _mentions(problem, 1) and _mentions(problem, 3), problem
    assert all(name in problem for name in ("ann", "bob", "cy"))


@pytest.mark.assignment(CHECK)
def test_check_refcounts_finds_free_list_disagreements_alone():
    """Counts right, free list wrong: a held block listed as free, and a block of
    ref_count 0 (nobody holds it) missing from the free list. One problem each."""
    bm = _manager({4: 1, 9: 0})  # block 9: ref_count 0 but taken out of the free list
    holders = [_holder("ann", 4)]
    [lost] = check_refcounts(bm, holders)
    assert _mentions(lost, 9) and not _mentions(lost, 4), lost
    bm.free_ids[9] = None
    bm.free_ids[4] = None  # held by ann, yet free
    [listed] = check_refcounts(bm, holders)
    assert _mentions(listed, 4) and not _mentions(listed, 9), listed


@pytest.mark.assignment(CHECK)
def test_check_refcounts_counts_a_repeated_block_once_per_occurrence():
    """[5, 5] in one table with ref_count 2: only the repeat is a problem; with ref_count 1
    the count is also off (2 occurrences against 1)."""
    bm = _manager({5: 2})
    [twice] = check_refcounts(bm, [_holder("ann", 5, 5)])
    assert _mentions(twice, 5) and "ann" in twice
    bm.blocks[5].ref_count = 1
    problems = check_refcounts(bm, [_holder("ann", 5, 5)])
    assert len(problems) == 2 and all(_mentions(p, 5) for p in problems), problems


@pytest.mark.assignment(CHECK)
def test_check_refcounts_reports_in_block_order():
    """Mismatches at blocks 9, 3 and 6, holders listed from the last block to the first: the
    problems come in block order 3, 6, 9."""
    bm = _manager({9: 2, 3: 1, 6: 1, 1: 1})
    holders = [_holder("ann", 9), _holder("bob", 6, 3), _holder("cy", 6), _holder("dee", 1)]
    problems = check_refcounts(bm, holders)
    # block 9: ref_count 2, one holder; block 6: ref_count 1, two; block 3: right, for now
    assert [b for p in problems for b in (3, 6, 9) if _mentions(p, b)] == [6, 9], problems
    bm.blocks[3].ref_count = 2
    problems = check_refcounts(bm, holders)
    assert [b for p in problems for b in (3, 6, 9) if _mentions(p, b)] == [3, 6, 9], problems


# -- the engine: correct runs are silent ---------------------------------------------------
@pytest.mark.assignment(*ENGINE, "06.preempt", CHECK)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_correct_runs_pass_with_prefix_caching_preemption_and_aborts(tiny, async_scheduling):
    # 12 blocks of 16 tokens: the 8 prompts (plus repeats, for prefix hits) cannot all fit
    llm = make_llm(tiny, num_kv_blocks=12, max_num_batched_tokens=40,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    with checked_steps(engine):
        for i, prompt in enumerate(PROMPTS + PROMPTS[-3:]):
            engine.add_request(f"r{i}", prompt, greedy(24))
        for step in range(200):
            engine.step()
            if step in (3, 9):  # abort a running and a waiting request mid-flight
                engine.abort_request([f"r{step - 2}", f"r{step + 1}"])
            if not engine.has_unfinished_requests():
                break
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hit_rate > 0
    check_invariants(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# -- the engine: a planted leak is caught and named ----------------------------------------
class ForgetfulScheduler(Scheduler):
    """A scheduler change that forgets to free an aborted request's blocks."""

    def finish(self, seq: Sequence, reason: str) -> None:
        if reason != "abort":
            return super().finish(seq, reason)
        seq.status, seq.finish_reason = type(seq.status).FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        # the bug: no self.block_manager.free(seq)


def _leaky_engine(tiny, **options):
    llm = make_llm(tiny, num_kv_blocks=32, **options)
    engine = llm.engine
    engine.scheduler = ForgetfulScheduler(engine.config, engine.block_manager)
    return engine


@pytest.mark.assignment(*ENGINE, CHECK)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_planted_leak_is_caught_and_named(tiny, async_scheduling):
    engine = _leaky_engine(tiny, async_scheduling=async_scheduling)
    for i, prompt in enumerate(PROMPTS[3:6]):
        engine.add_request(f"req-{i}", prompt, greedy(8))
    with checked_steps(engine):
        for _ in range(3):
            engine.step()
        held = set(engine.requests["req-1"].block_table)
        assert held
        engine.abort_request("req-1")
        with pytest.raises(InvariantError) as caught:
            engine.step()
    message = str(caught.value)
    assert "'req-1'" in message and "abort" in message
    assert "req-0" not in message and "req-2" not in message
    leaked = {b for b in held if f"block {b} leaked" in message}
    assert leaked == held, message


@pytest.mark.assignment(*FIRST_STEP, CHECK)
def test_a_single_check_names_the_leak_it_saw_alive(tiny):
    """Called by hand: the check names a leaker it saw alive at an earlier call; the blocks
    are reported in any case."""
    engine = _leaky_engine(tiny)
    for i, prompt in enumerate(PROMPTS[3:6]):
        engine.add_request(f"req-{i}", prompt, greedy(8))
    engine.step()
    engine.check_invariants()  # remembers who is alive
    engine.abort_request("req-2")
    with pytest.raises(InvariantError, match="'req-2' left the engine"):
        engine.check_invariants()
    with pytest.raises(InvariantError, match="leaked"):
        engine.check_invariants()  # (no longer named: forgotten after one report)


@pytest.mark.assignment(*FIRST_STEP, CHECK)
def test_corrupted_prefix_index_is_caught(tiny):
    llm = make_llm(tiny, num_kv_blocks=32)
    engine = llm.engine
    engine.add_request("p", PROMPTS[-1], greedy(4))
    engine.step()
    check_invariants(engine)
    bm = engine.block_manager
    h, block_id = next(iter(bm.hash_to_block.items()))
    bm.blocks[block_id].token_ids = tuple(reversed(bm.blocks[block_id].token_ids))
    with pytest.raises(InvariantError, match="cached under other tokens"):
        check_invariants(engine)
    bm.hash_to_block[h + 1] = bm.hash_to_block.pop(h)
    with pytest.raises(InvariantError, match="prefix index"):
        check_invariants(engine)


# -- autograd: the engine's guard ----------------------------------------------------------
@pytest.mark.assignment(*ENGINE)
def test_no_step_tensor_requires_grad(tiny):
    """Even with autograd on around it, a step builds no graph: every module's output is
    made under inference mode and requires no grad (chapter 13, autograd left on)."""
    llm = make_llm(tiny, num_kv_blocks=32)
    model = llm.engine.runner.model
    seen: list[tuple[str, bool, bool]] = []

    def record(module, args, output):
        outs = output if isinstance(output, tuple) else (output,)
        for t in outs:
            if isinstance(t, torch.Tensor):
                seen.append((type(module).__name__, t.requires_grad, t.is_inference()))

    hooks = [m.register_forward_hook(record) for m in model.modules()]
    try:
        with torch.enable_grad():
            outs = llm.generate(PROMPTS[:3], greedy(4), use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert seen and not any(grad for _, grad, _ in seen), [s for s in seen if s[1]]
    assert all(inference for _, _, inference in seen)
    # (some parameters, e.g. the norms', do require grad: inference mode is what guards)
    assert not llm.engine.runner.kv_cache.requires_grad

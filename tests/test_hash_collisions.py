"""A hash collision can cost a prefix-cache hit, never serve another prefix's keys and values
(chapter 04 §3.2). The block manager compares the whole chain: a cached block is adopted only if
its tokens match *and* it continues the block accepted just before it. These tests swap in
deliberately weak hashes so that collisions happen on purpose."""

from __future__ import annotations

import importlib.util

import pytest
from course_ids import ENGINE

from nanovllm import LLM, SamplingParams
from nanovllm.engine import block_manager
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8)


def chapter_weak_hash(parent: int | None, tokens: list[int]) -> int:
    """Chapter 04's weak hash: any reordering of a block's tokens collides."""
    return (parent or 0) * 31 + sum(tokens)


def parent_blind_hash(parent: int | None, tokens: list[int]) -> int:
    """Worse: ignores the prefix, so equal blocks after different prefixes always collide."""
    return hash(tuple(tokens)) & (2**64 - 1)


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence admitted with the cache's help and fully computed (its blocks registered)."""
    seq = Sequence(tokens, PARAMS)
    cached = bm.cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * BLOCK, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq, seq.num_tokens)
    return seq


@pytest.mark.assignment("04.cached_prefix", "04.allocate")
def test_same_block_after_another_prefix_is_not_adopted(monkeypatch):
    """Issue 16's case, under the chapter's weak hash: c's first block is cached; a's first block
    collides with it (same sum) and its second block y is cached under the colliding chain; a
    request b = c's first block + y must not adopt a's y (computed after a's prefix)."""
    monkeypatch.setattr(block_manager, "chain_hash", chapter_weak_hash)
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    c = computed(bm, [1, 2, 3, 4] + [5, 5, 5, 5] + [0])
    a = computed(bm, [4, 3, 2, 1] + [9, 8, 7, 6] + [0])  # block 0: same weak hash as c's
    b = Sequence([1, 2, 3, 4] + [9, 8, 7, 6] + [0], PARAMS)
    y_key = chapter_weak_hash(chapter_weak_hash(None, [1, 2, 3, 4]), [9, 8, 7, 6])
    # The collision is real: b's key for block 1 is a key the cache knows, holding equal tokens.
    if y_key in bm.hash_to_block:
        assert bm.blocks[bm.hash_to_block[y_key]].token_ids == (9, 8, 7, 6)
        assert bm.hash_to_block[y_key] == a.block_table[1]
    assert bm.cached_prefix(b) == [c.block_table[0]]  # c's own block 0, nothing of a's


@pytest.mark.assignment("04.cached_prefix", "04.allocate")
def test_equal_parent_hash_is_not_enough(monkeypatch):
    """With a hash that ignores the prefix, block 1 of two prompts collides whenever its tokens
    are equal; the lookup must still tell the prefixes apart."""
    monkeypatch.setattr(block_manager, "chain_hash", parent_blind_hash)
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a = computed(bm, [1, 1, 1, 1] + [7, 7, 7, 7] + [0])
    d = computed(bm, [2, 2, 2, 2] + [0])  # caches the block [2, 2, 2, 2] alone
    b = Sequence([2, 2, 2, 2] + [7, 7, 7, 7] + [0], PARAMS)
    key = parent_blind_hash(None, [7, 7, 7, 7])
    assert bm.hash_to_block[key] == a.block_table[1]  # the colliding block is cached...
    assert bm.cached_prefix(b) == [d.block_table[0]]  # ...and not adopted
    # A true repeat of a's prompt still finds both of its blocks.
    repeat = Sequence([1, 1, 1, 1] + [7, 7, 7, 7] + [3], PARAMS)
    assert bm.cached_prefix(repeat) == a.block_table[:2]


@pytest.mark.assignment("04.cached_prefix", "04.allocate", "04.free")
def test_recycled_parent_invalidates_its_children(monkeypatch):
    """A parent block recycled for other tokens takes a new serial: its old child, still cached,
    no longer continues it, even when the new chain's hash collides with the old one."""
    monkeypatch.setattr(block_manager, "chain_hash", parent_blind_hash)
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    a = computed(bm, [1, 1, 1, 1] + [7, 7, 7, 7])  # two full blocks, both registered
    parent, child = a.block_table
    bm.free(a)  # tail first: the child is recycled last... so take the parent by hand
    bm.free_ids.move_to_end(parent, last=False)
    e = computed(bm, [5, 5, 5, 5])  # recycles the parent block for other tokens
    assert e.block_table == [parent]
    assert bm.hash_to_block[parent_blind_hash(None, [7, 7, 7, 7])] == child  # still cached
    b = Sequence([5, 5, 5, 5] + [7, 7, 7, 7] + [0], PARAMS)
    assert bm.cached_prefix(b) == [parent]  # e's block, and not a's child after it


@pytest.mark.assignment(*ENGINE)
def test_engine_output_is_unchanged_under_a_colliding_hash(smollm2_dir, monkeypatch):
    """End to end: with a hash that ignores the prefix, every block of equal tokens collides
    across prompts; greedy outputs must equal those computed without prefix caching."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Prompts of token ids: different first blocks, identical later blocks.
    tail = [1000 + i for i in range(40)]
    prompts = [[100 + p] * 16 + tail for p in range(3)]
    reference = LLM(smollm2_dir, enable_prefix_caching=False, num_kv_blocks=64)
    expected = [o.token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    monkeypatch.setattr(block_manager, "chain_hash", parent_blind_hash)
    # The test suite's step-by-step invariant check re-hashes blocks: with the same function.
    invariants = importlib.util.find_spec("nanovllm.engine.invariants")
    if invariants is not None:
        monkeypatch.setattr("nanovllm.engine.invariants.chain_hash", parent_blind_hash)
    llm = LLM(smollm2_dir, enable_prefix_caching=True, num_kv_blocks=64)
    got = []
    for p in prompts:  # one at a time, so each finds the previous ones' blocks cached
        got += [o.token_ids for o in llm.generate([p], greedy, use_tqdm=False)]
        keys = {parent_blind_hash(None, tail[i:i + 16]) for i in range(0, 32, 16)}
        assert keys & set(llm.engine.block_manager.hash_to_block)  # the colliding keys are there
    assert got == expected

"""Block-manager invariants under arbitrary allocate / compute / free / preempt sequences
(hypothesis), and prefix caching's observable behaviour (chapter 04)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from nanovllm.engine.block_manager import BlockManager, chain_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=64)
# Prompts drawn from a few shared prefixes, so that prefix-cache hits actually happen.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
prompts = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 5), max_size=9)).map(
    lambda t: t[0] + t[1]
)


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []

    def _admit(self, seq: Sequence) -> bool:
        cached = self.bm.cached_prefix(seq)
        n = seq.num_tokens - len(cached) * BLOCK
        if not self.bm.allocate(seq, n, cached):
            return False
        seq.num_computed_tokens = len(cached) * BLOCK + n  # as the scheduler counts them
        self.bm.cache_full_blocks(seq, seq.num_computed_tokens)
        return True

    @rule(target=seqs, tokens=prompts)
    def add(self, tokens):
        seq = Sequence(tokens, PARAMS)
        if self._admit(seq):
            self.live.append(seq)
        return seq

    @rule(seq=seqs, new=st.lists(st.integers(0, 5), min_size=1, max_size=6))
    def decode(self, seq, new):
        """Generate tokens one at a time, as decode steps do."""
        for token in new:  # the sampled token joins the sequence, then its KV is computed
            if seq not in self.live:
                return
            seq.token_ids.append(token)
            if not self.bm.allocate(seq, 1):
                self._free(seq)  # out of blocks: preempted
                self.live.remove(seq)
                return
            seq.num_computed_tokens += 1
            self.bm.cache_full_blocks(seq, seq.num_computed_tokens)

    def _free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # the scheduler's part of a preemption

    @rule(seq=seqs)
    def finish(self, seq):
        if seq in self.live:
            self._free(seq)
            self.live.remove(seq)

    @rule(seq=seqs)
    def preempt_and_resume(self, seq):
        if seq in self.live:
            self._free(seq)
            self.live.remove(seq)
            if self._admit(seq):
                self.live.append(seq)

    @invariant()
    def reference_counts_equal_holders(self):
        holders = Counter(b for s in self.live for b in s.block_table)
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)

    @invariant()
    def free_and_used_partition_the_cache(self):
        used = {b.block_id for b in self.bm.blocks if b.ref_count > 0}
        assert used.isdisjoint(self.bm.free_ids)
        assert len(used) + self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def tables_cover_computed_tokens(self):
        for s in self.live:
            assert len(s.block_table) * BLOCK >= s.num_computed_tokens
            assert len(set(s.block_table)) == len(s.block_table)  # no block twice in one table

    @invariant()
    def hash_index_is_consistent(self):
        for h, block_id in self.bm.hash_to_block.items():
            block = self.bm.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == BLOCK

    def teardown(self):
        for s in self.live:
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerInvariants = BlockManagerMachine.TestCase
TestBlockManagerInvariants.pytestmark = [
    pytest.mark.assignment("04.cached_prefix", "04.allocate", "04.free")
]
TestBlockManagerInvariants.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)


@pytest.mark.assignment("04.cached_prefix", "04.allocate")
def test_shared_prefix_is_shared_and_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = Sequence(list(range(12)), PARAMS)
    assert bm.allocate(first, 12)
    first.num_computed_tokens = 12
    bm.cache_full_blocks(first, first.num_computed_tokens)
    # the same 12 tokens again: only 2 of 3 full blocks may come from the cache
    again = Sequence(list(range(12)), PARAMS)
    cached = bm.cached_prefix(again)
    assert cached == first.block_table[:2]
    assert bm.allocate(again, 12 - 2 * BLOCK, cached)
    assert again.block_table[:2] == cached and len(again.block_table) == 3
    assert again.num_computed_tokens == 0  # the scheduler counts the cached tokens, not allocate
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]


@pytest.mark.assignment("04.cached_prefix", "04.allocate", "04.free")
def test_allocate_takes_exactly_what_num_blocks_to_allocate_says():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = Sequence(list(range(10)), PARAMS)
    assert bm.num_blocks_to_allocate(first, 10) == 3 and bm.can_allocate(first, 10)
    assert bm.allocate(first, 10)
    first.num_computed_tokens = 10
    bm.free(first)  # its two full blocks stay cached, in the free queue
    first.num_computed_tokens = 0
    again = Sequence(list(range(10)) + [99], PARAMS)
    cached = bm.cached_prefix(again)
    assert len(cached) == 2
    # 11 tokens = 3 blocks: 2 revived from the free queue + 1 fresh
    assert bm.num_blocks_to_allocate(again, 11 - 2 * BLOCK, cached) == 3
    free_before = bm.num_free_blocks
    assert bm.allocate(again, 11 - 2 * BLOCK, cached)
    assert free_before - bm.num_free_blocks == 3
    again.num_computed_tokens = 11
    assert bm.num_blocks_to_allocate(again, 1) == 0  # 12 tokens: the third block has room
    assert bm.num_blocks_to_allocate(again, 2) == 1


@pytest.mark.assignment("04.allocate")
def test_allocate_refuses_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    seq = Sequence(list(range(9)), PARAMS)
    assert not bm.can_allocate(seq, 9)
    assert not bm.allocate(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2 and bm.queried_tokens == 0


def test_num_freeable_blocks_counts_blocks_only_those_sequences_hold():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    a = Sequence(list(range(9)), PARAMS)
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    b = Sequence(list(range(9)), PARAMS)
    cached = bm.cached_prefix(b)  # a's first two blocks
    assert bm.allocate(b, 9 - 2 * BLOCK, cached)
    assert bm.num_freeable_blocks([a]) == 1  # its last block; the shared two stay with b
    assert bm.num_freeable_blocks([b]) == 1
    assert bm.num_freeable_blocks([a, b]) == 4
    assert bm.release_outside_window(a) == 0  # no window: the hook releases nothing


def test_chained_hash_depends_on_the_prefix():
    block = [5, 6, 7, 8]
    assert chain_hash(chain_hash(None, [1, 2, 3, 4]), block) != chain_hash(
        chain_hash(None, [4, 3, 2, 1]), block
    )


@pytest.mark.assignment("04.cached_prefix", "04.allocate")
def test_hash_collision_is_caught_by_comparing_tokens():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = Sequence([1, 2, 3, 4, 5], PARAMS)
    assert bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    bm.cache_full_blocks(seq, seq.num_computed_tokens)
    bm.blocks[seq.block_table[0]].token_ids = (9, 9, 9, 9)  # pretend a different block collided
    assert bm.cached_prefix(Sequence([1, 2, 3, 4, 5], PARAMS)) == []


@pytest.mark.assignment("04.cached_prefix", "04.allocate", "04.free")
def test_freed_blocks_stay_cached_until_recycled_oldest_first():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    a = Sequence([1] * 4 + [2], PARAMS)
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a, a.num_computed_tokens)
    full_block = a.block_table[0]
    bm.free(a)
    assert bm.cached_prefix(Sequence([1] * 4 + [3], PARAMS)) == [full_block]  # still findable
    # Fill the cache with unrelated work: unhashed blocks go first, the cached one last.
    b = Sequence([7] * 12, PARAMS)
    assert bm.allocate(b, 12)
    assert full_block not in b.block_table
    c = Sequence([8] * 4, PARAMS)
    assert bm.allocate(c, 4)
    assert c.block_table == [full_block]  # recycled only when nothing else was free
    assert bm.cached_prefix(Sequence([1] * 4 + [3], PARAMS)) == []

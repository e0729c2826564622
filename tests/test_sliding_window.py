"""Blocks outside a sliding window go back to the pool: the block manager alone
(nanovllm/engine/sliding_window.py, chapter 12 §4).

The release arithmetic against a brute force over the mask's convention (query q sees key k
when q - W < k <= q), at block boundaries, with W a multiple of the block size and not; the
null block, the table's length, the free count, prefix-cache hits on released blocks; and the
bookkeeping under random allocate / compute / release / preempt / finish sequences
(hypothesis), with a window larger and smaller than a block. The engine's side is in
tests/test_sliding_window_engine.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sliding_window import (
    SlidingWindowBlockManager,
    make_block_manager,
    num_blocks_outside_window,
)
from nanovllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)


# -- the arithmetic ----------------------------------------------------------------------
def _brute_force(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks none of whose keys any query at position >= num_computed can see."""
    def seen(k: int) -> bool:  # the query at num_computed sees the oldest keys of all
        return any(q - window < k <= q for q in range(num_computed, num_computed + window + 1))

    n = 0
    while all(not seen(k) for k in range(n * block_size, (n + 1) * block_size)):
        n += 1
    return n


@pytest.mark.parametrize("window, block_size", [(16, 16), (32, 16), (16, 8), (20, 8),
                                                (20, 16), (12, 16), (1, 4), (5, 4)])
def test_release_arithmetic_at_block_boundaries(window, block_size):
    for c in range(0, 4 * window + 3 * block_size):
        assert num_blocks_outside_window(c, window, block_size) == \
            _brute_force(c, window, block_size), c
    # the boundary itself: block 0 goes exactly when the next query no longer sees its last key
    c = block_size + window - 1  # query c sees keys c - window + 1 = block_size on
    assert num_blocks_outside_window(c - 1, window, block_size) == 0
    assert num_blocks_outside_window(c, window, block_size) == 1


def _filled(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence whose whole prompt was computed (as a finished step leaves it)."""
    seq = Sequence(tokens, GREEDY)
    assert bm.allocate(seq, len(tokens), bm.cached_prefix(seq))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq, seq.num_computed_tokens)
    return seq


def test_release_keeps_table_length_and_counts_blocks_free():
    bm = SlidingWindowBlockManager(num_blocks=12, block_size=4, window=6)
    assert bm.num_blocks == 11 == bm.num_free_blocks and bm.usage == 0  # block 0 is the null
    seq = _filled(bm, list(range(30)))  # 8 blocks; the next query (30) sees keys 25..30
    assert bm.num_free_blocks == 3
    assert bm.release_outside_window(seq) == 6  # blocks 0..5 hold tokens 0..23
    assert seq.block_table[:6] == [bm.null_block] * 6 and len(seq.block_table) == 8
    assert bm.num_free_blocks == 9 and bm.release_outside_window(seq) == 0
    assert bm.allocate(seq, 10)  # the table still grows at its end: 40 tokens, 10 slots
    assert len(seq.block_table) == 10 and bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and seq.block_table == []
    assert seq.num_released_blocks == 0
    assert seq.num_computed_tokens == 30  # untouched: resetting it is the scheduler's part
    with pytest.raises(ValueError, match="null block"):
        SlidingWindowBlockManager(num_blocks=1, block_size=4, window=6)
    assert type(make_block_manager(8, 4, True, None)) is BlockManager


def test_released_blocks_stay_cached_and_a_later_request_adopts_the_chain():
    bm = SlidingWindowBlockManager(num_blocks=16, block_size=4, window=3)
    tokens = list(range(100, 126))
    first = _filled(bm, tokens)
    chain = first.block_table[:6]
    bm.release_outside_window(first)  # the window (3 keys) is inside the last block
    assert first.num_released_blocks == 6
    assert all(bm.blocks[b].ref_count == 0 and bm.blocks[b].hash is not None for b in chain)
    # the blocks after the released ones still register: the chain's serial was kept
    first.token_ids += [7, 7, 7, 7, 7, 7]
    assert bm.allocate(first, 6)
    first.num_computed_tokens += 6
    bm.cache_full_blocks(first, first.num_computed_tokens)
    again = Sequence(tokens + [7, 7, 7, 7, 7, 7, 1], GREEDY)
    assert bm.cached_prefix(again) == chain + first.block_table[6:8]
    # another prompt after the same 12 tokens shares 3 blocks, not its own
    other = Sequence(tokens[:12] + [0] * 8, GREEDY)
    assert bm.cached_prefix(other) == chain[:3]
    bm.free(first)
    assert bm.num_free_blocks == bm.num_blocks


def test_without_prefix_caching_released_blocks_are_recycled_first():
    bm = SlidingWindowBlockManager(num_blocks=8, block_size=4, window=4,
                                   enable_prefix_caching=False)
    seq = _filled(bm, list(range(20)))
    released = seq.block_table[:4]
    bm.release_outside_window(seq)
    newcomer = _filled(bm, list(range(8)))
    assert set(newcomer.block_table) <= set(released)


# -- the bookkeeping under random operations ---------------------------------------------
BLOCK, WINDOW = 4, 6
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
prompts = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 5), max_size=9)).map(
    lambda t: t[0] + t[1])


class WindowMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    window = WINDOW

    def __init__(self) -> None:
        super().__init__()
        self.bm = SlidingWindowBlockManager(14, BLOCK, self.window, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.kv: dict[int, tuple] = {}  # what each full block's keys were computed from

    def _compute(self, seq: Sequence, n: int) -> None:
        """The step computes ``n`` tokens: a block that fills holds its whole prefix's KV."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        for i in range(start // BLOCK, seq.num_computed_tokens // BLOCK):
            self.kv[seq.block_table[i]] = tuple(seq.token_ids[: (i + 1) * BLOCK])
        self.bm.cache_full_blocks(seq, seq.num_computed_tokens)

    def _admit(self, seq: Sequence) -> bool:
        cached = self.bm.cached_prefix(seq)
        n = seq.num_tokens - len(cached) * BLOCK
        if not self.bm.allocate(seq, n, cached):
            return False
        seq.num_computed_tokens = len(cached) * BLOCK  # as the scheduler counts them
        self._compute(seq, n)
        return True

    def _free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # the scheduler's part of a preemption

    @rule(target=seqs, tokens=prompts)
    def add(self, tokens):
        seq = Sequence(tokens, GREEDY)
        if self._admit(seq):
            self.live.append(seq)
        return seq

    @rule(seq=seqs, new=st.lists(st.integers(0, 5), min_size=1, max_size=8))
    def decode(self, seq, new):
        for token in new:
            if seq not in self.live:
                return
            self.bm.release_outside_window(seq)  # as the scheduler does before allocating
            seq.token_ids.append(token)
            if not self.bm.allocate(seq, 1):
                self._free(seq)
                self.live.remove(seq)
                return
            self._compute(seq, 1)

    @rule(seq=seqs)
    def finish_or_preempt(self, seq):
        if seq in self.live:
            self._free(seq)
            self.live.remove(seq)

    @invariant()
    def reference_counts_equal_holders(self):
        holders = Counter(b for s in self.live for b in s.block_table if b != self.bm.null_block)
        holders[self.bm.null_block] = 1
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
        used = {b.block_id for b in self.bm.blocks if b.ref_count > 0}
        assert used.isdisjoint(self.bm.free_ids)
        assert len(used) - 1 + self.bm.num_free_blocks == self.bm.num_blocks

    @invariant()
    def released_slots_are_a_prefix_the_window_has_passed(self):
        for s in self.live:
            n = s.num_released_blocks
            assert [b == self.bm.null_block for b in s.block_table] == \
                [i < n for i in range(len(s.block_table))]
            assert n <= num_blocks_outside_window(s.num_computed_tokens, self.window, BLOCK)

    @invariant()
    def a_cache_hit_holds_the_keys_of_the_same_prefix(self):
        for s in self.live:  # released or not, an adopted block was computed after this prefix
            for i, b in enumerate(self.bm.cached_prefix(Sequence(s.token_ids + [0], GREEDY))):
                assert self.kv[b] == tuple(s.token_ids[: (i + 1) * BLOCK])

    def teardown(self):
        for s in self.live:
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks


class SmallWindowMachine(WindowMachine):
    window = 2  # smaller than a block: blocks register after the one before was released


TestWindowBookkeeping = WindowMachine.TestCase
TestSmallWindowBookkeeping = SmallWindowMachine.TestCase
for case in (TestWindowBookkeeping, TestSmallWindowBookkeeping):
    case.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)

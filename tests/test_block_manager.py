"""Block-manager invariants under arbitrary allocate / compute / free / preempt sequences
(hypothesis), and prefix caching's observable behaviour (chapter 04)."""

from __future__ import annotations

import random
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


# -- Own tests: each reaches one assignment region alone -------------------------------------
# A sequence's blocks are set up here without `allocate` (test-local stand-ins below: blocks
# taken from the free queue, adopted or released by hand), so that a test of `cached_prefix`
# or of `free` reaches no other region; a test of `allocate` passes the `cached` list it would
# get from `cached_prefix` (derived by hand) and releases blocks without `free`.


def _hold(bm: BlockManager, seq: Sequence, num_blocks: int, registered: int | None = None):
    """Stand-in for ``allocate``: give ``seq`` ``num_blocks`` fresh blocks from the front of
    the free queue and register the full blocks among its first ``registered`` tokens (all of
    them by default), as the engine does when their computation is scheduled."""
    for _ in range(num_blocks):
        seq.block_table.append(bm._take_free_block())
    bm.cache_full_blocks(seq, seq.num_tokens if registered is None else registered)


def _adopt(bm: BlockManager, seq: Sequence, block_ids: list[int]) -> None:
    """Stand-in for ``allocate`` with a cached prefix: ``seq`` takes a reference to each."""
    for b in block_ids:
        block = bm.blocks[b]
        if block.ref_count == 0:
            del bm.free_ids[b]
        block.ref_count += 1
        seq.block_table.append(b)
        seq.block_hashes.append(block.hash)


def _drop(bm: BlockManager, seq: Sequence) -> None:
    """Stand-in for ``free`` (a fully computed sequence): release its blocks, tail first."""
    for b in reversed(seq.block_table):
        bm._release(bm.blocks[b])
    seq.block_table, seq.block_hashes = [], []


def _state(bm: BlockManager) -> tuple:
    blocks = [(b.ref_count, b.hash, b.token_ids, b.serial, b.parent) for b in bm.blocks]
    return (blocks, list(bm.free_ids), dict(bm.hash_to_block), set(bm.orphans),
            bm.queried_tokens, bm.hit_tokens, bm.next_serial)


# -- 04.cached_prefix --------------------------------------------------------------------------


@pytest.mark.assignment("04.cached_prefix")
def test_cached_prefix_own_finds_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a = Sequence(list(range(12)), PARAMS)
    _hold(bm, a, 3)  # three full blocks, all registered
    t = a.block_table
    # at most (num_tokens - 1) // 4 blocks: the last token is always computed (§3.4)
    for n, expected in [(1, []), (4, []), (5, t[:1]), (8, t[:1]), (9, t[:2]), (12, t[:2]),
                        (13, t[:3]), (16, t[:3])]:
        seq = Sequence(list(range(n)), PARAMS)
        assert bm.cached_prefix(seq) == expected, n
    assert bm.cached_prefix(Sequence(list(range(12)) + [99, 98], PARAMS)) == t


@pytest.mark.assignment("04.cached_prefix")
def test_cached_prefix_own_stops_at_the_first_miss():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a = Sequence(list(range(16)), PARAMS)
    _hold(bm, a, 4)
    t = a.block_table
    probe = list(range(16)) + [1]
    assert bm.cached_prefix(Sequence(probe, PARAMS)) == t
    other_first = [50] + probe[1:]  # block 0 differs: nothing, though blocks 1-3 are equal
    assert bm.cached_prefix(Sequence(other_first, PARAMS)) == []
    other_second = probe[:5] + [50] + probe[6:]  # block 1 differs: block 0 only
    assert bm.cached_prefix(Sequence(other_second, PARAMS)) == t[:1]
    bm._forget(bm.blocks[t[2]])  # block 2 recycled: blocks 0 and 1, not 3 after the gap
    assert bm.cached_prefix(Sequence(probe, PARAMS)) == t[:2]


@pytest.mark.assignment("04.cached_prefix")
@pytest.mark.parametrize("tamper", ["tokens", "parent", "first_parent"])
def test_cached_prefix_own_checks_tokens_and_parent_of_each_candidate(tamper):
    """The hash only finds a candidate; its tokens and its parent serial decide (§3.2)."""
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    a = Sequence(list(range(12)), PARAMS)
    _hold(bm, a, 3)
    first, second, third = (bm.blocks[b] for b in a.block_table)
    assert second.parent == first.serial and third.parent == second.serial  # (the setup)
    probe = Sequence(list(range(13)), PARAMS)
    assert bm.cached_prefix(probe) == a.block_table
    if tamper == "tokens":  # a colliding block: the same hash, other tokens
        second.token_ids = (4, 5, 6, 99)
        expected = a.block_table[:1]
    elif tamper == "parent":  # the same tokens after another prefix
        second.parent = first.serial + 1000
        expected = a.block_table[:1]
    else:  # a first block must continue nothing
        first.parent = third.serial
        expected = []
    assert bm.cached_prefix(probe) == expected


@pytest.mark.assignment("04.cached_prefix")
def test_cached_prefix_own_is_empty_without_caching_or_with_prompt_logprobs():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    _hold(bm, Sequence(list(range(12)), PARAMS), 3)
    tokens = list(range(13))
    assert len(bm.cached_prefix(Sequence(tokens, PARAMS))) == 3
    for k in (0, 2):  # every prompt position must be computed for its logprobs
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k)
        assert bm.cached_prefix(Sequence(tokens, params)) == []
    bm.enable_prefix_caching = False  # (the registered blocks are still there)
    assert bm.cached_prefix(Sequence(tokens, PARAMS)) == []


@pytest.mark.assignment("04.cached_prefix")
def test_cached_prefix_own_changes_nothing():
    bm = BlockManager(num_blocks=10, block_size=BLOCK)
    held = Sequence(list(range(8)) + [1], PARAMS)
    _hold(bm, held, 3)  # blocks 0, 1 registered and held
    gone = Sequence([7] * 9, PARAMS)
    _hold(bm, gone, 3)
    _drop(bm, gone)  # its two registered blocks are free but findable
    before = _state(bm)
    for tokens, hits in [(list(range(8)) + [5], 2), ([7] * 12, 2), ([3] * 9, 0)]:
        seq = Sequence(tokens, PARAMS)
        assert len(bm.cached_prefix(seq)) == hits
        assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed_tokens == 0
        assert _state(bm) == before


@pytest.mark.assignment("04.cached_prefix")
@pytest.mark.parametrize("seed", range(3))
def test_cached_prefix_own_matches_the_shared_prefix_length(seed):
    """Random registered prompts (distinct first tokens, so their chains never meet) and
    probes sharing ``k`` tokens with one of them: the hit is that prompt's first
    ``min(k // 4, registered full blocks, (n - 1) // 4)`` blocks."""
    rng = random.Random(seed)
    for _ in range(30):
        bm = BlockManager(num_blocks=64, block_size=BLOCK)
        prompts = []
        for j in range(3):
            tokens = [100 + j] + [rng.randint(0, 2) for _ in range(rng.randint(0, 18))]
            seq = Sequence(tokens, PARAMS)
            _hold(bm, seq, bm.blocks_needed(seq.num_tokens))
            prompts.append(seq)
        base = rng.choice(prompts)
        k = rng.randint(0, base.num_tokens)
        tail = [rng.randint(3, 5) for _ in range(rng.randint(0 if k else 1, 8))]
        probe = Sequence(base.token_ids[:k] + tail, PARAMS)  # differs at token k
        hits = min(k // BLOCK, base.num_tokens // BLOCK, (probe.num_tokens - 1) // BLOCK)
        assert bm.cached_prefix(probe) == base.block_table[:hits], (base.token_ids, probe)


# -- 04.allocate ---------------------------------------------------------------------------


@pytest.mark.assignment("04.allocate")
def test_allocate_own_takes_fresh_blocks_from_the_front_of_the_queue():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    bm.free_ids.move_to_end(0)  # block 0 is now recycled last
    seq = Sequence(list(range(10)), PARAMS)
    assert bm.allocate(seq, 10)
    assert seq.block_table == [1, 2, 3]  # ceil(10 / 4) blocks, in queue order
    assert [bm.blocks[b].ref_count for b in range(8)] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert list(bm.free_ids) == [4, 5, 6, 7, 0]
    assert (bm.queried_tokens, bm.hit_tokens) == (10, 0)
    assert seq.num_computed_tokens == 0  # the scheduler's to write
    # the two full blocks are registered when scheduled; the partial third is not
    h0 = chain_hash(None, [0, 1, 2, 3])
    h1 = chain_hash(h0, [4, 5, 6, 7])
    assert seq.block_hashes == [h0, h1]
    assert bm.hash_to_block == {h0: 1, h1: 2}
    assert bm.blocks[3].hash is None


@pytest.mark.assignment("04.allocate")
def test_allocate_own_covers_exactly_the_tokens_of_each_chunk_and_decode():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = Sequence(list(range(14)), PARAMS)
    # (tokens this step, blocks after it, full blocks registered after it)
    for n, blocks, registered in [(5, 2, 1), (3, 2, 2), (6, 4, 3)]:
        assert bm.allocate(seq, n)
        assert len(seq.block_table) == blocks and len(seq.block_hashes) == registered, n
        seq.num_computed_tokens += n  # as the scheduler counts them
    assert bm.queried_tokens == 14 and bm.hit_tokens == 0  # the first allocation only
    for token, blocks in [(20, 4), (21, 4), (22, 5)]:  # decodes: 15, 16, 17 tokens
        seq.token_ids.append(token)
        assert bm.allocate(seq, 1)
        assert len(seq.block_table) == blocks, seq.num_tokens
        seq.num_computed_tokens += 1
    assert len(set(seq.block_table)) == 5 and bm.num_free_blocks == 3
    assert bm.queried_tokens == 14


@pytest.mark.assignment("04.allocate")
def test_allocate_own_adopts_a_cached_prefix_held_by_another():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = Sequence(list(range(12)), PARAMS)
    assert bm.allocate(first, 12)  # three full blocks, registered
    second = Sequence(list(range(12)) + [50], PARAMS)
    cached = first.block_table[:3]  # what cached_prefix finds for it
    assert bm.num_free_blocks == 5
    assert bm.allocate(second, 1, cached)
    assert second.block_table[:3] == cached and len(second.block_table) == 4
    assert second.block_table[3] not in first.block_table
    assert second.block_hashes[:3] == first.block_hashes
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2, 2, 1]
    assert bm.num_free_blocks == 4  # only the fresh block came from the queue
    assert (bm.queried_tokens, bm.hit_tokens) == (12 + 13, 12)
    assert second.num_computed_tokens == 0


@pytest.mark.assignment("04.allocate")
def test_allocate_own_revives_cached_blocks_from_the_free_queue():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = Sequence(list(range(9)), PARAMS)
    assert bm.allocate(first, 9)  # [0, 1, 2]: 0 and 1 registered
    first.num_computed_tokens = 9
    _drop(bm, first)  # finished: 0 and 1 free but findable, 2 (unhashed) recycled first
    assert list(bm.free_ids) == [2, 3, 4, 5, 6, 7, 1, 0]
    second = Sequence(list(range(8)) + [60, 61], PARAMS)
    assert bm.allocate(second, 2, [0, 1])
    assert second.block_table == [0, 1, 2]
    assert list(bm.free_ids) == [3, 4, 5, 6, 7]
    assert [bm.blocks[b].ref_count for b in (0, 1, 2)] == [1, 1, 1]
    assert (bm.queried_tokens, bm.hit_tokens) == (9 + 10, 8)


@pytest.mark.assignment("04.allocate")
def test_allocate_own_refuses_with_a_cached_prefix_changing_nothing():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first = Sequence(list(range(8)), PARAMS)
    assert bm.allocate(first, 8)
    first.num_computed_tokens = 8
    _drop(bm, first)  # blocks 0 and 1: free, findable
    before = _state(bm)
    # 8 cached + 12 new tokens: 5 blocks, 4 exist (the 2 cached ones count: both are free)
    second = Sequence(list(range(8)) + [9] * 12, PARAMS)
    assert not bm.allocate(second, 12, [0, 1])
    assert second.block_table == [] and second.block_hashes == []
    assert _state(bm) == before
    # with the cached blocks held elsewhere (3 blocks used, 1 free): 8 cached + 9 new need
    # 3 fresh blocks, too many; 8 cached + a chunk of 1 need 1, which fits
    holder = Sequence(list(range(8)) + [1], PARAMS)
    assert bm.allocate(holder, 1, [0, 1])
    before = _state(bm)
    third = Sequence(list(range(8)) + [3] * 9, PARAMS)
    assert not bm.allocate(third, 9, [0, 1])
    assert third.block_table == [] and _state(bm) == before
    assert bm.allocate(third, 1, [0, 1])
    assert third.block_table[:2] == [0, 1] and bm.num_free_blocks == 0


# -- 04.free -------------------------------------------------------------------------------


@pytest.mark.assignment("04.free")
def test_free_own_returns_every_block_and_empties_the_table():
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    seq = Sequence(list(range(10)), PARAMS)
    _hold(bm, seq, 3)
    seq.num_computed_tokens = 10
    registered = dict(bm.hash_to_block)
    assert len(registered) == 2 and bm.num_free_blocks == 3
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert seq.num_computed_tokens == 10  # read, not written (the scheduler resets it)
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == 6
    assert bm.hash_to_block == registered  # computed full blocks stay findable
    assert bm.take_orphans() == set()
    never = Sequence([1, 2], PARAMS)  # never allocated: nothing to release
    before = _state(bm)
    bm.free(never)
    assert never.block_table == [] and _state(bm) == before


@pytest.mark.assignment("04.free")
def test_free_own_queues_the_tail_before_the_head():
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    seq = Sequence(list(range(12)), PARAMS)
    _hold(bm, seq, 3)  # blocks 0, 1, 2: all full and registered
    seq.num_computed_tokens = 12
    bm.free(seq)
    assert list(bm.free_ids) == [3, 4, 5, 2, 1, 0]  # the head (most shareable) goes last
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    seq = Sequence(list(range(10)), PARAMS)
    _hold(bm, seq, 3)  # block 2 is partial, so never registered: recycled first
    seq.num_computed_tokens = 10
    bm.free(seq)
    assert list(bm.free_ids) == [2, 3, 4, 5, 1, 0]


@pytest.mark.assignment("04.free")
@pytest.mark.parametrize("computed", [0, 4, 7, 8, 11, 12])
def test_free_own_forgets_blocks_registered_but_never_computed(computed):
    """Blocks are registered when scheduled; those at index >= computed // 4 never got
    their keys and values, so no later lookup may find them."""
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    seq = Sequence(list(range(12)), PARAMS)
    _hold(bm, seq, 3)  # all three registered (a 12-token step was scheduled)
    table, hashes = list(seq.block_table), list(seq.block_hashes)
    seq.num_computed_tokens = computed
    bm.free(seq)
    kept = computed // BLOCK
    for i, (b, h) in enumerate(zip(table, hashes)):
        if i < kept:
            assert bm.blocks[b].hash == h and bm.hash_to_block[h] == b, (computed, i)
        else:
            assert bm.blocks[b].hash is None and h not in bm.hash_to_block, (computed, i)
    # forgotten blocks are recycled first, the kept ones after the rest, tail first
    forgotten = table[kept:]
    assert list(bm.free_ids) == forgotten + [3, 4, 5] + table[:kept][::-1]
    assert bm.take_orphans() == set() and seq.num_computed_tokens == computed


@pytest.mark.assignment("04.free")
def test_free_own_orphans_uncomputed_blocks_someone_else_adopted():
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    a = Sequence(list(range(12)), PARAMS)
    _hold(bm, a, 3)  # registered when its 12-token step was scheduled...
    a.num_computed_tokens = 8  # ...but only 8 tokens were computed when it is freed
    b = Sequence(list(range(12)) + [40], PARAMS)
    _adopt(bm, b, a.block_table)  # b adopted all three from the cache meanwhile
    table = list(a.block_table)
    bm.free(a)
    assert bm.take_orphans() == {table[2]}  # b holds a block nobody will compute
    assert bm.take_orphans() == set()
    assert [bm.blocks[x].ref_count for x in table] == [1, 1, 1]
    assert bm.blocks[table[2]].hash is None and bm.blocks[table[1]].hash is not None
    assert b.block_table == table and bm.num_free_blocks == 3  # b still holds all three
    b.num_computed_tokens = 12
    bm.free(b)  # the shared, computed blocks: no orphan
    assert bm.take_orphans() == set() and bm.num_free_blocks == 6
    assert list(bm.free_ids)[:1] == [table[2]]  # unhashed: recycled first


@pytest.mark.assignment("04.free")
def test_free_own_skips_the_null_block():
    """A sliding window (chapter 12) put ``null_block`` in the slots it released; those
    blocks are no longer this sequence's, and the null block is never freed."""
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    bm.null_block = 0  # reserved, held by the manager forever (as sliding_window.py does)
    del bm.free_ids[0]
    bm.blocks[0].ref_count = 1
    seq = Sequence(list(range(12)), PARAMS)
    _hold(bm, seq, 3)  # blocks 1, 2, 3
    seq.num_computed_tokens = 12
    seq.block_table[:2] = [0, 0]  # the window gave back its first two blocks
    bm._release(bm.blocks[1])
    bm._release(bm.blocks[2])
    bm.free(seq)
    assert bm.blocks[0].ref_count == 1 and 0 not in bm.free_ids
    assert bm.blocks[3].ref_count == 0 and bm.num_free_blocks == 5
    assert seq.block_table == [] and seq.block_hashes == []

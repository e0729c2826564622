"""Paged KV-cache bookkeeping with prefix caching (chapter 04).

Each sequence's *block table* lists the fixed-size blocks that hold its tokens. A full block is
found by a chained hash of every token up to it and shared, reference-counted, by requests with
that prefix; a freed block keeps its hash until recycled (least recently freed first). A hash is
registered when the block's computation is *scheduled* (as vLLM does), so a request admitted in
the same or the next step already reuses it (safe: each layer stores a step's keys and values
before attention reads them, and steps run in order); one never computed loses it when freed.
A hash only finds a candidate: a lookup accepts block ``i`` only if its tokens match and its
``parent`` is the never-reused ``serial`` of the block accepted at ``i - 1``, so the whole token
chain is compared and a collision can only cost a hit (chapter 04 §3.2).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from nanovllm.engine.sequence import PLACEHOLDER, Sequence


def chain_hash(parent: int | None, token_ids: list[int]) -> int:
    """Hash of a block's tokens *and* of everything before them (via the parent hash)."""
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())  # kept to rule out hash collisions
    # Set while registered (findable by hash): a number never reused, and the serial of the
    # registered block this one continues (None for a first block). See the module docstring.
    serial: int | None = None
    parent: int | None = None


class BlockManager:
    # A block id that stands in the released slots of block tables (sliding window, chapter
    # 12: ``sliding_window.py``); this manager releases nothing.
    null_block: int | None = None

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is recycled first.
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.orphans: set[int] = set()  # see take_orphans
        self.next_serial = 0  # the next registration's serial
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # ... of which were found there

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one sequence."""
        return 1 - len(self.free_ids) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (nothing is changed). At
        most ``num_tokens - 1`` tokens may come from the cache: the last token must be
        computed to produce the logits of the next one.

        Handout (chapter 04 §3, prefix caching). Return a ``list[int]`` of block ids, one per
        full block of ``seq.token_ids`` (``block_size`` tokens each) found in the cache, in
        order, stopping at the first miss. Return ``[]`` when prefix caching is off or the
        request wants prompt logprobs (every prompt position must then be computed).
        Only ``(seq.num_tokens - 1) // block_size`` blocks may be looked at. Do not change
        any state (no reference counts, no ``seq`` fields).

        Hint: a block's key is ``chain_hash(key, tokens)`` with ``key`` the key of the block
        before (``None`` for the first); look it up in ``self.hash_to_block``. A hash only
        finds a candidate: accept block ``b = self.blocks[id]`` only if ``b.token_ids ==
        tuple(tokens)`` and ``b.parent`` is the ``serial`` of the block accepted just before
        (``None`` for the first block), so that the whole chain of tokens is compared.
        """
        # >>> assignment 04.cached_prefix (6 points)
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # (prompt logprobs need every prompt position computed)
        found, key, serial = [], None, None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            key = chain_hash(key, tokens)
            block_id = self.hash_to_block.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(tokens) or block.parent != serial:
                break  # a collision: other tokens, or the same tokens after another prefix
            found.append(block_id)
            serial = block.serial
        return found
        # <<< assignment 04.cached_prefix

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int,
                               cached: list[int] = ()) -> int:
        """Free blocks that ``allocate(seq, num_new_tokens, cached)`` would take: fresh
        blocks for the tokens its table does not cover yet, plus the ``cached`` blocks that
        sit in the free queue (reviving one takes it out of the queue)."""
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(seq.block_table) - len(cached)
        if not cached:  # (every decode step of every sequence: keep it cheap)
            return max(fresh, 0)
        return max(fresh, 0) + sum(1 for b in cached if self.blocks[b].ref_count == 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        return self.num_blocks_to_allocate(seq, num_new_tokens, cached) <= len(self.free_ids)

    def num_freeable_blocks(self, seqs: list[Sequence]) -> int:
        """Blocks that would go back to the free queue if all of ``seqs`` were freed: those
        that no other sequence holds."""
        holders: dict[int, int] = {}
        for seq in seqs:
            for b in seq.block_table:
                if b != self.null_block:
                    holders[b] = holders.get(b, 0) + 1
        return sum(1 for b, n in holders.items() if self.blocks[b].ref_count == n)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens, after adopting the
        ``cached`` prefix blocks (only for a sequence that holds no blocks yet).
        Returns False, changing nothing, when there are not enough free blocks.

        Handout (chapter 04 §3). ``cached`` is what ``cached_prefix`` returned (block ids);
        ``seq.block_table`` is a ``list[int]`` that must end up covering
        ``seq.num_computed_tokens + len(cached) * block_size + num_new_tokens`` tokens. (The
        scheduler, not this method, then counts the cached tokens as computed: it alone writes
        ``seq.num_computed_tokens``.) All or nothing: if ``self.can_allocate(...)`` says no,
        return False without touching anything. Otherwise, for a sequence's first allocation
        (its table is empty: new, or preempted and freed), count the lookup: ``queried_tokens +=
        seq.num_tokens`` and ``hit_tokens +=`` the cached tokens (so ``queried_tokens -
        hit_tokens`` is what prefill computes); adopt each cached block (take it out of
        ``free_ids`` if it was free, ``ref_count += 1``, append its id to ``seq.block_table``
        and its hash to ``seq.block_hashes``); append fresh blocks with
        ``self._take_free_block()`` until the table covers the tokens; register the blocks this
        step fills with ``self.cache_full_blocks(seq, <tokens covered after this step>)``;
        return True.

        Hint: ``self.blocks_needed(n)`` is the ceiling of ``n / block_size``.
        """
        # >>> assignment 04.allocate (8 points)
        assert not cached or not seq.block_table
        if not self.can_allocate(seq, num_new_tokens, cached):
            return False
        if not seq.block_table:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += len(cached) * self.block_size
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        self.cache_full_blocks(seq, total)
        return True
        # <<< assignment 04.allocate

    def _take_free_block(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)  # evict: its contents are about to change
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        """Make ``block`` unfindable by its hash."""
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.serial, block.parent = None, (), None, None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so later requests compute their prompts anew as on a
        fresh engine (vLLM's name; a benchmark that repeats a workload needs it). Only while
        no sequence holds a block: returns False, changing nothing, otherwise."""
        if self.usage > 0:
            return False
        for block in self.blocks:
            if block.block_id != self.null_block:
                self._forget(block)
        return True

    def take_orphans(self) -> set[int]:
        """Blocks forgotten while another sequence still held them, since the last call.

        Such a block was adopted from the prefix cache in this step, but the sequence that
        was to compute it left the step (preempted, or failed) first: its contents will
        never be written, so whoever holds it must be recomputed (the scheduler preempts)."""
        orphans, self.orphans = self.orphans, set()
        return orphans

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among the first ``num_tokens`` tokens of ``seq`` that
        are not registered yet, so later requests (or this one, after a preemption) can
        reuse them. Generated tokens count too; a block holding a token still in flight
        (async scheduling) waits until that token is known."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Slots reserved ahead of known tokens (speculative proposals, chapter 14) wait too.
        num_tokens = min(num_tokens, seq.num_tokens)
        for i in range(len(seq.block_hashes), num_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if PLACEHOLDER in tokens:
                return
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, list(tokens))
            seq.block_hashes.append(h)
            parent = self._chain_serial(seq, i - 1) if i else None
            if i and parent is None:
                continue  # the prefix is not findable: a lookup could never reach this block
            old = self.hash_to_block.get(h)
            if old is not None:
                other = self.blocks[old]
                if (other.token_ids == tokens and other.parent == parent) or other.ref_count:
                    continue  # an identical block is cached (or a colliding one is in use)
                self._forget(other)  # a free block that no lookup can accept: give way
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids, block.parent = h, tokens, parent
            block.serial, self.next_serial = self.next_serial, self.next_serial + 1
            self.hash_to_block[h] = block.block_id

    def _chain_serial(self, seq: Sequence, i: int) -> int | None:
        """Serial of the registered block that holds ``seq``'s block ``i`` after its whole
        prefix: its own block's, or an identical twin's (computed twice, registered once);
        None when the prefix is not findable."""
        k, table = i, seq.block_table
        while k >= 0 and table[k] != self.null_block and self.blocks[table[k]].serial is None:
            k -= 1  # registered blocks of its own table are trusted: registration checked them
        serial = self.blocks[table[k]].serial if k >= 0 else None
        if k >= 0 and table[k] == self.null_block:  # released (sliding_window.py): the serial
            held = self.hash_to_block.get(seq.block_hashes[k])  # it had, if still registered
            alive = held is not None and self.blocks[held].serial == seq.released_serial
            serial = seq.released_serial if alive else None
        for j in range(k + 1, i + 1):  # the rest must be twins that continue the chain
            twin_id = self.hash_to_block.get(seq.block_hashes[j])
            twin = self.blocks[twin_id] if twin_id is not None else None
            tokens = tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])
            if twin is None or twin.parent != serial or twin.token_ids != tokens:
                return None
            serial = twin.serial
        return serial

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (the scheduler resets its progress). Blocks with a hash
        stay findable until recycled; the tail of a sequence is queued for recycling before
        its (more shareable) head.

        Handout (chapter 04 §3). Walk ``seq.block_table`` from its last block to its first,
        skipping slots that hold ``self.null_block`` (a sliding window gave those back
        already, chapter 12). A block at index ``i >= seq.num_computed_tokens //
        block_size`` was registered when scheduled but never computed: if it has a hash,
        ``self._forget`` it, and if someone else still holds it (``ref_count > 1``) add its
        id to ``self.orphans``. Then drop this sequence's reference with
        ``self._release(block)``. Finally empty ``seq.block_table`` and
        ``seq.block_hashes``. Read ``seq.num_computed_tokens``; do not change it.

        Hint: walking the table backwards is what queues the tail before the head.
        """
        # >>> assignment 04.free (6 points)
        computed = seq.num_computed_tokens // self.block_size  # blocks whose KV was launched
        for i in reversed(range(len(seq.block_table))):
            if seq.block_table[i] == self.null_block:
                continue  # released by the window: no longer this sequence's
            block = self.blocks[seq.block_table[i]]
            if i >= computed and block.hash is not None:
                self._forget(block)  # registered when scheduled, but never computed
                if block.ref_count > 1:
                    self.orphans.add(block.block_id)
            self._release(block)
        seq.block_table, seq.block_hashes = [], []
        # <<< assignment 04.free
        seq.num_released_blocks, seq.released_serial = 0, None

    def _release(self, block: Block) -> None:
        """Drop one reference to ``block``; at zero it joins the free queue, at the back if
        its hash may still serve a later prefix, at the front (recycled first) if not."""
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} freed twice"
        if block.ref_count == 0:
            self.free_ids[block.block_id] = None
            if block.hash is None:
                self.free_ids.move_to_end(block.block_id, last=False)

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq`` that no future query can see; returns how many.
        Without a sliding window every key stays visible: none (``sliding_window.py``
        overrides this, chapter 12). The scheduler calls it before each allocation."""
        return 0

"""The leak check: the engine's KV bookkeeping verified between two steps (chapter 13).

Chapter 04's tests verify the block manager alone; this verifies it inside a running engine:
blocks free xor held; each ``ref_count`` equals the live requests (waiting, running, or
retired with a token in flight) whose tables hold it; no finished request holds a block; the
prefix index agrees with the blocks and with each live request's tokens; with a sliding window
(chapter 12), the null block and the released slots are consistent. ``check_invariants`` reads
state only and raises ``InvariantError`` naming requests and blocks; ``checked_steps`` runs it
after every ``step()``, remembering the previous check's requests so that a leaker is named
after the engine dropped it. The test suite runs it after every step; production does not.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Protocol

from nanovllm.engine.block_manager import BlockManager, chain_hash
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.sliding_window import num_blocks_outside_window


class SchedulerQueues(Protocol):
    running: Iterable[Sequence]
    waiting: Iterable[Sequence]


class EngineState(Protocol):
    """What the check reads of an engine; ``LLMEngine`` has it. A protocol rather than the
    engine's class, so that this module does not import the engine, which calls it."""

    requests: dict[str, Sequence]  # the live requests by id
    scheduler: SchedulerQueues
    block_manager: BlockManager

    def step(self) -> Any: ...


class InvariantError(AssertionError):
    """The KV bookkeeping is inconsistent; ``problems`` lists each violation in words."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{len(problems)} KV-cache invariant(s) violated:\n- " +
                         "\n- ".join(problems))


# Per engine: the live sequences at its previous check (strong references, dropped at the
# next check), so that one which left the engine still holding blocks can be named.
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_refcounts(bm: BlockManager, holders: Iterable[Sequence]) -> list[str]:
    """Problems with the reference counts of ``bm``'s blocks, given every sequence that may
    hold blocks (``holders``); an empty list when the counts are right.

    Handout (chapter 13 §1, the leak check). Count, for each block id, the holders whose
    ``seq.block_table`` contains it (a block twice in one table is a problem of its own:
    report it and count it once per occurrence). Then for every block of ``bm.blocks``
    compare ``block.ref_count`` with that count, and report each mismatch as one string
    that names the block id, its ``ref_count``, the count of holders and the holders'
    ``request_id`` s. A ``ref_count`` above the holders is a leak (someone who left forgot to
    free); below, a block about to be recycled under a live request (a double free). Also
    report a block whose being free (``block.block_id in bm.free_ids``) disagrees with its
    count: free blocks have ``ref_count == 0``, held ones are not in the free list.
    Return the strings in block order; change nothing.

    Hint: ``collections.Counter`` over the tables; a dict from block id to request ids
    for the messages.
    """
    # >>> assignment 13.check_refcounts (4 points)
    problems, counts, owners = [], Counter(), {}
    for seq in holders:
        if len(set(seq.block_table)) != len(seq.block_table):
            twice = sorted(b for b, k in Counter(seq.block_table).items() if k > 1)
            problems.append(f"request {seq.request_id!r} holds block(s) {twice} twice")
        for block_id in seq.block_table:
            counts[block_id] += 1
            owners.setdefault(block_id, []).append(seq.request_id)
    for block in bm.blocks:
        held, b = counts[block.block_id], block.block_id
        if block.ref_count != held:
            kind = "leaked" if block.ref_count > held else "under-counted"
            problems.append(f"block {b} {kind}: ref_count {block.ref_count} but {held} "
                            f"live holder(s) {owners.get(b, [])}")
        if (b in bm.free_ids) != (block.ref_count == 0):
            state = "in the free list" if b in bm.free_ids else "not in the free list"
            problems.append(f"block {b} has ref_count {block.ref_count} and is {state}")
    return problems
    # <<< assignment 13.check_refcounts


def _live_sequences(engine: EngineState) -> tuple[list[Sequence], list[str]]:
    """The engine's unfinished sequences, and problems with where they are kept."""
    live = list(engine.requests.values())
    problems = [f"request {s.request_id!r} is finished ({s.finish_reason}) but still listed "
                "as a live request" for s in live if s.is_finished]
    ids = {id(s) for s in live}
    sched = engine.scheduler
    for name, queue in (("running", sched.running), ("waiting", sched.waiting)):
        for seq in queue:
            if id(seq) not in ids:
                problems.append(f"request {seq.request_id!r} ({seq.status.name}) is in the "
                                f"scheduler's {name} queue but not a live request")
    return live, problems


def _departed_holders(engine: EngineState, live: list[Sequence]) -> list[str]:
    """Requests alive at the previous check, gone now, that kept blocks (finished or
    aborted without a free)."""
    previous = _seen.get(engine, {})
    now = {s.seq_id: s for s in live}
    _seen[engine] = now
    return [f"request {s.request_id!r} left the engine ({s.status.name.lower()}, finish_reason "
            f"{s.finish_reason!r}) but still holds block(s) {s.block_table}"
            for seq_id, s in previous.items() if seq_id not in now and s.block_table]


def _prefix_index_problems(bm: BlockManager, live: list[Sequence]) -> list[str]:
    problems = []
    for h, b in bm.hash_to_block.items():
        block = bm.blocks[b]
        if block.hash != h or len(block.token_ids) != bm.block_size:
            problems.append(f"prefix index: hash {h:#x} points to block {b}, which has hash "
                            f"{block.hash} and {len(block.token_ids)} tokens")
    for block in bm.blocks:
        if block.hash is not None and bm.hash_to_block.get(block.hash) != block.block_id:
            problems.append(f"prefix index: block {block.block_id} has a hash that the index "
                            "does not map to it")
    bs = bm.block_size
    for seq in live:
        if len(seq.block_table) * bs < seq.num_computed_tokens:
            problems.append(f"request {seq.request_id!r}: {len(seq.block_table)} blocks cannot "
                            f"hold its {seq.num_computed_tokens} computed tokens")
        parent = None
        for i, h in enumerate(seq.block_hashes[: len(seq.block_table)]):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if PLACEHOLDER not in tokens and h != chain_hash(parent, tokens):
                problems.append(f"request {seq.request_id!r}: block {i}'s chained hash does "
                                "not match its tokens")
            block = bm.blocks[seq.block_table[i]]
            if block.hash is not None and (block.hash != h or block.token_ids != tuple(tokens)):
                problems.append(f"request {seq.request_id!r}: its block {block.block_id} "
                                f"(position {i}) is cached under other tokens")
            parent = h
    return problems


def _window_problems(bm: BlockManager, live: list[Sequence]) -> list[str]:
    """Problems with a sliding-window manager's null block and released slots."""
    null = bm.blocks[bm.null_block]
    problems = [] if null.hash is None else [f"the null block {null.block_id} is hashed"]
    for seq in live:
        n, table = seq.num_released_blocks, seq.block_table
        nulls = [i for i, b in enumerate(table) if b == bm.null_block]
        if nulls != list(range(n)):
            problems.append(f"request {seq.request_id!r}: the null block is at positions "
                            f"{nulls} of its table, not exactly its {n} released slots")
        seen = num_blocks_outside_window(seq.num_computed_tokens, bm.window, bm.block_size)
        if n > seen:
            problems.append(f"request {seq.request_id!r}: {n} blocks released, but a future "
                            f"query still sees block {seen}")
    return problems


def _holders(bm: BlockManager, live: list[Sequence]) -> list:
    """Who holds blocks: the live requests, less their released slots (the null block),
    which the manager holds instead."""
    if bm.null_block is None:
        return live
    null = bm.null_block
    held = [SimpleNamespace(request_id=s.request_id, block_table=[b for b in s.block_table
                                                                  if b != null])
            for s in live]
    return held + [SimpleNamespace(request_id="(the block manager)", block_table=[null])]


def check_invariants(engine: EngineState) -> None:
    """Verify the engine's KV bookkeeping (module docstring); raise ``InvariantError``
    naming the offending requests and blocks. Call it between steps."""
    live, problems = _live_sequences(engine)
    problems += _departed_holders(engine, live)
    bm = engine.block_manager
    problems += check_refcounts(bm, _holders(bm, live))
    if bm.null_block is not None:
        problems += _window_problems(bm, live)
    if bm.enable_prefix_caching:
        problems += _prefix_index_problems(bm, live)
    if problems:
        raise InvariantError(problems)


@contextmanager
def checked_steps(engine: EngineState) -> Iterator[EngineState]:
    """Within the block, run ``check_invariants`` after every ``engine.step()``."""
    step = engine.step

    def checked_step():
        outputs = step()
        check_invariants(engine)
        return outputs

    engine.step = checked_step  # this engine only (an instance attribute shadows the method)
    try:
        yield engine
    finally:
        del engine.step

"""Giving back the KV blocks a sliding window has passed (chapter 12 §5; blocks: chapter 04).

A sequence's next query sits at ``c = num_computed_tokens`` and neither it nor any later one
reads a key below ``c - W + 1``, so its first ``(c - W + 1) // block_size`` blocks go back to
the pool. A released slot keeps its place in the block table and holds the *null block*
(block 0, reserved, never written: readers see finite zeros, never a stale NaN); a released
block keeps its prefix-cache hash, and ``released_serial`` keeps its chain's serial so later
blocks still register (``_chain_serial``). Only models windowed on every layer use this.

Why releasing at the start of ``schedule()`` is safe under async scheduling, where the
previous step may still run and read a block released now: a block given to another sequence
in this step is only written by this step, which the device runs after the previous one, so
the reads come first. A release never counts the tokens of the step being scheduled (that
would free keys its own queries read, and a block recycled into it would be overwritten first).
"""

from __future__ import annotations

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence


def num_blocks_outside_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """How many leading blocks of a sequence no future query can see: the next query is at
    ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1`` on."""
    return max(num_computed_tokens - window + 1, 0) // block_size


class SlidingWindowBlockManager(BlockManager):
    """``BlockManager`` for a model with a sliding window on every layer: block 0 is the null
    block, and ``release_outside_window`` gives back blocks the window has passed."""

    def __init__(self, num_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool = True) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        if num_blocks < 2:
            raise ValueError(f"a sliding-window model needs >= 2 KV blocks (one is the null "
                             f"block), got {num_blocks}")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        self.null_block = 0
        del self.free_ids[self.null_block]
        self.blocks[self.null_block].ref_count = 1  # held by the manager, forever
        self.num_released = 0  # blocks released by the window so far (a counter)

    @property
    def num_blocks(self) -> int:
        """Blocks that can hold tokens (the null block cannot)."""
        return len(self.blocks) - 1

    def release_outside_window(self, seq: Sequence) -> int:
        """Release ``seq``'s blocks that no future query can see (see the module
        docstring); their slots get the null block. Returns how many were released."""
        end = num_blocks_outside_window(seq.num_computed_tokens, self.window, self.block_size)
        if self.enable_prefix_caching:  # registration first: it reads the block, not a slot
            end = min(end, len(seq.block_hashes))
        start = seq.num_released_blocks
        for i in range(start, end):
            if self.enable_prefix_caching:
                seq.released_serial = self._chain_serial(seq, i)
            block = self.blocks[seq.block_table[i]]
            seq.block_table[i] = self.null_block
            self._release(block)  # as in free: a hashed block stays findable meanwhile
        released = max(end - start, 0)
        seq.num_released_blocks += released
        self.num_released += released
        return released


def make_block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool,
                       sliding_window: int | None) -> BlockManager:
    """The engine's block manager: one that frees out-of-window blocks for a model with a
    sliding window (on every layer), the plain one otherwise."""
    if sliding_window is None:
        return BlockManager(num_blocks, block_size, enable_prefix_caching)
    return SlidingWindowBlockManager(num_blocks, block_size, sliding_window,
                                     enable_prefix_caching)

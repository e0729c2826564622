"""Giving back the KV blocks a sliding window has passed (chapter 12 §5; blocks: chapter 04).

With a sliding window of ``W`` keys (Mistral), query ``q`` sees key ``k`` only when
``q - W < k <= q`` (transformers' convention, ``torch_attention.sliding_window_mask``). A
sequence's next query sits at ``c = num_computed_tokens``: the first token of its next prompt
chunk, or its next decode. Neither it nor any later query reads a key below ``c - W + 1``, so
the blocks wholly below that position, the first ``(c - W + 1) // block_size``
(``num_blocks_outside_window``), go back to the pool. A long sequence then holds about
``ceil(W / block_size) + 1`` blocks plus its current chunk, whatever its length.

**The null block.** A released slot keeps its place in the block table, which kernels index as
``block_table[pos // block_size]``, and holds the *null block*: block 0, reserved at start-up,
never given to a sequence and never written (a step's slot mapping addresses only the tokens
it computes, which lie inside the window; CUDA-graph padding stores nowhere), so it holds the
zeros the cache was allocated with. Whoever reads a released slot reads finite zeros:

- the torch backend gathers a sequence's whole table, then slices off everything before the
  first visible key (``windowed_paged_attention``);
- the Triton decode kernel starts its key range at ``seq_len - W`` and never loads them;
- the Triton prefill kernel starts at the ``BLOCK_N`` tile holding the first visible key. With
  ``BLOCK_N <= block_size`` that tile lies in a kept block; with ``BLOCK_N > block_size`` (32
  keys on CPU, 64 on a GPU for head_dim <= 64, over 16-token blocks) it may begin in released
  slots: those keys are loaded, their scores masked to ``-inf``, their weights exactly 0, and
  ``0 * 0`` adds nothing (a recycled block's stale contents would be finite too, but a NaN
  there would survive: ``0 * NaN``). Hence a reserved block rather than a dangling id or
  ``-1`` (which that kernel would dereference).

**When.** The scheduler calls ``release_outside_window`` (a hook of ``BlockManager``, which
releases nothing) for each running sequence at the start of every ``schedule()``, before
allocating, so freed blocks serve the step being scheduled. ``num_computed_tokens`` then
counts every step already launched. Under async scheduling the previous step may still be
running and may still read (or write) a block released now; a block given to another
sequence in this step is only written by this step, which the device runs after the previous
one, so the reads come first. A release never uses the tokens of the step being scheduled
(they would free keys that step's own queries read, and a block recycled into the same step
would be overwritten first).

**Freeing.** ``BlockManager.free`` skips null slots and ``_release`` puts a block in the free
queue for both paths, so this class adds no free-list code of its own.

**Prefix caching.** A released block keeps its hash and index entry: its keys and values are
still right for its prefix, so it waits in the free queue like any freed cached block, and a
later request with the same prefix adopts it. A block is released only after its registration
was attempted (``cache_full_blocks`` never meets a null slot), and ``released_serial`` keeps
the chain's serial so blocks after a released one still register (``_chain_serial``).
Preemption frees the rest and recomputes from token 0 into fresh blocks.

**Which models.** Only a model whose every layer has the window: ``ModelConfig`` has one
``sliding_window`` for all layers and refuses configs that window some layers only (Qwen2's
``use_sliding_window``). Such a model would need one block table per group of layers (vLLM's
hybrid KV-cache manager); this engine would free nothing for it.
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

    def __init__(
        self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True
    ) -> None:
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


def make_block_manager(
    num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None
) -> BlockManager:
    """The engine's block manager: one that frees out-of-window blocks for a model with a
    sliding window (on every layer), the plain one otherwise."""
    if sliding_window is None:
        return BlockManager(num_blocks, block_size, enable_prefix_caching)
    return SlidingWindowBlockManager(num_blocks, block_size, sliding_window,
                                     enable_prefix_caching)

# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 04: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/04_block_manager.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slot of each token position in [start, end)."""
    # BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    # END SOLUTION

# %% tags=["solution"]
import numpy as np
import xxhash


def chain_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """[h_0, h_1, ...] for the full blocks of token_ids; h_i = xxh64(h_{i-1} bytes + block i)."""
    # BEGIN SOLUTION
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        h = xxhash.xxh64()
        if parent is not None:
            h.update(parent.to_bytes(8, "little"))
        h.update(np.asarray(token_ids[i * block_size:(i + 1) * block_size], dtype="<i8").tobytes())
        parent = h.intdigest()
        hashes.append(parent)
    return hashes
    # END SOLUTION

# %% tags=["solution"]
def free_blocks_taken(num_prompt_tokens: int, cached_ref_counts: list[int], block_size: int) -> int:
    """Blocks that leave the free list when the request is admitted with its cached prefix."""
    # BEGIN SOLUTION
    fresh = -(-num_prompt_tokens // block_size) - len(cached_ref_counts)
    revived = sum(1 for count in cached_ref_counts if count == 0)
    return fresh + revived
    # END SOLUTION

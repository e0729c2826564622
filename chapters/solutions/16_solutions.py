# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 16: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/16_mixture_of_experts.py`: the chapter's cell with its
# solution between `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there).
# Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def expected_touched(num_experts: int, k: int, batch: int) -> float:
    """Expected distinct experts touched by `batch` tokens of `k` uniform random experts."""
    # BEGIN SOLUTION
    # An expert is missed by one token with probability 1 - k/E, by all of them independently.
    return num_experts * (1 - (1 - k / num_experts) ** batch)
    # END SOLUTION

# %% tags=["solution"]
def worst_case_rows(n: int, num_experts: int, block: int) -> int:
    """The most rows n assignments over num_experts experts can take, padded to blocks."""
    # BEGIN SOLUTION
    # Every non-empty expert takes one block for its first assignment; each further block
    # needs `block` more assignments in one expert.
    nonempty = min(n, num_experts)
    return (nonempty + (n - nonempty) // block) * block
    # END SOLUTION

# %% tags=["solution"]
def qwen3_235b_counts() -> tuple[int, int]:
    """(total, active per token) parameters of Qwen3-235B-A22B."""
    # BEGIN SOLUTION
    layers, hidden, heads, kv_heads, head_dim = 94, 4096, 64, 4, 128
    experts, width, k, vocab = 128, 1536, 8, 151936
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    expert = 3 * hidden * width
    total = layers * (attention + hidden * experts + experts * expert) + 2 * vocab * hidden
    active = layers * (attention + hidden * experts + k * expert) + vocab * hidden
    return total, active
    # END SOLUTION

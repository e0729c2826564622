# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 15: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/15_structured_output.py`: the chapter's cell with its
# solution between `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there).
# Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def yes_no_dfa() -> tuple[dict[int, dict[str, int]], set[int]]:
    """(transitions, accepting states) of a DFA for (yes|no)!? starting in state 0."""
    # BEGIN SOLUTION
    # 0 -y-> 1 -e-> 2 -s-> 3 (a match); 0 -n-> 4 -o-> 3; one "!" from 3 -> 5 (a match).
    transitions = {0: {"y": 1, "n": 4}, 1: {"e": 2}, 2: {"s": 3}, 4: {"o": 3}, 3: {"!": 5}}
    return transitions, {3, 5}
    # END SOLUTION

# %% tags=["solution"]
import torch


def pack(allowed: set[int], vocab_size: int) -> torch.Tensor:
    # BEGIN SOLUTION
    words = [0] * ((vocab_size + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # as int32: a word with bit 31 set wraps to a negative number
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    # END SOLUTION

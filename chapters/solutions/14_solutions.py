# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 14: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/14_speculative_decoding.py`: the chapter's cell with its
# solution between `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there).
# Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def best_k(alpha: float, cost: float, k_max: int = 16) -> int:
    """The number of proposals k in 0..k_max that maximises the predicted speedup
    (1 - alpha^(k+1)) / ((1 - alpha)(1 + cost k)); the smallest such k on a tie."""
    # BEGIN SOLUTION
    # The geometric sum 1 + alpha + ... + alpha^k is the closed form without its pole at 1.
    gains = [sum(alpha**i for i in range(k + 1)) / (1 + cost * k) for k in range(k_max + 1)]
    return gains.index(max(gains))
    # END SOLUTION

# %% tags=["solution"]
import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """The probability that a proposal d ~ q is kept by the test uniform < p(d) / q(d);
    ``p`` and ``q`` are distributions over the same vocabulary (q may be 0 somewhere)."""
    # BEGIN SOLUTION
    # sum_d q(d) min(1, p(d)/q(d)) = sum_d min(p(d), q(d)): the tokens q never draws add 0.
    return float(torch.minimum(p, q).sum())
    # END SOLUTION

# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 12: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/12_long_context.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import math

import torch


def yarn_inv_freq(d: int, base: float, factor: float, trained: int, beta_fast: float = 32,
                  beta_slow: float = 1) -> torch.Tensor:
    """YaRN's inverse frequencies, float64 [d // 2]."""
    # BEGIN SOLUTION
    plain = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def index(turns: float) -> float:
        return d * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(index(beta_fast)), 0)
    high = min(math.ceil(index(beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return plain * (1 - ramp) + plain / factor * ramp
    # END SOLUTION

# %% tags=["solution"]
def ntk_base(base: float, d: int, factor: float, trained: int, n: int) -> float:
    """Dynamic NTK's RoPE base for a sequence of n tokens."""
    # BEGIN SOLUTION
    n = max(n, trained)
    return base * (factor * n / trained - (factor - 1)) ** (d / (d - 2))
    # END SOLUTION

# %% tags=["solution"]
def blocks_outside_window(n: int, window: int, block_size: int) -> int:
    """Leading blocks of a sequence whose every key lies before its last `window` keys."""
    # BEGIN SOLUTION
    return max(0, n - window) // block_size
    # END SOLUTION

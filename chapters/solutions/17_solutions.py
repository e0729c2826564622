# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 17: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/17_deployment.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def grace_seconds(pre_stop: float, grace_period: float, margin: float, headroom: float) -> int:
    """terminationGracePeriodSeconds that outwaits pause + drain + margin + headroom."""
    # BEGIN SOLUTION
    import math

    return math.floor(pre_stop + grace_period + margin + headroom) + 1
    # END SOLUTION

# %% tags=["solution"]
def leading_match(held: set, hashes: list) -> int:
    """The number of leading ``hashes`` found in ``held``."""
    # BEGIN SOLUTION
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count
    # END SOLUTION

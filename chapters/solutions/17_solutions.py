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
def fleet_bounds(peak_rps: float, met_rps: float, missed_rps: float) -> tuple[int, int]:
    """(fewest replicas that might meet the SLO, fewest that surely do) at ``peak_rps``."""
    # BEGIN SOLUTION
    import math

    might = math.floor(peak_rps / missed_rps) + 1  # fewer: each gets missed_rps or more
    surely = math.ceil(peak_rps / met_rps)  # each gets at most met_rps
    return might, surely
    # END SOLUTION

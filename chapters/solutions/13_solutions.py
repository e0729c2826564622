# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 13: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/13_troubleshooting.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def finish(request: dict, reason: str, refcount: list[int], free: list[int]) -> None:
    """Release every block of ``request`` (for any ``reason``), last block first."""
    # BEGIN SOLUTION
    for b in reversed(request["blocks"]):
        if refcount[b] <= 0:
            raise ValueError(f"request {request['id']!r}: block {b} freed twice")
    for b in reversed(request["blocks"]):
        refcount[b] -= 1
        if refcount[b] == 0:
            free.append(b)
    request["blocks"] = []
    # END SOLUTION

# %% tags=["solution"]
def first_fit_alloc(used: dict, capacity: int, size: int) -> int | None:
    """Lowest start of a free gap of >= ``size`` slots among ``used`` regions, or None."""
    # BEGIN SOLUTION
    pos = 0
    for start, length in sorted(used.values()):
        if start - pos >= size:
            return pos
        pos = max(pos, start + length)
    return pos if capacity - pos >= size else None
    # END SOLUTION

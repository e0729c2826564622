# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 06: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/06_scheduler.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def shortest_prompt_first(seqs, now):
    """Shortest prompt first; ties: earlier arrival, then smaller seq_id."""
    # BEGIN SOLUTION
    return sorted(seqs, key=lambda s: (s.num_prompt_tokens, s.metrics.arrival_time, s.seq_id))
    # END SOLUTION

# %% tags=["solution"]
def ttft_tpot(arrival: float, token_times: list[float]) -> tuple[float, float | None]:
    """Time to first token and mean inter-token time after the first (None if < 2 tokens)."""
    # BEGIN SOLUTION
    ttft = token_times[0] - arrival
    if len(token_times) < 2:
        return ttft, None
    return ttft, (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    # END SOLUTION

# %% tags=["solution"]
def chunk_plan(prompt_lens: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Per step, the (request index, tokens) pairs a FCFS chunked-prefill scheduler computes."""
    # BEGIN SOLUTION
    remaining = list(prompt_lens)
    plan = []
    while any(remaining):
        step, left = [], budget
        for i in range(len(remaining)):
            if remaining[i] == 0 or left == 0:
                continue
            n = min(remaining[i], left)
            step.append((i, n))
            remaining[i] -= n
            left -= n
        plan.append(step)
    return plan
    # END SOLUTION

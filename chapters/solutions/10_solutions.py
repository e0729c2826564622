# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 10: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/10_serving.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def token_bucket(rate: float, capacity: float, clock):
    """A bucket of at most `capacity` tokens refilled at `rate` per second: (wait_time, take)."""
    # BEGIN SOLUTION
    state = {"level": float(capacity), "updated": clock()}

    def refill() -> None:
        now = clock()
        state["level"] = min(capacity, state["level"] + (now - state["updated"]) * rate)
        state["updated"] = now

    def wait_time(amount: float) -> float:
        refill()
        return max(0.0, (min(amount, capacity) - state["level"]) / rate)

    def take(amount: float) -> None:
        refill()
        state["level"] -= amount

    return wait_time, take
    # END SOLUTION

# %% tags=["solution"]
def retry_after(req_level, tok_level, prompt_tokens, req_rate, req_burst, tpm):
    """Seconds until both buckets allow one request of `prompt_tokens` tokens; 0 means now."""
    # BEGIN SOLUTION
    req_wait = max(0.0, (min(1, req_burst) - req_level) / req_rate)
    tok_wait = max(0.0, (min(prompt_tokens, tpm) - tok_level) / (tpm / 60))
    return max(req_wait, tok_wait)
    # END SOLUTION

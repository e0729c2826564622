# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 00: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/00_tour.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def count_new_tokens(outputs) -> int:
    """Total number of generated tokens over every completion of every request."""
    # BEGIN SOLUTION
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)
    # END SOLUTION

# %% tags=["solution"]
def chatml_prompt(messages: list[dict]) -> str:
    """SmolLM2's chat layout of `messages`, ready for the assistant's answer."""
    # BEGIN SOLUTION
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    parts = []
    if not messages or messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)
    # END SOLUTION

# %% tags=["solution"]
def invalid_settings(settings: list[dict]) -> list[int]:
    """Indices of the settings that SamplingParams would reject, in increasing order."""
    # BEGIN SOLUTION
    def ok(s: dict) -> bool:
        return (s.get("temperature", 1.0) >= 0
                and (s.get("top_k", -1) == -1 or s.get("top_k", -1) >= 1)
                and 0 < s.get("top_p", 1.0) <= 1
                and 0 <= s.get("min_p", 0.0) <= 1
                and s.get("max_tokens", 64) >= 1)

    return [i for i, s in enumerate(settings) if not ok(s)]
    # END SOLUTION

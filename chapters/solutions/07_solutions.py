# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 07: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/07_cuda_graphs.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def padding_waste(buckets: list[int], max_batch: int) -> tuple[float, int]:
    """(mean fraction of padded rows, worst number of padded rows) over batches 1..max_batch."""
    # BEGIN SOLUTION
    fractions, worst = [], 0
    for n in range(1, max_batch + 1):
        b = next(b for b in buckets if b >= n)
        fractions.append((b - n) / b)
        worst = max(worst, b - n)
    return sum(fractions) / len(fractions), worst
    # END SOLUTION

# %% tags=["solution"]
import torch


def pad_decode_batch(input_ids, slot_mapping, seq_lens, block_tables, bucket):
    """Pad a decode batch of n rows to `bucket` rows with harmless padding rows."""
    # BEGIN SOLUTION
    n = input_ids.shape[0]

    def pad(t, value):
        extra = torch.full((bucket - n, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
        return torch.cat([t, extra])

    return pad(input_ids, 0), pad(slot_mapping, -1), pad(seq_lens, 0), pad(block_tables, -1)
    # END SOLUTION

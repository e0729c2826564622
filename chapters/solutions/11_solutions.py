# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 11: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/11_performance.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def bound_seconds(prompt_lens, output_lens, kv_bytes_per_token, weight_bytes, bandwidth):
    """Bandwidth-bound seconds of a workload (weights once per step, all KV reads)."""
    # BEGIN SOLUTION
    reads = sum(p * n + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens))
    return (reads * kv_bytes_per_token + max(output_lens) * weight_bytes) / bandwidth
    # END SOLUTION

# %% tags=["solution"]
import math

import torch


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_positions):
    """Llama 3.1's rescaling of RoPE inverse frequencies."""
    # BEGIN SOLUTION
    wavelength = 2 * math.pi / inv_freq
    sigma = (original_max_positions / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = (1 - sigma) * inv_freq / factor + sigma * inv_freq
    out = torch.where(wavelength > original_max_positions / low_freq_factor,
                      inv_freq / factor, blended)
    return torch.where(wavelength < original_max_positions / high_freq_factor, inv_freq, out)
    # END SOLUTION

# %% tags=["solution"]
def max_concurrent(num_kv_blocks: int, block_size: int, seq_len: int) -> int:
    """Sequences of seq_len tokens that fit in num_kv_blocks blocks of block_size tokens."""
    # BEGIN SOLUTION
    return num_kv_blocks // -(-seq_len // block_size)
    # END SOLUTION

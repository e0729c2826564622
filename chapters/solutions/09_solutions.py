# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 09: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/09_tensor_parallel.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import torch


def qkv_shard(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, rank: int, n: int,
              head_dim: int) -> torch.Tensor:
    """Rank ``rank`` of ``n``: its q heads, then k heads, then v heads, as one matrix."""
    # BEGIN SOLUTION
    heads, kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    if heads % n or kv_heads % n:
        raise ValueError(f"{n} ranks do not divide {heads} heads and {kv_heads} KV heads")
    parts = []
    for w, count in ((wq, heads), (wk, kv_heads), (wv, kv_heads)):
        rows = count // n * head_dim
        parts.append(w[rank * rows:(rank + 1) * rows])
    return torch.cat(parts)
    # END SOLUTION

# %% tags=["solution"]
import numpy as np


def ring_allreduce_time_us(nbytes: float, n: int, latency_us: float,
                           bandwidth_gbs: float) -> float:
    """Time of a ring all-reduce: 2(n-1) steps of latency plus one chunk's transfer."""
    # BEGIN SOLUTION
    return 2 * (n - 1) * (latency_us + nbytes / n / (bandwidth_gbs * 1e3))
    # END SOLUTION


def fit_latency_bandwidth(sizes, times_us, n: int) -> tuple[float, float]:
    """Least-squares (latency_us, bandwidth_gbs) of the ring model for measured times."""
    # BEGIN SOLUTION
    sizes, times_us = np.asarray(sizes, float), np.asarray(times_us, float)
    a = np.stack([np.full_like(sizes, 2 * (n - 1)), 2 * (n - 1) * sizes / n / 1e3], axis=1)
    (latency, inverse_bw), *_ = np.linalg.lstsq(a, times_us, rcond=None)
    return float(latency), float(1 / inverse_bw)
    # END SOLUTION

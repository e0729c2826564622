# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 02: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/02_attention.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import torch


def online_softmax(score_tiles: list[torch.Tensor]) -> torch.Tensor:
    """softmax(cat(score_tiles, dim=1), dim=1), with the row statistics found in one pass."""
    # BEGIN SOLUTION
    rows = score_tiles[0].shape[0]
    m = torch.full((rows,), float("-inf"), dtype=score_tiles[0].dtype)
    ell = torch.zeros(rows, dtype=score_tiles[0].dtype)
    for s in score_tiles:
        m_new = torch.maximum(m, s.max(dim=1).values)
        # rows that have seen only -inf so far keep ell = 0; avoid exp(-inf - -inf) = nan
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        ell = ell * torch.exp(m - safe) + torch.exp(s - safe[:, None]).sum(dim=1)
        m = m_new
    return torch.cat([torch.exp(s - m[:, None]) / ell[:, None] for s in score_tiles], dim=1)
    # END SOLUTION

# %% tags=["solution"]
import torch


def causal_mask(q_len: int, k_len: int) -> torch.Tensor:
    """[q_len, k_len] bool: query i, at position k_len - q_len + i, sees keys 0 .. that position."""
    # BEGIN SOLUTION
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
    # END SOLUTION

# %% tags=["solution"]
import torch


def pack_varlen(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the sequences end to end; cu_seqlens[b] = first row of sequence b (int32, B + 1)."""
    # BEGIN SOLUTION
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    return torch.cat(seqs, dim=0), lengths.cumsum(0).to(torch.int32)
    # END SOLUTION

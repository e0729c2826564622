# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 01: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/01_model.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight, normalised in fp32."""
    # BEGIN SOLUTION
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
    # END SOLUTION

# %% tags=["solution"]
import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the channel pairs (i, i + d/2) of x [T, H, d] by positions [T] * theta**(-2i/d)."""
    # BEGIN SOLUTION
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    # END SOLUTION

# %% tags=["solution"]
import torch


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep each row's nucleus of probability top_p; the rest becomes -inf."""
    # BEGIN SOLUTION
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
    # END SOLUTION

# %% tags=["solution"]
import torch


def gumbel_max_sample(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of logits [B, V], sampled from softmax(logits)."""
    # BEGIN SOLUTION
    probs = logits.float().softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
    # END SOLUTION

# %% tags=["solution"]
import torch


def apply_repetition_penalty(logits: torch.Tensor, seen_token_ids: list[int],
                             penalty: float) -> torch.Tensor:
    """z / penalty where z > 0, else z * penalty, for the seen tokens of one row [V]."""
    # BEGIN SOLUTION
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.tensor(seen_token_ids, dtype=torch.long)] = True
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)
    # END SOLUTION

# %% tags=["solution"]
import torch


def logprob_and_rank(logits: torch.Tensor, token: int) -> tuple[float, int]:
    """(log softmax(logits)[token], number of tokens with a logprob >= the token's)."""
    # BEGIN SOLUTION
    logprobs = logits.float().log_softmax(dim=-1)
    return float(logprobs[token]), int((logprobs >= logprobs[token]).sum())
    # END SOLUTION

# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 05: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/05_paged_attention_kernel.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
import torch


def paged_decode_one(q, k_cache, v_cache, block_table, seq_len, scale):
    """Decode attention of one sequence's query heads [H, D] over its paged history."""
    # BEGIN SOLUTION
    num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for kv_head in range(num_kv_heads):
        q_g = q[kv_head * group:(kv_head + 1) * group]
        m = torch.full((group,), float("-inf"), dtype=q.dtype)
        l = torch.zeros(group, dtype=q.dtype)  # noqa: E741
        acc = torch.zeros(group, head_dim, dtype=q.dtype)
        for j in range(-(-seq_len // block_size)):
            rows = min(block_size, seq_len - j * block_size)
            block = int(block_table[j])
            k, v = k_cache[block, :rows, kv_head], v_cache[block, :rows, kv_head]
            s = (q_g @ k.T) * scale
            m_new = torch.maximum(m, s.max(dim=1).values)
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(dim=1)  # noqa: E741
            acc = acc * alpha[:, None] + p @ v
            m = m_new
        out[kv_head * group:(kv_head + 1) * group] = acc / l[:, None]
    return out
    # END SOLUTION

# %% tags=["solution"]
import torch


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """Log-sum-exp merge of split-KV partial states into the final output [H, D]."""
    # BEGIN SOLUTION
    m_max = m.max(dim=0).values
    w = torch.exp(m - m_max)  # exp(-inf) = 0 for empty splits
    return (w[..., None] * acc).sum(dim=0) / (w * l).sum(dim=0)[:, None]
    # END SOLUTION

# %% tags=["solution"]
def decode_call_bytes(batch, ctx, num_heads, num_kv_heads, head_dim, elem_bytes):
    """Bytes of K, V, q and out that one decode-attention call reads or writes."""
    # BEGIN SOLUTION
    kv = 2 * batch * ctx * num_kv_heads * head_dim * elem_bytes
    q_and_out = 2 * batch * num_heads * head_dim * elem_bytes
    return kv + q_and_out
    # END SOLUTION

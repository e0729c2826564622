# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 03: worked solutions of the exercises (instructor only)
#
# One cell per exercise of `chapters/03_kv_cache.py`: the chapter's cell with its solution between
# `# BEGIN SOLUTION` and `# END SOLUTION` (the chapter has the stub there). Never shipped:
# editions and the book leave `chapters/solutions/` out; `tests/test_exercises.py` runs each
# cell against the chapter's check cell.

# %% tags=["solution"]
def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """Bytes of K and V that one token occupies in the cache, over all layers."""
    # BEGIN SOLUTION
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes
    # END SOLUTION

# %% tags=["solution"]
def max_tokens_in_budget(budget_bytes: int, config: dict, dtype_bytes: int, block_size: int) -> int:
    """Tokens of KV cache that fit in budget_bytes, counting only whole blocks."""
    # BEGIN SOLUTION
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_block = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * block_size
    return budget_bytes // per_block * block_size
    # END SOLUTION

# %% tags=["solution"]
def contiguous_waste(lengths: list[int], max_len: int) -> float:
    """Empty fraction of the slots reserved when each request gets max_len of them."""
    # BEGIN SOLUTION
    return 1 - sum(lengths) / (len(lengths) * max_len)
    # END SOLUTION

# %% tags=["solution"]
def paged_waste(lengths: list[int], block_size: int) -> float:
    """Empty fraction of the slots reserved when each request gets whole blocks."""
    # BEGIN SOLUTION
    reserved = sum(-(-n // block_size) * block_size for n in lengths)
    return 1 - sum(lengths) / reserved
    # END SOLUTION

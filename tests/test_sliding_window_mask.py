"""The sliding-window mask (chapter 12 §5; assignment ``12.sliding_window``,
``sliding_window_mask`` in nanovllm/layers/torch_attention.py).

``sliding_window_mask(num_queries, num_keys, window)`` alone: hand-written masks for a prompt
and for a chunk after a cached prefix, the edge windows (1: each query sees only itself; at
least the sequence: plain causal), a decode query, and every small shape against the
definition written here key by key (query i at position p = num_keys - num_queries + i sees
key j iff j <= p and p - j < window). Exact boolean comparisons: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.torch_attention import sliding_window_mask

ID = "12.sliding_window"


def definition(num_queries: int, num_keys: int, window: int) -> list[list[bool]]:
    rows = []
    for i in range(num_queries):
        p = num_keys - num_queries + i
        rows.append([j <= p and p - j < window for j in range(num_keys)])
    return rows


@pytest.mark.assignment(ID)
def test_a_prompt_of_five_with_a_window_of_three():
    mask = sliding_window_mask(5, 5, 3)
    assert mask.dtype == torch.bool and mask.shape == (5, 5)
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # the window holds three keys, the query's own included
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


@pytest.mark.assignment(ID)
def test_a_chunk_after_a_cached_prefix():
    """Three queries, the last of seven positions (4, 5, 6), window 2."""
    mask = sliding_window_mask(3, 7, 2)
    assert mask.shape == (3, 7)
    assert mask.int().tolist() == [
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]


@pytest.mark.assignment(ID)
def test_edge_windows():
    """Window 1: each query sees itself only. A window of at least the sequence: the (shifted)
    causal triangle. A decode query: its last ``window`` keys."""
    assert torch.equal(sliding_window_mask(4, 4, 1), torch.eye(4, dtype=torch.bool))
    assert torch.equal(sliding_window_mask(2, 6, 1)[:, 4:], torch.eye(2, dtype=torch.bool))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for window in (6, 7, 100):
        assert torch.equal(sliding_window_mask(6, 6, window), causal), window
        assert torch.equal(sliding_window_mask(2, 6, window), causal[4:]), window
    assert sliding_window_mask(1, 10, 4).int().tolist() == [[0] * 6 + [1] * 4]
    assert sliding_window_mask(1, 3, 8).int().tolist() == [[1, 1, 1]]


@pytest.mark.assignment(ID)
def test_every_small_shape_matches_the_definition():
    for num_keys in range(1, 10):
        for num_queries in range(1, num_keys + 1):
            for window in range(1, num_keys + 3):
                mask = sliding_window_mask(num_queries, num_keys, window)
                assert mask.shape == (num_queries, num_keys) and mask.dtype == torch.bool
                expected = definition(num_queries, num_keys, window)
                assert mask.tolist() == expected, (num_queries, num_keys, window)


@pytest.mark.assignment(ID)
def test_device_argument_and_row_counts():
    """On the device asked for (CPU, and CPU by default); each query sees
    min(window, its position + 1) keys, the last of which is itself."""
    for device in (None, torch.device("cpu"), "cpu"):
        mask = sliding_window_mask(40, 64, 16, device)
        assert mask.device.type == "cpu"
    positions = torch.arange(24, 64)
    assert torch.equal(mask.sum(-1), torch.clamp(positions + 1, max=16))
    assert torch.equal(mask[torch.arange(40), positions], torch.ones(40, dtype=torch.bool))
    assert not mask[torch.arange(39), positions[:-1] + 1].any()  # nothing after itself

"""Tensor-parallel state: which shard of each weight this process owns (chapter 09).

With one process (the default) rank is 0 and size is 1, and every helper here is a no-op,
so the layers are written once for both cases.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x

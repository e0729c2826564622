"""Sort token->expert assignments into expert-aligned blocks (chapter 16 §5).

The grouped GEMM of the fused MoE kernel (``nanovllm/kernels/fused_moe.py``) gives each program
one block of ``block_size`` rows that all belong to one expert, so it multiplies them by that
expert's weights only. This is the bookkeeping that makes it so, vLLM's
``moe_align_block_size``: order the ``T * top_k`` (token, expert) assignments by expert, and
pad every expert's group up to a multiple of the block size with a sentinel that the kernel
skips. Written with tensor operations only, on fixed-size outputs (no ``.item()``, no shape that
depends on the routing), so it runs on the GPU inside a CUDA graph. Plain PyTorch (vLLM has it
as a CUDA op), kept beside the kernel it feeds; importing it needs ``triton`` like every module
under ``nanovllm/kernels``.
"""

from __future__ import annotations

import torch


def aligned_capacity(num_assignments: int, num_experts: int, block_size: int) -> int:
    """The most slots the padded assignments can need: every non-empty expert (at most
    ``min(num_assignments, num_experts)`` of them) pads at most ``block_size - 1``, rounded up
    to whole blocks."""
    most = num_assignments + min(num_assignments, num_experts) * (block_size - 1)
    return -(-most // block_size) * block_size


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the assignments of ``topk_ids`` by expert, each group padded to whole blocks.

    Handout (chapter 16 §5, assignment ``16.align``):

    - ``topk_ids``: ``[T, k]`` int64 expert ids in ``[0, num_experts)`` (the router's ``ids``).
      Assignment ("slot") ``s = t * k + j`` is row ``t``'s ``j``-th expert: ``topk_ids``
      flattened. Let ``N = T * k`` and ``C = aligned_capacity(N, num_experts, block_size)``.
    - Returns ``(sorted_ids, expert_ids, num_padded)``, all int64 on ``topk_ids``' device:

      - ``sorted_ids`` ``[C]``: expert 0's slots, then expert 1's, ..., each expert's in
        increasing slot order, each group followed by sentinel entries equal to ``N`` until
        its length is a multiple of ``block_size`` (an expert without slots takes no room).
        Entries after the last group are ``N`` too.
      - ``expert_ids`` ``[C // block_size]``: the expert whose group block ``b`` (entries
        ``b * block_size`` to ``(b + 1) * block_size - 1``) lies in; ``-1`` for the blocks
        after the last group.
      - ``num_padded`` ``[1]``: the used length, the sum of the padded group lengths.

    - Shapes depend only on ``T``, ``k``, ``num_experts`` and ``block_size``, never on the
      routing, and nothing is read back to the host (no ``.item()``, ``.tolist()``,
      ``nonzero``, boolean-mask indexing or ``bincount``): this runs inside CUDA graphs.
    """
    flat = topk_ids.flatten()
    n = flat.numel()
    capacity = aligned_capacity(n, num_experts, block_size)
    # >>> assignment 16.align (5 points)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    group_end = padded.cumsum(0)
    group_start = group_end - padded
    order = flat.argsort(stable=True)  # slots by expert, increasing within each expert
    experts = flat[order]
    first_in_order = counts.cumsum(0) - counts  # where each expert's slots begin in `order`
    rank = torch.arange(n, device=device) - first_in_order[experts]
    sorted_ids = torch.full((capacity,), n, dtype=torch.int64, device=device)
    sorted_ids[group_start[experts] + rank] = order
    num_padded = group_end[-1:] if num_experts else torch.zeros(1, dtype=torch.int64,
                                                                 device=device)
    block_start = torch.arange(0, capacity, block_size, device=device)
    expert_ids = torch.searchsorted(group_end, block_start, right=True)
    expert_ids = torch.where(block_start < num_padded, expert_ids, -1)
    # <<< assignment 16.align
    return sorted_ids, expert_ids, num_padded

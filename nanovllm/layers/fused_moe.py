"""The experts of a mixture-of-experts layer: stacked weights, a PyTorch path and a fused one
(chapter 16).

Every expert is a SwiGLU MLP. Hugging Face checkpoints store each expert's ``gate_proj``,
``up_proj`` and ``down_proj`` (Mixtral: ``w1``, ``w3``, ``w2``) as separate tensors; at load
time they are stacked into two tensors, ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then its
up rows) and ``w2`` ``[E, H, I]``, the layout a grouped GEMM reads (vLLM's names). Tensor
parallelism splits the intermediate dimension ``I``: every rank holds every expert, and a slice
of its width, the column/row split of a dense MLP (chapter 09), applied to each expert; the
rank's partial outputs are summed by the MoE block's all-reduce.

``moe_reference`` is the readable path and the reference the kernel is tested against: for each
expert, gather its tokens, run its MLP, add the weighted results back. It runs everywhere; the
Triton kernel (``nanovllm/kernels/fused_moe.py``) replaces it when the fused kernels are on
(``layers/fused.py``: the GPU backends), as one launch for all experts' gate/up and one for
their down projections.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import tp_rank, tp_size
from nanovllm.layers.linear import check_shape


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, one expert at a time.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]``; ``w2`` ``[E, H, I]``; ``topk_*`` ``[T, k]``. The
    assignments are sorted by expert so each expert's tokens are one contiguous slice (the
    same order the fused kernel uses); the weighted sum is accumulated in float32. Reads the
    per-expert counts back to the host: no CUDA graphs on this path.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    scale = topk_weights.flatten().float()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        slots, start = order[start:start + count], start + count
        if count == 0:
            continue
        tokens = slots // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * scale[slots, None])
    return out.to(x.dtype)


class StackedExpertWeight(nn.Module):
    """One weight of all experts, ``[E, parts * rows, cols]`` on this rank.

    ``parts`` names the checkpoint tensors stacked along the rows of each expert (``("gate",
    "up")`` for ``w13``, ``("down",)`` for ``w2``), each ``full_shape`` ``(rows, cols)`` in
    the checkpoint; ``shard_dim`` is the dimension of a part that tensor parallelism splits.
    """

    def __init__(self, num_experts: int, parts: tuple[str, ...], full_shape: tuple[int, int],
                 shard_dim: int) -> None:
        super().__init__()
        if full_shape[shard_dim] % tp_size():
            raise ValueError(f"the experts' intermediate size {full_shape[shard_dim]} must "
                             f"divide evenly across {tp_size()} tensor-parallel ranks")
        local = list(full_shape)
        local[shard_dim] //= tp_size()
        self.parts, self.full_shape, self.shard_dim = parts, full_shape, shard_dim
        self.local_shape = tuple(local)
        self.weight = nn.Parameter(
            torch.empty(num_experts, len(parts) * local[0], local[1]), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None) -> None:
        """Copy this rank's slice of one expert's part (``shard_id = (expert, part)``), or of
        the whole stacked tensor ``[E, parts * rows, cols]`` (``None``: random weights)."""
        rows, cols = self.full_shape
        size = self.local_shape[self.shard_dim]
        if shard_id is None:
            experts = param.shape[0]
            check_shape(loaded, experts, len(self.parts) * rows, cols)
            mine = loaded.view(experts, len(self.parts), rows, cols).narrow(
                2 + self.shard_dim, tp_rank() * size, size)
            param.data.copy_(mine.reshape(param.shape))
            return
        expert, part = shard_id
        check_shape(loaded, rows, cols)
        local_rows = self.local_shape[0]
        start = self.parts.index(part) * local_rows
        mine = loaded.narrow(self.shard_dim, tp_rank() * size, size)
        param.data[expert, start:start + local_rows].copy_(mine)


class FusedMoE(nn.Module):
    """All experts of one layer; ``forward`` returns this rank's partial sum (not reduced)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = StackedExpertWeight(num_experts, ("gate", "up"),
                                       (intermediate_size, hidden_size), shard_dim=0)
        self.w2 = StackedExpertWeight(num_experts, ("down",),
                                      (hidden_size, intermediate_size), shard_dim=1)
        self.fused_kernel: Callable | None = None  # the Triton kernel when on (layers/fused.py)

    @staticmethod
    def load_fused_kernel() -> Callable:
        from nanovllm.kernels.fused_moe import fused_moe  # needs triton: imported when on

        return fused_moe

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        moe = self.fused_kernel or moe_reference
        return moe(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids)

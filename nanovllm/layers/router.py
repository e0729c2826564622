"""The router of a mixture-of-experts layer: which experts each token visits (chapter 16 §2).

A linear layer scores every expert for every token (``[T, E]`` logits); the softmax of the
scores, cut to each token's ``top_k`` largest, says which experts run and how much each one's
output weighs. Mixtral, and Qwen3-MoE when its config says ``norm_topk_prob``, rescale the
``top_k`` kept probabilities to sum to 1; otherwise they keep the share of the softmax they had.
The router is replicated on every tensor-parallel rank (it is small: ``E x H``) and never
quantized: a shifted score can send a token to another expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts from the router's ``logits`` and weigh them.

    Handout (chapter 16 §2, assignment ``16.route``):

    - ``logits``: ``[T, E]``, any float dtype, one row of expert scores per token (``T`` may
      be 0). ``top_k``: an int with ``1 <= top_k <= E``.
    - Returns ``(weights, ids)``: ``weights`` ``[T, top_k]`` float32, ``ids`` ``[T, top_k]``
      int64. Row ``t`` names the ``top_k`` experts with the largest softmax probability of row
      ``t`` (softmax over the ``E`` experts, computed in float32), largest first, ties broken
      as ``torch.topk`` breaks them (Hugging Face's models pick the same way, so the greedy
      tokens match theirs), and ``weights[t, j]`` is the probability of expert ``ids[t, j]``.
    - ``renormalize``: divide each row of ``weights`` by its sum, so it sums to 1 (Mixtral;
      Qwen3-MoE with ``norm_topk_prob``). Without it the weights are the softmax's own
      probabilities and a row sums to at most 1.
    - Pure function: ``logits`` is not modified.

    The MoE layer (``nanovllm/layers/fused_moe.py``) then computes, for every token,
    ``sum_j weights[t, j] * expert_{ids[t, j]}(x_t)``.
    """
    # >>> assignment 16.route (4 points)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
    # <<< assignment 16.route


class Router(nn.Module):
    """The gate: ``[E, H]`` weights (``...mlp.gate.weight`` in Hugging Face checkpoints)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, H]`` -> ``(weights [T, top_k] float32, ids [T, top_k] int64)``."""
        return route(F.linear(x, self.weight), self.top_k, self.renormalize)

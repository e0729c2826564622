"""From logits to tokens (chapter 01).

Greedy rows take the arg-max. The other rows are scaled by their temperature, filtered
(top-k, top-p, min-p) and sampled with the exponential-race form of the Gumbel-max trick:
``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with probability ``p_i``, and needs no
cumulative sum. A request with a seed draws its noise from its own generator, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingTensors:
    """Per-row sampling settings for one batch, on the logits' device."""

    temperatures: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor | None  # [B] int; None when no row filters (also top_p, min_p)
    top_p: torch.Tensor | None  # [B] float, 1 when disabled
    min_p: torch.Tensor | None  # [B] float, 0 when disabled
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    all_greedy: bool
    any_filter: bool


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, top-p nucleus and min-p floor.

    Handout (chapter 01 §2.2, assignment ``01.filter_logits``): ``logits`` is ``[B, V]``
    fp32 (already divided by the temperature); ``top_k`` ``[B]`` int (``V`` = off),
    ``top_p`` ``[B]`` float (1 = off) and ``min_p`` ``[B]`` float (0 = off) are per row.
    Return a new ``[B, V]`` tensor: the kept logits unchanged, the others ``-inf``. Keep a
    token when it is among the row's ``top_k`` largest; then, on the distribution
    renormalised over those (as vLLM does), when the probability mass of the tokens ranked
    above it is below ``top_p`` (so the top token always stays, and ``top_p = 1`` keeps
    everything even where an fp32 running sum creeps past 1), and when its probability is at
    least ``min_p`` times the row's largest.
    Hint: sort each row once (descending, keeping the order), mask by rank, softmax and
    ``cumsum`` in sorted order, then ``scatter_`` the masked row back to vocabulary order.
    """
    # >>> assignment 01.filter_logits (6 points)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    # top-p and min-p see the distribution renormalised after the top-k cut (as in vLLM).
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass *before* it is below top_p: the top token always stays.
    # (top_p = 1 must keep everything, even where the fp32 running sum creeps past 1.)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    # <<< assignment 01.filter_logits


class Sampler(nn.Module):
    """Samples one token per row; owns the generator shared by the unseeded rows."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """One token per row of ``logits``, each row under its own settings.

        Handout (chapter 01 §2.3, assignment ``01.sampler``). ``logits`` is ``[B, V]`` on any
        device, any float dtype (work in fp32); ``params`` holds per-row tensors on the same
        device (``SamplingTensors``). Return ``[B]`` int64 token ids on that device.

        - A row with temperature 0 is greedy: its token is the arg-max of its logits, whatever
          the other rows do. When ``params.all_greedy`` is set, no random number is drawn.
        - Every other row divides its logits by its temperature, applies ``filter_logits``
          (only when ``params.any_filter``; it takes the per-row ``top_k``, ``top_p``,
          ``min_p``) and samples from the softmax of what remains with the exponential race
          of §2.3: the token is ``argmax(p_i / E_i)`` over the vocabulary, with ``E_i ~ Exp(1)``
          (a filtered token, ``p_i = 0``, never wins).
        - The noise, exactly (so that a seed means the same tokens as the reference): one
          ``exponential_`` of the whole ``[B, V]`` from the shared ``self.generator``; then
          every row whose ``params.generators[row]`` is not None (a request with a ``seed``)
          is redrawn in place with one ``exponential_`` of its ``V`` values from that
          generator. So a seeded row draws ``V`` numbers per call from its own stream and its
          token depends only on its own logits, settings and generator: never on which rows
          share the batch or where it sits (vLLM's semantics). Greedy rows may draw noise too.
        - No host synchronisation: this runs on the GPU every step while the CPU prepares
          the next one. Read no device value on the host (no ``.item()``, ``.tolist()``,
          ``if tensor``, or boolean-mask indexing, whose result size the host must wait
          for); pick per row with tensor operations instead. ``all_greedy``, ``any_filter``
          and ``generators`` are host values: branch on those freely.
        """
        # >>> assignment 01.sampler (8 points)
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if params.all_greedy:
            return greedy
        temps = params.temperatures
        # Greedy rows divide by 1 (not 0) and take the arg-max below: no branch on the device.
        scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
        if params.any_filter:
            scaled = filter_logits(scaled, params.top_k, params.top_p, params.min_p)
        probs = scaled.softmax(dim=-1)
        # Exp(1) noise: one draw for the whole batch, then seeded rows redrawn from their own
        # generators, so that a seeded row's noise does not depend on its neighbours.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(params.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)
        # <<< assignment 01.sampler


def compute_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's logprob and rank, and each row's k most likely tokens.

    ``logprobs`` [B, V] float32 is already log-softmaxed, ``sampled`` [B] int64. Returns
    (sampled_logprob [B], sampled_rank [B] int64, topk_ids [B, k], topk_logprobs [B, k]);
    k = 0 gives empty [B, 0] tensors. The rank follows vLLM's code: the number of tokens at
    least as likely as the sampled one, itself included (1 = the most likely; a token tied
    with others gets the worst rank of its tie).
    """
    sampled_logprob = logprobs.gather(-1, sampled[:, None])
    rank = (logprobs >= sampled_logprob).sum(dim=-1)
    topk_logprobs, topk_ids = logprobs.topk(k, dim=-1)
    return sampled_logprob.squeeze(-1), rank, topk_ids, topk_logprobs

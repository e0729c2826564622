"""Exact rejection sampling over a batch of proposals (chapter 14 §3; Leviathan et al. 2023,
Chen et al. 2023).

A proposed token ``d`` drawn from the draft's distribution ``q`` is kept with probability
``min(1, p(d) / q(d))``, ``p`` being the target's; at the first rejection the token is drawn
from ``max(0, p - q)`` renormalised instead, and when every proposal is kept a bonus token comes
from the target's next distribution. Whatever ``q`` is, each emitted token is distributed
exactly as ``p``: speculation changes the speed, never the output's distribution. A greedy
request is the special case of one-hot distributions: a proposal is kept iff it is the
target's arg-max, and the first mismatch is replaced by that arg-max.

``rejection_sample`` is the rule (assignment ``14.rejection_sample``); ``target_probs`` and
``sample_rows`` are the sampling around it, with the engine's per-request generators.
"""

from __future__ import annotations

import torch

from nanovllm.layers.sampler import SamplingTensors, filter_logits


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject a batch of proposals; returns ``(num_accepted, next_probs)``.

    Handout (chapter 14 §3, assignment ``14.rejection_sample``). Shapes: ``B`` requests, at
    most ``K`` proposals each (``K`` may be 0), vocabulary ``V``.

    - ``target_probs`` [B, K+1, V] float: row b's target distribution at each of its
      positions: ``[b, j]`` scores the token after proposal j-1 (``[b, 0]``: after the
      request's last real token), ``[b, num_drafts[b]]`` is where a bonus token comes from.
    - ``draft_token_ids`` [B, K] int64, the proposals; entries at ``j >= num_drafts[b]`` are
      padding (any value, e.g. -1) and must be ignored.
    - ``num_drafts`` [B] int64 in ``[0, K]``.
    - ``draft_probs`` [B, K, V] float, the distribution each proposal was drawn from, or
      None for a deterministic proposer (n-gram): then ``q`` is one-hot on the proposal.
    - ``uniforms`` [B, K] float in [0, 1): proposal j of row b is accepted iff
      ``uniforms[b, j] < p(d) / q(d)`` (``p = target_probs[b, j]``, ``q`` its draft
      distribution, ``d`` the proposal).

    ``num_accepted`` [B] int64: how many proposals of each row are kept, the longest prefix of
    accepted ones (a proposal after a rejection is never kept, whatever its uniform).
    ``next_probs`` [B, V] float, the distribution the row's next token is drawn from: at
    position ``a = num_accepted[b]``, if ``a < num_drafts[b]`` (a rejection) the residual
    ``max(0, p - q)`` normalised to sum 1 (should it sum to 0, ``p`` itself), else (all kept,
    or no proposals) ``target_probs[b, a]`` unchanged. Do not sample; do not change the
    inputs; no host synchronisation (no ``.item()``, ``.tolist()``, Python loops over rows).
    """
    # >>> assignment 14.rejection_sample (8 points)
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long, device=rows.device), target_probs[:, 0]
    drafts = draft_token_ids.clamp(min=0)  # padding is masked below; it must index safely
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    proposed = torch.arange(k, device=rows.device)[None, :] < num_drafts[:, None]
    # u < p/q written as u * q < p: no division, and q = 0 (never drawn) never accepts.
    accepted = (uniforms * q_draft < p_draft) & proposed
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # the accepted prefix
    p_next = target_probs[rows, num_accepted]  # [B, V]
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, drafts[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    rejected = (num_accepted < num_drafts)[:, None]
    return num_accepted, torch.where(rejected, residual, p_next)
    # <<< assignment 14.rejection_sample


def target_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Each row's distribution under its request's settings: temperature, top-k, top-p,
    min-p as the sampler applies them (chapter 01); a greedy row is one-hot on its arg-max,
    so that rejection sampling reduces to "keep while it equals the arg-max"."""
    logits = logits.float()
    greedy = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if params.all_greedy:
        return greedy
    temps = params.temperatures
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
    if params.any_filter:
        scaled = filter_logits(scaled, params.top_k, params.top_p, params.min_p)
    return torch.where((temps > 0)[:, None], scaled.softmax(dim=-1), greedy)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None],
                shared: torch.Generator, all_greedy: bool = False) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] by the exponential race (chapter 01 §2.3); a
    row with its own generator (a seeded request) draws its noise from it alone. A one-hot
    row returns its token whatever the noise, so when every row is one (``all_greedy``) no
    noise is drawn: [B, V] random numbers are the costliest part of a greedy step here."""
    if all_greedy:
        return probs.argmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def uniform_rows(counts: list[int], generators: list[torch.Generator | None],
                 shared: torch.Generator, device: torch.device) -> torch.Tensor:
    """[len(counts), max(counts)] uniforms in [0, 1); a seeded row draws its own
    ``counts[row]`` from its generator, so its stream depends on its proposals alone."""
    draws = torch.rand(len(counts), max(counts, default=0), generator=shared, device=device)
    for row, (generator, n) in enumerate(zip(generators, counts)):
        if generator is not None and n:
            draws[row, :n] = torch.rand(n, generator=generator, device=device)
    return draws

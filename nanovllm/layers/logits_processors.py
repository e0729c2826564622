"""Shaping the logits before sampling: vLLM's request-level rules (chapter 01 §2.6 states them).

Allowed tokens (a listed row keeps only its listed tokens), banned tokens (``min_tokens``' EOS
and stop ids, one-token bad words), bad sequences (ban ``w_n`` when the last ``n - 1``
*generated* tokens are ``w_1..w_{n-1}``; as in vLLM a word begun in the prompt is not caught),
logit bias (OpenAI's), the repetition penalty (Hugging Face's ``RepetitionPenaltyLogitsProcessor``
and vLLM's: ``l / p`` if ``l > 0`` else ``l * p`` over prompt and output tokens), and frequency
and presence penalties over generated counts (OpenAI's). Order, as vLLM v1's
``Sampler.apply_logits_processors`` (``vllm/v1/sample/sampler.py``) then ``apply_penalties``
(``vllm/model_executor/layers/utils.py``): allowed, bans, bad words, bias, penalties. Bans and a
finite bias commute, so every ban goes before the bias.

Batched tensor code with no host sync (no ``.item()``, boolean-mask indexing or loop over rows),
so it can follow a CUDA-graph replay under async scheduling; token ids padded with -1 never
count; only the frequency/presence counts take a [B, V] buffer. A row left all -inf (its allowed
tokens all banned) samples a meaningless token: the engine must reject such a request when it
arrives; a guard here would hide that bug and cost a [B, V] reduction every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass
class LogitsProcessingTensors:
    """One step's per-row settings for the B rows being sampled, on the logits' device.
    Every field is optional (None: no row uses it)."""

    prompt_ids: torch.Tensor | None = None  # [B, Lp] int64, padded with -1
    output_ids: torch.Tensor | None = None  # [B, Lo] int64, left-aligned, padded with -1
    output_lens: torch.Tensor | None = None  # [B] int64, valid entries of output_ids
    presence_penalty: torch.Tensor | None = None  # [B] float32 (0 = off)
    frequency_penalty: torch.Tensor | None = None  # [B] float32 (0 = off)
    repetition_penalty: torch.Tensor | None = None  # [B] float32 (1 = off)
    # (rows [N], token ids [N], values [N]): logits[row, tok] += value (repeats add up)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows [M], token ids [M]): listed rows keep only their listed tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows [K], token ids [K]): set to -inf
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows [S], prefixes [S, P] right-aligned and padded with -1 on the left,
    #  prefix_lens [S], last_tokens [S]); needs output_ids and output_lens
    bad_sequences: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def process_logits(logits: torch.Tensor, t: LogitsProcessingTensors) -> torch.Tensor:
    """Apply every rule to ``logits`` [B, V] float32 *in place* and return it.

    Callers that need the raw scores afterwards (vLLM's default logprobs are computed
    before any processing) must take them first or pass a copy. A row with every setting
    off comes back bit-identical.
    """
    if t.allowed is not None:
        _keep_only_allowed(logits, *t.allowed)
    if t.banned is not None:
        logits.index_put_(t.banned, logits.new_full((), NEG_INF))
    if t.bad_sequences is not None:
        _ban_bad_sequences(logits, t.output_ids, t.output_lens, *t.bad_sequences)
    if t.bias is not None:
        rows, tokens, values = t.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    _apply_penalties(logits, t)
    return logits


def _keep_only_allowed(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    # Save the listed logits, wipe the listed rows, write the saved ones back: no [B, V] mask.
    kept = logits[rows, tokens]
    restricted = torch.zeros_like(logits[:, 0], dtype=torch.bool).index_fill_(0, rows, True)
    logits.masked_fill_(restricted[:, None], NEG_INF)
    logits.index_put_((rows, tokens), kept)


def _ban_bad_sequences(logits: torch.Tensor, output_ids: torch.Tensor, output_lens: torch.Tensor,
                       rows: torch.Tensor, prefixes: torch.Tensor, prefix_lens: torch.Tensor,
                       last_tokens: torch.Tensor) -> None:
    width = prefixes.shape[1]
    slot = torch.arange(width, device=logits.device)
    # Slot j of a prefix lines up with output position len - width + j. A leading -1 column
    # turns positions before the output's start into -1, which matches no token.
    pos = output_lens[rows, None] - width + slot + 1
    padded = F.pad(output_ids, (1, 0), value=-1)
    recent = padded[rows[:, None], pos.clamp(min=0)]  # [S, width]
    needed = slot >= width - prefix_lens[:, None]  # the -1 padding on the left is not needed
    hit = ((recent == prefixes) | ~needed).all(dim=-1)
    # Adding -inf (hit) or 0 (miss) keeps the shapes fixed: no boolean indexing, no sync.
    penalty = torch.where(hit, NEG_INF, 0.0).to(logits.dtype)
    logits.index_put_((rows, last_tokens), penalty, accumulate=True)


def _apply_penalties(logits: torch.Tensor, t: LogitsProcessingTensors) -> None:
    if t.repetition_penalty is not None:
        _apply_repetition_penalty(logits, t.prompt_ids, t.output_ids, t.repetition_penalty)
    if t.frequency_penalty is None and t.presence_penalty is None:
        return
    # counts[r, v]: how often row r generated v. Padding (-1) adds 0 to token 0.
    ids = t.output_ids
    counts = torch.zeros_like(logits).scatter_add_(1, ids.clamp(min=0), (ids >= 0).to(logits))
    # In place (addcmul_, clamp_): no new [B, V] tensors beyond the counts.
    if t.frequency_penalty is not None:
        logits.addcmul_(counts, t.frequency_penalty[:, None], value=-1)
    if t.presence_penalty is not None:
        logits.addcmul_(counts.clamp_(max=1), t.presence_penalty[:, None], value=-1)


def _apply_repetition_penalty(logits: torch.Tensor, prompt_ids: torch.Tensor | None,
                              output_ids: torch.Tensor | None, penalty: torch.Tensor) -> None:
    """Gather the seen tokens' logits, penalise them, scatter them back (as Hugging Face does).

    A token seen several times is written several times with the same value. Padding is
    pointed at the row's largest id, a seen token, so it rewrites that token's value too;
    a row that has seen nothing gets p = 1 and writes its token 0 back unchanged.
    """
    ids = torch.cat([x for x in (prompt_ids, output_ids) if x is not None], dim=1)
    if ids.shape[1] == 0:  # no row has seen a token yet
        return
    largest = ids.max(dim=1, keepdim=True).values
    p = torch.where(largest >= 0, penalty[:, None], 1.0)
    ids = torch.where(ids >= 0, ids, largest).clamp(min=0)
    seen = logits.gather(1, ids)
    # Divide, not multiply by 1/p: bit-identical to Hugging Face's processor.
    logits.scatter_(1, ids, torch.where(seen > 0, seen / p, seen * p))

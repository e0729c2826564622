"""Token masks: filled on the host from the matchers, applied to the logits on the device
(chapter 15 §5).

A mask is a *packed* bitmask, xgrammar's layout: per constrained row, ``ceil(V / 32)`` int32
words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed. Packing matters: a
row of Qwen3's 151,936 tokens is 19 KB packed and 152 KB as bools, and it crosses to the device
every step.

``apply_grammar_masks`` is what the model runner calls between the LM head and the sampler:
only the rows whose sequence has a matcher (``Sequence.grammar``) are filled and masked, so
constrained and unconstrained requests share one batch and an unconstrained row comes back
bit-identical. On a GPU it runs after the forward pass is queued: the host fills the masks
while the device computes the step.

Overlap under async scheduling (``LLMEngine._execute_constrained``). Step n's mask needs the
matcher *after* step n-1's token, and with async scheduling that token is still on the device
when step n is planned. Two honest designs: (a) vLLM v1's (its ``EngineCore`` defers
``sample_tokens`` while ``SchedulerOutput.pending_structured_output_tokens``): queue step n's
forward pass for the whole batch, *then* land step n-1, advance the matchers with its tokens
(``Scheduler._took_token``) and fill step n's masks while the device computes the forward
pass, and only then queue step n's sampling; or (b) split the batch, keep the unconstrained
rows in the pipeline and make the constrained ones wait a step. We take (a): one forward pass
per step, every row's tokens reported one call late exactly as without constraints, and the
host's matcher work (accepting n-1's tokens, filling n's masks) hidden under the forward
pass; the device idles only if that work outlasts it (``benchmarks/structured_output.py``
measures both). (b) would run the constrained requests every other step and sample twice
per step. A batch with no constrained row never takes this path: no extra wait.

``min_tokens`` with a constraint: while ``min_tokens`` holds a request back, its EOS is
banned (``SamplingInputs``). If the constraint is complete and allows nothing but its stop
token, the two rules leave no token at all; here ``min_tokens`` yields to the constraint
(``apply_grammar_masks`` names such rows, the model runner undoes logits processing there) and
the request ends with "stop", shorter than ``min_tokens``. Refusing the combination at
submission could not be exact (whether a constraint can end early depends on the output), and
ending such requests with "error" punishes a valid request.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import Any, Protocol

import torch

NEG_INF = float("-inf")
BITS = 32  # tokens per int32 word of a packed bitmask


class Constrainable(Protocol):
    """What the masks read of a sequence (``engine.sequence.Sequence``): its matcher, or None."""

    grammar: Any


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed bitmask over ``vocab_size`` tokens."""
    return -(-vocab_size // BITS)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, the logits that a packed bitmask forbids; return ``logits``.

    Handout (chapter 15 §5, assignment ``15.apply_mask``). ``logits`` is ``[B, V]`` float on
    any device. ``bitmask`` is ``[R, W]`` int32 on the same device with ``32 * W >= V``:
    bitmask row ``i`` constrains logits row ``rows[i]`` (``rows`` is ``[R]`` int64, distinct
    row indices, any order). Token ``t`` is allowed in such a row when bit ``t % 32`` (bit 0 the
    least significant) of word ``t // 32`` is 1; a word's sign bit is token ``32k + 31``, so a
    word of -1 allows all 32 tokens. Bits for ``t >= V`` are ignored. Forbidden logits become
    ``-inf``; allowed ones and every row not in ``rows`` keep their exact values. ``R = 0``
    changes nothing.

    No host synchronisation: this runs every step on the GPU while the CPU prepares the
    next one (no ``.item()``, ``.tolist()``, ``.nonzero()`` or boolean-mask indexing).
    """
    # >>> assignment 15.apply_mask (6 points)
    if rows.numel() == 0:
        return logits
    vocab = logits.shape[1]
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    # [R, W, 32]: bit j of word k is token 32k + j; >> on int32 keeps the sign, & 1 drops it
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)
    return logits
    # <<< assignment 15.apply_mask


def fill_bitmask(seqs: SequenceOf[Constrainable], vocab_size: int
                 ) -> tuple[list[int], torch.Tensor] | None:
    """On the host: the rows of ``seqs`` that carry a matcher, and their next-token masks
    ``[len(rows), bitmask_words(vocab_size)]`` int32; None when no row is constrained (the
    common case costs one pass over the batch)."""
    rows = [r for r, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    bitmask = torch.empty((len(rows), bitmask_words(vocab_size)), dtype=torch.int32)
    for i, r in enumerate(rows):
        seqs[r].grammar.fill(bitmask, i)
    return rows, bitmask


def apply_grammar_masks(logits: torch.Tensor, seqs: SequenceOf[Constrainable],
                        to_device: Callable[[object, torch.dtype], torch.Tensor]
                        ) -> torch.Tensor | None:
    """Mask, in place, the rows of ``logits`` [B, V] (row i samples ``seqs[i]``) whose sequence
    is constrained; ``to_device`` copies host values to the logits' device without waiting.
    Returns the rows (an int64 index on the device) whose constraint allows only its stop
    tokens, where ``min_tokens`` must yield (see the module docstring); None if there are none."""
    filled = fill_bitmask(seqs, logits.shape[1])
    if filled is None:
        return None
    rows, bitmask = filled
    apply_token_bitmask(logits, to_device(bitmask, torch.int32), to_device(rows, torch.int64))
    must_stop = [r for i, r in enumerate(rows) if seqs[r].grammar.only_stop_allowed(bitmask, i)]
    return to_device(must_stop, torch.int64) if must_stop else None

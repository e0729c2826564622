"""The scheduler's half of speculative decoding (chapter 14 §2): slots for the proposals,
the proposals into the step, and the rollback of rejected ones.

Proposals are tentative tokens: they join ``seq.token_ids`` only between planning and
verifying one step (so that the step's layout, ``pack_step``, reads them like any token), and
their KV slots are reserved *after* the step's allocation, so the prefix cache never registers
a block that holds one. After the verify pass ``Scheduler.update_from_output`` (the one writer
of a request's progress) counts the accepted proposals as computed, not the rejected ones
(``num_rejected``: their cache entries are simply overwritten later); ``apply_verified`` then
takes the proposals back out of ``token_ids`` and delivers the accepted ones plus the token
the target chose, one at a time through the scheduler's stop checks.
"""

from __future__ import annotations

import time
from typing import Any

from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nanovllm.engine.sequence import Sequence

# The scheduler (``engine/scheduler.py``), which calls this module: typed ``Any`` rather than
# imported, so the two modules do not import each other.
Scheduler = Any


def reserve_draft_slots(scheduler: Scheduler, batch: SchedulerOutput, k: int) -> list[int]:
    """How many proposals each sequence of ``batch`` may verify this step, with KV slots
    reserved for them: 0 unless it decodes; at most ``k``, what its ``max_tokens`` and
    ``max_model_len`` leave after the step's own token, and what is left of the step's token
    budget. Speculation never preempts: a sequence whose extra blocks do not fit proposes
    only into the slots its last block has left."""
    budget = scheduler.max_num_batched_tokens - batch.num_tokens
    max_model_len = scheduler.stop_checker.max_model_len
    bm = scheduler.block_manager
    granted = []
    for seq, decodes in zip(batch.seqs, batch.is_decode):
        n = min(k, budget, seq.params.max_tokens - seq.num_output_tokens - 1) if decodes else 0
        if max_model_len is not None:
            n = min(n, max_model_len - seq.num_tokens - 1)
        if n > 0 and not bm.allocate(seq, 1 + n):  # after the step's 1 token: n more slots
            n = min(n, len(seq.block_table) * bm.block_size - seq.num_tokens)
        n = max(n, 0)
        budget -= n
        granted.append(n)
    return granted


def attach_drafts(batch: SchedulerOutput, drafts: list[list[int]]) -> None:
    """Put each sequence's proposals (``drafts[i]`` for ``batch.seqs[i]``) after its last token
    and into the step; the step becomes a speculative one (``batch.draft_token_ids``)."""
    batch.draft_token_ids = {}
    for i, (seq, draft) in enumerate(zip(batch.seqs, drafts)):
        if draft:
            seq.token_ids += draft
            batch.num_new_tokens[i] += len(draft)
            batch.num_tokens += len(draft)
            batch.draft_token_ids[seq.seq_id] = list(draft)


def detach_drafts(batch: SchedulerOutput) -> None:
    """Undo ``attach_drafts`` (the step failed before anything was verified)."""
    for i, seq in enumerate(batch.seqs):
        draft = batch.draft_token_ids.pop(seq.seq_id, None)
        if draft:
            del seq.token_ids[-len(draft):]
            batch.num_new_tokens[i] -= len(draft)
            batch.num_tokens -= len(draft)


def num_rejected(step: SchedulerOutput, seq: Sequence, emitted: list[int] | None) -> int:
    """How many of ``seq``'s proposals in ``step`` were rejected, given the tokens it emits
    (its accepted proposals then the target's own; None: it sampled nothing)."""
    if emitted is None or seq.is_finished:
        return 0
    return len(step.draft_token_ids.get(seq.seq_id, ())) - (len(emitted) - 1)


def apply_verified(scheduler: Scheduler, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """Deliver a verified speculative step, whose progress the scheduler has counted (the
    rejected proposals' slots are overwritten later): ``output.sampled_token_ids[i]`` is the
    list of tokens sequence i emits (its accepted proposals, then the target's own token), or
    None mid-prompt. Returns one report per sequence that got tokens."""
    step, now = output.step, time.perf_counter()
    reports = []
    for seq, tokens in zip(step.seqs, output.sampled_token_ids):
        draft = step.draft_token_ids.get(seq.seq_id, [])
        if draft:
            del seq.token_ids[-len(draft):]  # tentative: the accepted ones come back below
        if tokens is None or seq.is_finished:
            continue
        accepted = len(tokens) - 1
        seq.metrics.num_draft_tokens += len(draft)
        seq.metrics.num_accepted_tokens += accepted
        reports.append(_deliver(scheduler, seq, tokens, now))
    return reports


def _deliver(scheduler: Scheduler, seq: Sequence, tokens: list[int],
             now: float) -> EngineCoreOutput:
    """Append ``tokens`` one by one through the stop checks (a stop token among accepted
    proposals ends the request there); one report with the tokens kept."""
    kept = []
    for token in tokens:
        seq.token_ids.append(token)
        seq.num_delivered_tokens += 1
        kept.append(token)
        try:
            report = scheduler._took_token(seq, token, now)
        except Exception as err:  # e.g. its stop check: this request's problem alone
            report = scheduler._finish(seq, "error", error=f"{type(err).__name__}: {err}")
        if report.finished:
            report.new_token_ids = kept
            return report
    report.new_token_ids = kept
    return report

"""One speculative engine step, and what it measured (chapter 14 §2).

``Speculator.execute`` replaces the model runner's launch/collect for a step: reserve slots
and propose (``scheduling.py``, a proposer), put the proposals into the step, run ONE target
forward pass over every request's new tokens (prompt chunks, plain decodes and proposals
alike: ``pack_step``'s layout), take the target's distributions at each proposal and after
the last, and let ``rejection_sample`` decide. The scheduler then rolls back what was
rejected (``Scheduler.update_from_output`` -> ``apply_verified``).

What speculation does not run with is refused when the engine is built (``EngineConfig``)
or a request is submitted (``check_params``), never silently wrong. Under tensor parallelism
(chapter 09) rank 0 alone proposes, samples and accepts; the workers run every pass that holds
collectives with it: the verify step, and a model draft's passes (``make_proposer`` builds
their side).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import torch

from nanovllm.engine.executor import WorkerDiedError
from nanovllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.draft_layers import DraftLayersProposer, select_rows
from nanovllm.engine.spec_decode.draft_model import DraftModelProposer
from nanovllm.engine.spec_decode.ngram_proposer import NgramProposer
from nanovllm.engine.spec_decode.rejection_sampler import (
    rejection_sample,
    sample_rows,
    target_probs,
    uniform_rows,
)
from nanovllm.engine.spec_decode.scheduling import attach_drafts, detach_drafts, reserve_draft_slots
from nanovllm.sampling_params import SamplingParams
from nanovllm.speculative_config import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (vLLM's names): proposals made and accepted, in all
    and by position (``[j]``: the (j+1)-th proposal of a step)."""

    k: int
    num_steps: int = 0  # steps in which some request proposed
    num_drafts: int = 0  # (request, step) pairs with proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_draft_tokens_per_pos = [0] * self.k
        self.num_accepted_tokens_per_pos = [0] * self.k

    def record(self, proposed: list[int], accepted: list[int]) -> None:
        """One step: each proposing request's proposal count and accepted count."""
        self.num_steps += 1
        for n, a in zip(proposed, accepted):
            self.num_drafts += 1
            self.num_draft_tokens += n
            self.num_accepted_tokens += a
            for j in range(n):
                self.num_draft_tokens_per_pos[j] += 1
                self.num_accepted_tokens_per_pos[j] += j < a

    def step_fields(self) -> dict[str, Any]:
        """These counts as ``StepMetrics``' fields (``engine/metrics.py``): what a step
        reports, also from an engine core in another process (the server's counters)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos)}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the proposals made at position j, the fraction accepted."""
        return [a / n if n else 0.0 for a, n in zip(self.num_accepted_tokens_per_pos,
                                                     self.num_draft_tokens_per_pos)]

    @property
    def mean_tokens_per_draft(self) -> float:
        """Tokens a proposing request gains per step: accepted proposals plus the target's."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


# Sampling features a speculative step does not apply per proposal: refused at submission.
_UNSUPPORTED = {
    "logprobs": lambda p: p.logprobs is not None,
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "presence_penalty": lambda p: p.presence_penalty != 0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1,
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "bad_words": lambda p: bool(p.bad_words),
    "min_tokens": lambda p: p.min_tokens > 0,
    "structured_outputs": lambda p: p.structured_outputs is not None,  # (chapter 15's masks)
}


def make_proposer(config: SpeculativeConfig, runner, tokenizer=None
                  ) -> NgramProposer | DraftLayersProposer:
    """The proposer of ``config.method``: rank 0's (``Speculator``), or a tensor-parallel
    worker's side of a draft that is a model, which runs rank 0's draft passes on its shard
    (``worker.py``; it has no tokenizer, rank 0 checked the draft's)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        return DraftModelProposer(runner, config.model, k, tokenizer)
    return DraftLayersProposer(runner, config.num_layers, k)


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner, scheduler) -> None:
        self.config, self.runner, self.scheduler = config, runner, scheduler
        k = config.num_speculative_tokens
        self.proposer = make_proposer(config, runner, scheduler.stop_checker.tokenizer)
        # A draft model keeps a cache of its own: it must see every target step (``follow``).
        self.follows_target = isinstance(self.proposer, DraftModelProposer)
        self.stats = SpecDecodeStats(k)
        self.last_step = SpecDecodeStats(k)  # the latest step's counts alone (StepMetrics)

    def release(self) -> None:
        """Give back what the proposer holds on the device (its CUDA graphs, a draft model's
        weights and cache), before the runner gives back its own (``LLMEngine.shutdown``)."""
        self.proposer.release()

    @staticmethod
    def check_params(params: SamplingParams) -> None:
        """Refuse a request whose sampling settings speculation does not apply."""
        used = [name for name, asks in _UNSUPPORTED.items() if asks(params)]
        if used:
            raise ValueError(f"SamplingParams {used} cannot be used with speculative decoding "
                             "(speculative_config) yet; build the LLM without it for them")

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Propose, verify and accept for every sequence of ``batch`` (a scheduled step).

        A failure that is one request's -- its proposer raising for it, a proposal that is not
        token ids fitting its reserved slots, its own inputs to the verify pass -- ends that
        request alone with "error" (``Scheduler.fail`` frees its blocks), and the step is
        tried again without it, as the engine's plain steps do (``LLMEngine._launch``)."""
        self.last_step = SpecDecodeStats(self.config.num_speculative_tokens)
        while batch.seqs:
            budgets = reserve_draft_slots(self.scheduler, batch,
                                          self.config.num_speculative_tokens)
            try:
                drafts, draft_probs = self._propose(batch.seqs, budgets)
                failed = self._bad_proposals(batch.seqs, budgets, drafts)
            except Exception:
                failed = self._proposal_errors(batch.seqs, budgets)
                if not failed:
                    raise  # not one request's fault
            if failed:
                self.scheduler.fail(batch, failed)
                continue
            attach_drafts(batch, drafts)
            try:
                tokens = self._verify(batch, draft_probs)
            except BaseException as err:
                detach_drafts(batch)  # nothing was accepted: the step's state is as scheduled
                failed = self.runner.request_errors(batch) if isinstance(err, Exception) else []
                if not failed:
                    if isinstance(err, Exception) and self.runner.executor is not None:
                        self.runner.executor.raise_if_a_worker_died()  # explains it better
                    raise
                self.scheduler.fail(batch, failed)
                continue
            return ModelRunnerOutput(batch, tokens)
        return ModelRunnerOutput(batch, [])  # every request of the step failed

    def _propose(self, seqs: list[Sequence], budgets: list[int]
                 ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Each sequence's proposals and the draft's distributions (None: n-gram's, or
        greedy requests' only)."""
        draft_probs = None
        if isinstance(self.proposer, NgramProposer):
            drafts = self.proposer.propose(seqs, budgets)
        else:
            sampling, _ = self.runner._sampling_inputs(seqs)
            drafts, draft_probs = self.proposer.propose(seqs, budgets, sampling)
        return drafts, draft_probs

    def _bad_proposals(self, seqs: list[Sequence], budgets: list[int],
                       drafts: list[list[int]]) -> list[tuple[Sequence, Exception]]:
        """The sequences whose proposals would not fit the step: more than their reserved
        slots, or not token ids of the vocabulary (each with its error)."""
        if len(drafts) != len(seqs):
            raise ValueError(f"the {self.config.method} proposer returned {len(drafts)} "
                             f"proposal lists for {len(seqs)} requests")
        vocab = self.runner.model_config.vocab_size
        failed = []
        for seq, budget, draft in zip(seqs, budgets, drafts):
            if len(draft) > budget or not all(isinstance(t, Integral) and 0 <= t < vocab
                                              for t in draft):
                failed.append((seq, ValueError(
                    f"the {self.config.method} proposer proposed {list(draft)[:8]} (length "
                    f"{len(draft)}); expected at most {budget} token ids in [0, {vocab})")))
        return failed

    def _proposal_errors(self, seqs: list[Sequence], budgets: list[int]
                         ) -> list[tuple[Sequence, Exception]]:
        """After proposing for ``seqs`` raised: the sequences whose proposals fail when made
        alone, with their errors (empty: the failure is not one request's)."""
        failed = []
        for seq, budget in zip(seqs, budgets):
            try:
                drafts, _ = self._propose([seq], [budget])
                failed += self._bad_proposals([seq], [budget], drafts)
            except WorkerDiedError:
                raise  # the engine's failure, not this request's
            except Exception as err:
                failed.append((seq, err))
        return failed

    @torch.inference_mode()
    def _verify(self, batch: SchedulerOutput, draft_probs: torch.Tensor | None
                ) -> list[list[int] | None]:
        """One target forward pass over the step; each sequence's emitted tokens."""
        runner = self.runner
        step = runner.prepare(batch)  # pack_step reads the proposals as ordinary tokens
        seqs = step.sample_seqs  # the rows that sample, decodes first
        sampling = runner._sampling_inputs(seqs)[0] if seqs else None  # (no logits processing)
        drafts = [batch.draft_token_ids.get(s.seq_id, []) for s in seqs]
        counts = [len(d) for d in drafts]
        # Each sampled row's last k_b + 1 positions: after the real token, after each proposal.
        ends = step.plan.longs.unpack()["sample_indices"].tolist()
        index = [p for end, n in zip(ends, counts) for p in range(end - n, end + 1)]
        step.plan.verify_rows = index
        # Within its buckets a verify step replays the decode graphs, a row per token
        # (``cuda_graphs.as_decode_rows``); longer prompt chunks run eagerly.
        graphs, plan = runner.graphs, step.plan
        plan.use_graphs = (graphs is not None and graphs.can_run(plan.num_tokens)
                           and plan.max_seqlen_q <= self.config.num_speculative_tokens + 1)
        if runner.executor is not None:  # tensor parallelism: the workers follow this step
            runner.executor.send(("step", step.plan))
        hidden = runner._forward(step.input_ids, step.positions, step.meta, step.plan)
        # In the order of a worker's steps (ModelRunner.follow, then the draft's follow_plan):
        # under tensor parallelism each call holds collectives.
        logits = runner.model.compute_logits(hidden[runner._to_device(index, torch.int64)])
        if self.follows_target:
            self.proposer.follow(step)  # its own cache: the same tokens at the same slots
        if not seqs:
            return [None] * len(batch.seqs)
        k = max(counts)
        expand = [r for r, n in enumerate(counts) for _ in range(n + 1)]
        probs = target_probs(logits, select_rows(sampling, expand))
        where = [(r, j) for r, n in enumerate(counts) for j in range(n + 1)]
        dev = probs.device
        padded = torch.zeros(len(seqs), k + 1, probs.shape[-1], device=dev)
        padded[torch.as_tensor([r for r, _ in where], device=dev),
               torch.as_tensor([j for _, j in where], device=dev)] = probs
        draft_ids = torch.full((len(seqs), k), -1, dtype=torch.long)
        for r, d in enumerate(drafts):
            draft_ids[r, : len(d)] = torch.as_tensor(d, dtype=torch.long)
        q = None
        if draft_probs is not None and k:
            batch_row = {s.seq_id: i for i, s in enumerate(batch.seqs)}
            q = draft_probs[torch.as_tensor([batch_row[s.seq_id] for s in seqs], device=dev),
                            :k]
        shared = runner.sampler.generator
        uniforms = uniform_rows(counts, sampling.generators, shared, dev)
        accepted, next_probs = rejection_sample(padded, draft_ids.to(dev),
                                                torch.as_tensor(counts, device=dev), q, uniforms)
        chosen = sample_rows(next_probs, sampling.generators, shared,
                             sampling.all_greedy).tolist()
        accepted = accepted.tolist()
        if any(counts):
            proposed, kept = [n for n in counts if n], [a for n, a in zip(counts, accepted) if n]
            self.stats.record(proposed, kept)
            self.last_step.record(proposed, kept)
        emitted = [d[:a] + [t] for d, a, t in zip(drafts, accepted, chosen)]
        return [emitted[r] if r >= 0 else None for r in step.logit_rows]

"""Self-speculative, LayerSkip-style proposals (chapter 14 §4): the target's first
``num_layers`` decoder layers, its final norm and its LM head are the draft model.

The draft needs no weights and no KV cache of its own: its layers *are* the target's first
layers, whose keys and values for every computed position are already in the target's cache.
Drafting token j writes those layers' entries at the slot of position ``P + j`` (reserved by
``reserve_draft_slots``); the verification pass then recomputes every layer there and
overwrites them with the same values (or, past a rejection, values that later steps
overwrite again). Each draft step is a batched one-token decode through a fraction of the
model: cheaper than a target step by about ``num_layers / model_layers``.

Under tensor parallelism (chapter 09) each draft pass holds collectives (the row-parallel
layers' all-reduces, the LM head's gather), so every rank runs it: rank 0 sends the pass's
inputs, a ``StepPlan`` of one decode token per request, as a "draft" message, and the workers
run the same ``run_pass`` on their shards. Rank 0 alone samples the proposals.
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm import distributed
from nanovllm.context import attention_metadata
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.spec_decode.rejection_sampler import sample_rows, target_probs
from nanovllm.engine.step import PackedArrays, StepPlan
from nanovllm.layers.sampler import SamplingTensors


def select_rows(params: SamplingTensors, rows: list[int]) -> SamplingTensors:
    """The sampling settings of ``rows`` (indices into ``params``' rows), in that order."""
    index = torch.as_tensor(rows, device=params.temperatures.device)
    pick = lambda t: None if t is None else t[index]
    temps = params.temperatures[index]
    return SamplingTensors(temps, pick(params.top_k), pick(params.top_p), pick(params.min_p),
                           [params.generators[r] for r in rows], params.all_greedy,
                           params.any_filter)


class DraftLayersProposer:
    """Drafts with the target's first ``num_layers`` layers (vLLM-style name:
    ``{"method": "draft_layers", "num_layers": n}``)."""

    def __init__(self, runner, num_layers: int, k: int) -> None:
        self.runner, self.num_layers, self.k = runner, num_layers, k
        self.graphs: DecodeGraphs | None = None
        if num_layers:  # (a draft model captures its own, once it is built)
            self._capture_graphs(runner.model_config.hidden_size)

    def _capture_graphs(self, hidden_size: int) -> None:
        """Capture the draft's one-token passes in CUDA graphs, one per batch-size bucket, when
        the target's decode steps are captured (chapter 07): at small batch a draft pass is as
        launch-bound as a decode step. Not under tensor parallelism: every rank would have to
        capture them together."""
        runner = self.runner
        if runner.graphs is None or distributed.tp_size() > 1:
            return
        max_blocks = -(-runner.config.max_model_len // runner.block_size)
        self.graphs = DecodeGraphs(self._hidden, runner.config.max_num_seqs, max_blocks,
                                   runner.block_size, hidden_size, runner.device, runner.dtype)

    def release(self) -> None:
        """Drop the draft's CUDA graphs (``LLM.shutdown``)."""
        self.graphs = None

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The draft's final hidden states: embeddings, the first layers, the final norm
        (the decoder stack of ``models/llama.py``, cut short)."""
        decoder = self.runner.model.model
        x, residual = decoder.embed_tokens(input_ids), None
        for layer in decoder.layers[: self.num_layers]:
            x, residual = layer(positions, x, residual)
        x, _ = decoder.norm(x, residual)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits from its hidden states (a separate draft model, in
        ``draft_model.py``, has an LM head of its own)."""
        return self.runner.model.compute_logits(hidden)

    def _pass_plan(self, seqs: list[Sequence], positions: list[int], inputs: list[int]
                   ) -> StepPlan:
        """One draft pass, one query token per sequence at ``positions``, as host arrays in
        the layout of a decode step (``step.py``): what tensor-parallel workers receive."""
        bs, n = self.runner.block_size, len(seqs)
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        tables = np.full((n, max(len(s.block_table) for s in seqs)), -1, np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        longs = PackedArrays.pack(np.int64, input_ids=inputs, positions=positions,
                                  slot_mapping=slots, sample_indices=range(n),
                                  patch_targets=[], patch_sources=[])
        ints = PackedArrays.pack(np.int32, cu_seqlens_q=range(n + 1),
                                 seq_lens_k=[p + 1 for p in positions], block_tables=tables)
        return StepPlan(longs, ints, max_seqlen_q=1, num_decodes=n)

    @torch.inference_mode()
    def run_pass(self, plan: StepPlan) -> torch.Tensor:
        """One draft pass on this rank: its logits [num_seqs, V]. Under tensor parallelism
        every rank runs it in lockstep (its layers all-reduce, its LM head gathers): rank 0
        from ``propose``, each worker when rank 0's "draft" message brings the plan."""
        longs, meta = self.runner._materialize(plan)
        input_ids, positions = longs["input_ids"], longs["positions"]
        if self.graphs is not None and self.graphs.can_run(plan.num_seqs):
            return self._logits(self.graphs.run(input_ids, positions, meta))
        with attention_metadata(meta):
            return self._logits(self._hidden(input_ids, positions))

    def _pass_on_every_rank(self, plan: StepPlan) -> torch.Tensor:
        """``run_pass`` here (rank 0) and, under tensor parallelism, on every worker."""
        executor = self.runner.executor
        if executor is not None:
            executor.send(("draft", plan))
        try:
            return self.run_pass(plan)
        except Exception:
            if executor is not None:  # a lost worker explains a failed collective best
                executor.raise_if_a_worker_died()
            raise

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int], sampling: SamplingTensors
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to ``budgets[i]`` proposals for each of ``seqs`` (whose KV slots are reserved),
        each drawn from the draft's distribution under the request's sampling settings
        (``sampling``, one row per sequence); and those distributions, [len(seqs), K, V]
        (None when every request is greedy: the draft's arg-max is then one-hot)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = [i for i, b in enumerate(budgets) if b > 0]
        if not rows:
            return drafts, None
        k, runner = max(budgets), self.runner
        probs = None
        if not sampling.all_greedy:
            vocab = runner.model_config.vocab_size
            probs = torch.zeros(len(seqs), k, vocab, device=runner.device)
        last = [seqs[r].token_ids[-1] for r in rows]
        for j in range(k):
            active = [r for r in rows if budgets[r] > j]
            picked = [seqs[r] for r in active]
            positions = [s.num_tokens - 1 + j for s in picked]  # x_last at P, draft j at P + j
            inputs = [last[rows.index(r)] if j == 0 else drafts[r][-1] for r in active]
            logits = self._pass_on_every_rank(self._pass_plan(picked, positions, inputs))
            dist = target_probs(logits, select_rows(sampling, active))
            tokens = sample_rows(dist, [sampling.generators[r] for r in active],
                                 runner.sampler.generator, sampling.all_greedy).tolist()
            if probs is not None:
                probs[torch.as_tensor(active, device=probs.device), j] = dist
            for r, token in zip(active, tokens):
                drafts[r].append(token)
        return drafts, probs

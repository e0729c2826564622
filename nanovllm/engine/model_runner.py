"""Turns a scheduled batch into tensors, runs the model and samples (chapters 04, 07, 11).

The runner owns the model, the KV cache and the sampler. ``launch`` packs a step
(``step.py``), runs it and samples without waiting for the device; ``collect`` waits for the
tokens (between the two the engine may plan the next step: async scheduling, chapter 11).
With ``tensor_parallel_size=N`` (chapter 09) this is rank 0: it sends each ``StepPlan`` to
N-1 workers, whose runners ``follow`` it through the same forward pass and LM-head calls.
"""

from __future__ import annotations

import functools
import gc

import numpy as np
import torch

from nanovllm import distributed
from nanovllm.config import EngineConfig
from nanovllm.context import AttentionMetadata, attention_metadata
from nanovllm.engine import kv_cache
from nanovllm.engine.cuda_graphs import DecodeGraphs, graph_rows
from nanovllm.engine.executor import TPExecutor
from nanovllm.engine.model_loader import build_model
from nanovllm.engine.prompt_logprobs import logit_chunks, prompt_logprobs
from nanovllm.engine.sampling_metadata import SamplingInputs
from nanovllm.engine.scheduler_output import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import (
    INT_FIELDS,
    LONG_FIELDS,
    InFlight,
    PackedArrays,
    PreparedBatch,
    StepPlan,
    Unsampled,
    pack_step,
)
from nanovllm.engine.transfers import queue_to_host, to_device
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention_backends import select_backend
from nanovllm.layers.fused import set_fused_kernels
from nanovllm.layers.logits_processors import process_logits
from nanovllm.layers.quantization import process_weights_after_loading
from nanovllm.layers.quantization.fp8_checkpoint import read_checkpoint_quantization
from nanovllm.layers.quantization.kv_cache import kv_cache_dtype
from nanovllm.layers.sampler import Sampler, compute_logprobs
from nanovllm.models import ModelConfig
from nanovllm.structured_output.masks import apply_grammar_masks


class EngineShutDownError(RuntimeError):
    """The engine was shut down (``LLM.shutdown()``): its GPU memory is given back."""


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config, self.model_config = config, model_config
        self.device = torch.device(config.device)
        self.executor = None  # rank 0 of several: speaks to the workers (chapter 09)
        self.closed = False  # shut down: the device memory is given back (shutdown)
        if config.tensor_parallel_size > 1 and distributed.tp_size() == 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
            executor_class = TPExecutor
            if config.distributed_executor_backend == "ray":  # (chapter 17)
                from nanovllm.engine.ray_executor import RayExecutor as executor_class
            self.executor = executor_class(config, self.device)
        # A function of the device alone, not a bound method: handed to SamplingInputs, a
        # method would make the runner a reference cycle, which `del llm` could not free.
        self._to_device = functools.partial(to_device, device=self.device)
        try:
            self._build(config, model_config)
        except BaseException:
            self.shutdown(polite=False)  # the workers may wait in a collective of _build
            raise

    def _build(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.dtype = config.torch_dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)  # e4m3 for "fp8"
        self.block_size = config.block_size
        # Before loading anything: what is allocated from here on is this engine's.
        at_start = kv_cache.claim_gpu_share(config, self.device)
        # kv_cache_dtype="fp8": the backend stores e4m3 and widens it on load (chapter 08)
        self.backend = select_backend(config, self.device)
        self.model = self._build_model()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # The GPU backends bring fused norm, RoPE and activation kernels too (chapter 11).
        set_fused_kernels(self.model, self.backend.uses_fused_kernels)
        with_graphs = (self.device.type == "cuda" and not config.enforce_eager
                       and self.backend.cuda_graphs)
        # How many blocks fit (chapter 03): on a GPU, this engine's share less what it takes
        # besides the cache (weights, the largest step's activations, graphs).
        activations = (kv_cache.activation_bytes(self.model, config, self.device)
                       if self.device.type == "cuda" else 0.0)
        used = kv_cache.engine_bytes(at_start, config, self.device, activations, with_graphs)
        blocks = kv_cache.kv_budget_in_blocks(config, self.device, self.kv_bytes_per_block(),
                                              used)
        # Every rank's cache must hold the same blocks: the smallest budget wins.
        self.num_kv_blocks = distributed.min_over_ranks(blocks, self.device)
        self.kv_cache = kv_cache.allocate_kv_cache(model_config, self.attention_layers,
                                                   self.num_kv_blocks, self.block_size,
                                                   self.kv_dtype, self.device)
        self.sampler = Sampler(config.seed, self.device)
        self.sampling_inputs = SamplingInputs(model_config.vocab_size, self.device, self._to_device)
        self._in_flight_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        self._in_flight_rows: dict[int, int] = {}  # seq_id -> row of _in_flight_tokens
        self.graphs = None
        if with_graphs:
            self._capture_graphs()

    # -- setup ---------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        checkpoint_format = (None if self.config.load_format == "dummy"
                             else read_checkpoint_quantization(self.config.model))
        model = build_model(self.model_config, self.config.model, self.config, self.device,
                            self.dtype, self.backend, checkpoint_format)
        # Only now are packed layers complete: quantize them (chapter 08).
        quantized = process_weights_after_loading(model, self.config.quantization)
        if quantized and self.device.type == "cuda":
            # The replaced high-precision weights sit in PyTorch's cache, which the KV budget
            # (free device memory) would count as taken: give them back to the driver.
            torch.cuda.empty_cache()
        return model.eval()

    def capture_graphs(self) -> None:
        """(Re)capture the decode CUDA graphs, e.g. after switching fused kernels on or off."""
        if self.executor is not None:  # the workers capture theirs alongside (all-reduces)
            self.executor.send(("call", "_capture_graphs", ()))
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        self.graphs = None  # frees the old graphs' memory pool before capturing anew
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, graph_rows(self.config), max_blocks,
                                   self.block_size, self.model_config.hidden_size, self.device,
                                   self.dtype)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of this rank's cache (``kv_cache.kv_bytes_per_block``)."""
        return kv_cache.kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, batch: SchedulerOutput) -> PreparedBatch:
        """Pack the batch's new tokens, decodes first, into model inputs on the device: the
        layout is ``pack_step``'s (chapter 04 §1.3), copied in one buffer per dtype."""
        packed = pack_step(batch.seqs, batch.num_new_tokens, self.block_size,
                           self._in_flight_rows)
        plan = StepPlan(
            longs=PackedArrays.pack(np.int64, **{name: packed[name] for name in LONG_FIELDS}),
            ints=PackedArrays.pack(np.int32, **{name: packed[name] for name in INT_FIELDS}),
            max_seqlen_q=max(batch.num_new_tokens),
            num_decodes=sum(1 for n in batch.num_new_tokens if n == 1),
            prompt_rows=[(first, len(pos)) for _, first, pos, _ in packed["prompt_logprobs"]],
        )
        longs, meta = self._materialize(plan)
        input_ids = longs["input_ids"]
        if plan.has_patches:  # the previous step's tokens never visit the CPU on their way here
            input_ids[longs["patch_targets"]] = self._in_flight_tokens[longs["patch_sources"]]
        return PreparedBatch(plan, input_ids, longs["positions"], meta, longs["sample_indices"],
                             packed["sample_seqs"], packed["logit_rows"], packed["prompt_logprobs"])

    def _materialize(self, plan: StepPlan) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """The plan's device tensors: its int64 fields by name (``plan.longs``), and the
        attention metadata.

        Two host-to-device copies per step, one per dtype, then views into them: each
        separate copy costs a few microseconds of CPU time, and CPU time is step time."""
        longs = plan.longs.unpack(self._to_device(plan.longs.buffer, torch.int64))
        ints = plan.ints.unpack(self._to_device(plan.ints.buffer, torch.int32))
        host = plan.ints.unpack()
        lens_k = host["seq_lens_k"].tolist()
        meta = AttentionMetadata(
            slot_mapping=longs["slot_mapping"],
            cu_seqlens_q=ints["cu_seqlens_q"],
            seq_lens_k=ints["seq_lens_k"],
            block_tables=ints["block_tables"],
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=max(lens_k),
            num_decodes=plan.num_decodes,
            cu_seqlens_q_host=host["cu_seqlens_q"].tolist(),
            seq_lens_k_host=lens_k,
        )
        return longs, meta

    def forget(self, seq_ids: set[int]) -> None:
        """Drop the state of finished sequences (``SchedulerOutput.finished_seq_ids``)."""
        for seq_id in seq_ids:
            self.sampling_inputs.release(seq_id)

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput, defer_sampling: bool = False) -> InFlight | Unsampled:
        """Queue one step's forward pass and sampling on the device; does not wait for it.
        With ``defer_sampling`` the sampling waits for ``sample``: the engine first lands the
        step before, whose tokens a constrained request's mask needs (chapter 15).

        Everything that depends on a single request (its inputs, its sampling settings) is
        prepared before anything runs on the device, so an error there changes nothing and
        ``request_errors`` can tell whose it is."""
        if self.closed:
            raise EngineShutDownError(
                "this engine was shut down and gave its GPU memory back: build a new LLM")
        step = self.prepare(batch)
        sampling = self._sampling_inputs(step.sample_seqs) if step.sample_seqs else None
        plan = step.plan
        plan.use_graphs = (self.graphs is not None and plan.num_decodes == plan.num_seqs
                           and self.graphs.can_run(plan.num_seqs))
        try:
            if self.executor is not None:  # only now: nothing above may fail for one rank
                self.executor.send(("step", plan))
            hidden = self._forward(step.input_ids, step.positions, step.meta, plan)
            results = [prompt_logprobs(self.model, hidden, *entry, self._to_device)
                       for entry in step.prompt_logprobs]
            if not step.sample_seqs:
                done = InFlight(None, None, step.logit_rows)
                return queue_to_host(done, [], results, self.device)
            logits = self.model.compute_logits(hidden[step.sample_indices]).float()
        except Exception:
            if self.executor is not None:  # a lost worker explains it better than gloo does
                self.executor.raise_if_a_worker_died()
            raise
        unsampled = Unsampled(step, logits, sampling, results)
        return unsampled if defer_sampling else self.sample(unsampled)

    @torch.inference_mode()
    def sample(self, launched: InFlight | Unsampled) -> InFlight:
        """Queue the sampling of a step launched with ``defer_sampling`` (a step that samples
        nothing is in flight already and comes back as it is)."""
        if isinstance(launched, InFlight):
            return launched
        step = launched.step
        tokens, logprobs = self._sample(launched.logits, step.sample_seqs, *launched.sampling)
        # Kept on the device: the next step reads its placeholder tokens from here.
        self._in_flight_tokens = tokens
        self._in_flight_rows = {seq.seq_id: row for row, seq in enumerate(step.sample_seqs)}
        return queue_to_host(InFlight(tokens, None, step.logit_rows), logprobs,
                             launched.prompt_logprobs, self.device)

    def _forward(self, input_ids, positions, meta, plan: StepPlan) -> torch.Tensor:
        """The forward pass every rank runs alike; the final hidden states."""
        if plan.has_patches:  # only rank 0 has the sampled tokens that fill the placeholders
            distributed.broadcast_tensor(input_ids)
        if plan.use_graphs:
            return self.graphs.run(input_ids, positions, meta)
        with attention_metadata(meta):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A worker's step: rank 0's forward pass and LM-head calls on this rank's shard
        (the logits themselves are rank 0's to sample from)."""
        longs, meta = self._materialize(plan)
        hidden = self._forward(longs["input_ids"], longs["positions"], meta, plan)
        for first, count in plan.prompt_rows:  # the LM-head calls of prompt_logprobs
            for rows in logit_chunks(first, count):
                self.model.compute_logits(hidden[rows])
        if plan.verify_rows is not None:
            self.model.compute_logits(hidden[self._to_device(plan.verify_rows, torch.int64)])
        elif plan.num_samples:
            self.model.compute_logits(hidden[longs["sample_indices"]])

    def shutdown(self, polite: bool = True) -> None:
        """Stop the tensor-parallel workers, if any, and give this rank's GPU memory back:
        CUDA graphs, KV cache, weights. Idempotent; a step after it raises
        ``EngineShutDownError``. (``polite``: see ``TPExecutor.shutdown``.)"""
        if self.closed:
            return
        self.closed = True
        # Only with every worker alive: after a death an NCCL kernel may wait for the lost
        # peer forever, and synchronizing would wait with it (the abort then frees it).
        healthy = self.executor is None or (
            polite and all(p.poll() is None for p in self.executor.workers))
        if healthy:
            self.release_graphs()
        if self.executor is not None:
            self.executor.shutdown(polite)
        if healthy:
            self._release_device_memory()

    def _release_device_memory(self) -> None:
        """Drop every tensor this runner holds on the device and return PyTorch's cached
        blocks to the driver, for another engine, in this process or another."""
        for layer in self.__dict__.pop("attention_layers", []):
            layer.k_cache = layer.v_cache = torch.empty(0)
        for name in ("model", "kv_cache"):  # (the samplers keep only host state)
            self.__dict__.pop(name, None)
        self._in_flight_tokens, self._in_flight_rows = torch.empty(0, dtype=torch.int64), {}
        gc.collect()  # whatever only reference cycles kept alive goes before the cache is emptied
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs. A tensor-parallel rank does this before it leaves
        its process groups: graphs that captured NCCL collectives keep the communicators in
        use, and tearing those down then waits (chapter 09)."""
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_inputs(self, seqs: list[Sequence]) -> tuple:
        return self.sampling_inputs.build(seqs, (self._in_flight_tokens, self._in_flight_rows))

    def _sample(self, logits, seqs, sampling, processing) -> tuple[torch.Tensor, list]:
        """Tokens for the sampled rows, and their logprobs where a request asked for them:
        from the raw distribution (vLLM's default) or, with ``logprobs_mode=
        "processed_logprobs"``, after penalties, bias, masks and temperature. Rows of
        constrained requests are masked first (chapter 15; the host fills the masks while the
        device runs the forward pass), so as in vLLM both see only the allowed tokens."""
        must_stop = apply_grammar_masks(logits, seqs, self._to_device)
        k = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        raw = logits.clone() if k is not None and processing is not None else logits
        if processing is not None:
            held = logits[must_stop] if must_stop is not None else None  # a copy
            logits = process_logits(logits, processing)  # in place
            if held is not None:  # min_tokens yields to a complete constraint (masks.py)
                logits[must_stop] = held
        tokens = self.sampler(logits, sampling)
        if k is None:
            return tokens, []
        source = raw
        if self.config.logprobs_mode == "processed_logprobs":
            temps = sampling.temperatures
            source = logits / torch.where(temps > 0, temps, 1.0)[:, None]
        return tokens, list(compute_logprobs(source.log_softmax(dim=-1), tokens, k))

    def request_errors(self, batch: SchedulerOutput) -> list[tuple[Sequence, Exception]]:
        """After ``launch(batch)`` raised: the sequences whose own preparation fails when
        tried alone, with their errors (empty: the failure is not one request's)."""
        if self.closed:
            return []
        failed = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            try:
                step = self.prepare(SchedulerOutput([seq], [n]))
                if step.sample_seqs:
                    self._sampling_inputs(step.sample_seqs)
            except Exception as err:
                failed.append((seq, err))
        return failed

    def collect(self, step: InFlight) -> list[int | None]:
        """Wait for a launched step; the sampled token of each sequence, None mid-prompt."""
        if step.tokens is None:
            return [None] * len(step.logit_rows)
        if step.done is not None:  # waits for this step only, not for any queued after it
            if self.executor is not None:
                self.executor.wait_for(step.done)
            else:
                step.done.synchronize()
        tokens = step.tokens.tolist()
        return [tokens[r] if r >= 0 else None for r in step.logit_rows]

    def run(self, batch: SchedulerOutput) -> list[int | None]:
        """One step, start to finish: ``collect(launch(batch))``."""
        return self.collect(self.launch(batch))

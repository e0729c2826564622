"""A separate draft model (chapter 14 §4): a smaller model of the same vocabulary proposes,
vLLM's ``speculative_config={"model": path, "num_speculative_tokens": k}``.

The draft is any folder the engine loads (loaded as the target is: its safetensors, or random
weights with ``load_format="dummy"``); it may have other layers, widths and heads, but not
another vocabulary: proposals are token ids the target scores.

Its KV cache is its own tensor, in the draft's shape, indexed by the *target's* block ids: a
token's draft keys and values sit at the same slot as its target keys and values. The block
manager then stays the one writer of block tables and slots (nothing to allocate, free,
preempt or prefix-cache twice), and this module is the one writer of the draft's cache, at
two moments of each speculative step:

- ``propose`` (the loop of ``draft_layers.py``): draft token j is computed at position
  ``P + j``, in the slots ``reserve_draft_slots`` reserved;
- ``follow``: after the target's verify pass, the draft runs over the very same tokens,
  positions and slots (prompt chunks, decodes and proposals alike), so that every slot the
  target has computed holds the draft's values for the same token too. What the scheduler
  counts as computed (the accepted prefix) is then valid in both caches; the rejected
  proposals' slots are rewritten by a later step in both, as with ``draft_layers``. Prefix
  cache hits, chunked prefill and recomputation after preemption need nothing more: each
  block the target computed, the draft computed in the same step.

``follow`` recomputes the draft's proposals of the step (the price of that simplicity: about
k + 1 draft tokens per request per step besides the k proposals; a draft is small).

Under tensor parallelism (chapter 09) every rank builds the draft sharded like the target (its
parallel layers read the process group; its heads must divide evenly, checked before the
workers start) with its own shard of the draft's cache, and runs both moments in lockstep
with rank 0: each proposal pass (``DraftLayersProposer.run_pass``, on a "draft" message) and
``follow_plan`` after following the verify step.
"""

from __future__ import annotations

import torch

from nanovllm.context import attention_metadata
from nanovllm.engine import kv_cache
from nanovllm.engine.model_loader import build_model
from nanovllm.engine.spec_decode.draft_layers import DraftLayersProposer
from nanovllm.engine.step import PreparedBatch, StepPlan
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention_backends import select_backend
from nanovllm.layers.quantization.fp8_checkpoint import read_checkpoint_quantization
from nanovllm.models import ModelConfig
from nanovllm.tokenizer import load_tokenizer


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig, target_tokenizer,
                          draft_folder: str) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {draft_folder} has a vocabulary of "
                         f"{draft.vocab_size} tokens but the target has {target.vocab_size}; "
                         "speculative_config 'model' needs a draft with the target's tokenizer")
    # (A tensor-parallel worker passes no tokenizer: rank 0 has compared them.)
    draft_tokenizer = None if target_tokenizer is None else load_tokenizer(draft_folder)
    if draft_tokenizer is None:
        return  # config-only folders (random weights): the sizes are all there is to compare
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft_folder} has {draft.vocab_size} tokens like "
                         "the target, but its tokenizer maps them to other strings; "
                         "speculative_config 'model' needs a draft with the target's tokenizer")


class DraftModelProposer(DraftLayersProposer):
    """Proposes with a separate model; the proposal loop and its sampling (the draft's
    distribution, under each request's settings) are ``DraftLayersProposer``'s."""

    def __init__(self, runner, folder: str, k: int, target_tokenizer=None) -> None:
        super().__init__(runner, num_layers=0, k=k)
        config = runner.config
        self.model_config = ModelConfig.from_pretrained(folder)
        check_same_vocabulary(runner.model_config, self.model_config, target_tokenizer, folder)
        self._check_window_and_length(config.max_model_len, folder)
        self.model = self._build(folder, config)
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self._check_room(runner.num_kv_blocks)
        self.kv_cache = kv_cache.allocate_kv_cache(self.model_config, self.layers,
                                                   runner.num_kv_blocks, runner.block_size,
                                                   runner.kv_dtype, runner.device)
        self._capture_graphs(self.model_config.hidden_size)

    def _check_window_and_length(self, max_model_len: int, folder: str) -> None:
        mc, target_window = self.model_config, self.runner.model_config.sliding_window
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model {folder} serves {mc.max_position_embeddings} "
                             f"positions, fewer than max_model_len={max_model_len}; lower "
                             "max_model_len")
        # The target's block manager frees blocks that slid out of *its* window (chapter 12).
        if target_window is not None and (mc.sliding_window is None
                                          or mc.sliding_window > target_window):
            raise ValueError(f"the draft model {folder} attends beyond the target's sliding "
                             f"window of {target_window} tokens, whose blocks are freed")

    def _build(self, folder: str, config) -> torch.nn.Module:
        """The draft's network, in the target's dtype and on its device, with its own
        attention backend (a backend may hold per-layer state, e.g. fp8 scales)."""
        if read_checkpoint_quantization(folder) is not None:
            raise ValueError(f"the draft model {folder} is a quantized checkpoint; a draft "
                             "model must be unquantized")
        model = build_model(self.model_config, folder, config, self.runner.device,
                            self.runner.dtype, select_backend(config, self.runner.device))
        return model.eval()

    def _check_room(self, num_blocks: int) -> None:
        """On a GPU the target's cache took the engine's share: the draft's comes on top."""
        device = self.runner.device
        if device.type != "cuda":
            return
        need = num_blocks * kv_cache.kv_bytes_per_block(self.model_config,
                                                        self.runner.block_size,
                                                        self.runner.kv_dtype)
        free = torch.cuda.mem_get_info(device)[0] + (torch.cuda.memory_reserved(device)
                                                     - torch.cuda.memory_allocated(device))
        if need > free:
            raise ValueError(f"the draft model's KV cache ({need / kv_cache.GiB:.2f} GiB for "
                             f"{num_blocks} blocks) does not fit in the "
                             f"{free / kv_cache.GiB:.2f} GiB left; lower "
                             "gpu_memory_utilization or pass num_kv_blocks=")

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def follow(self, step: PreparedBatch) -> None:
        """Compute the draft's keys and values for the tokens of the target's step ``step``,
        at the same slots (its hidden states are not needed)."""
        with attention_metadata(step.meta):
            self.model(step.input_ids, step.positions)

    def follow_plan(self, plan: StepPlan) -> None:
        """``follow`` on a tensor-parallel worker, from the step as rank 0 sent it: after
        ``ModelRunner.follow(plan)``, as rank 0 runs ``follow`` after the verify pass."""
        longs, meta = self.runner._materialize(plan)
        self.follow(PreparedBatch(plan, longs["input_ids"], longs["positions"], meta,
                                  longs["sample_indices"], sample_seqs=[], logit_rows=[]))

    def release(self) -> None:
        """Drop the draft's weights and cache (``LLM.shutdown``: the runner then hands the
        freed memory back to the driver)."""
        super().release()  # the graphs first: they hold the model's buffers
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.layers = []
        self.__dict__.pop("model", None)
        self.__dict__.pop("kv_cache", None)

"""The sparse MoE block and what MoE models share (chapter 16).

A mixture-of-experts decoder is the dense decoder (``llama.py``) with the MLP of some layers
replaced by a ``SparseMoeBlock``: the router picks ``top_k`` experts per token, the experts run
(``layers/fused_moe.py``), and with tensor parallelism the ranks' partial sums are added, as
after a dense MLP's row-parallel down projection. ``MoeForCausalLM`` builds those blocks from
``ModelConfig.moe`` and maps Hugging Face's per-expert tensor names onto the stacked weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from nanovllm.distributed import all_reduce
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.router import Router
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.model_config import ModelConfig


class SparseMoeBlock(nn.Module):
    """``gate`` (the router) and ``experts``: Hugging Face's names for them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.top_k, moe.renormalize)
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        return all_reduce(self.experts(x, topk_weights, topk_ids))


class MoeForCausalLM(LlamaForCausalLM):
    """A decoder whose sparse layers (``cfg.moe.sparse_layers``) hold a ``SparseMoeBlock``.

    ``expert_tensors``: the checkpoint's name of each expert's gate, up and down projection
    (under ``checkpoint_block``, its name for the MoE block; ours is ``mlp``).
    """

    checkpoint_block = "mlp"
    expert_tensors = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: config.json names no experts "
                             "(num_experts or num_local_experts)")
        super().__init__(cfg)
        self.packed_modules_mapping = {**self._expert_mapping(cfg.moe.num_experts),
                                       **LlamaForCausalLM.packed_modules_mapping}

    def split_fused_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Checkpoints in transformers 5's own layout (``...mlp.experts.gate_up_proj``
        ``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``, Mixtral's router as
        ``...mlp.gate``) back into the per-expert names of the Hub's checkpoints, which the
        loader then stacks like any other (``weights/loader.py``)."""
        block = self.checkpoint_block
        fused = re.fullmatch(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)",
                             name)
        if fused is None:
            if block != "mlp" and name.endswith(".mlp.gate.weight"):
                return [(name.replace(".mlp.gate.", f".{block}.gate."), tensor)]
            return [(name, tensor)]
        prefix, kind = fused.groups()
        gate, up, down = self.expert_tensors
        pieces = []
        for e, expert in enumerate(tensor):
            parts = zip((gate, up), expert.chunk(2)) if kind == "gate_up_proj" else [(down, expert)]
            pieces += [(f"{prefix}.{block}.experts.{e}.{part}.weight", t) for part, t in parts]
        return pieces

    def make_mlp(self, layer: int) -> nn.Module | None:
        return SparseMoeBlock(self.config) if self.config.moe.sparse_layers[layer] else None

    def _expert_mapping(self, num_experts: int) -> dict[str, tuple[str, object]]:
        """``block.experts.{e}.gate_proj`` -> ``(mlp.experts.w13, (e, "gate"))`` etc., read by
        the loader (``weights/loader.py``) before the dense names (``gate_proj`` alone)."""
        block = self.checkpoint_block
        mapping: dict[str, tuple[str, object]] = {}
        for e in range(num_experts):
            for name, (stacked, part) in zip(self.expert_tensors, (
                    ("w13", "gate"), ("w13", "up"), ("w2", "down"))):
                mapping[f"{block}.experts.{e}.{name}"] = (f"mlp.experts.{stacked}", (e, part))
        if block != "mlp":
            mapping[f"{block}.gate"] = ("mlp.gate", None)
        return mapping

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, experts for MLPs (chapter 16).

Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP
of ``intermediate_size``; the others hold ``num_experts`` experts of ``moe_intermediate_size``
each, ``num_experts_per_tok`` per token, renormalized when ``norm_topk_prob`` is set
(``models/moe_config.py``).
"""

from nanovllm.models.moe import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

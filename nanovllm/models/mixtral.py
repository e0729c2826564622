"""Mixtral: Mistral's attention (its sliding window included), experts for MLPs (chapter 16).

Every layer is sparse: ``num_local_experts`` experts of ``intermediate_size``, two per token in
the published models, their router weights always renormalized. Checkpoints call the MoE
block ``block_sparse_moe`` and an expert's gate, down and up projections ``w1``, ``w2``,
``w3``.
"""

from nanovllm.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    checkpoint_block = "block_sparse_moe"
    expert_tensors = ("w1", "w3", "w2")  # gate, up, down

"""Qwen3: the Llama decoder plus RMSNorm on every query and key head (chapter 01)."""

from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

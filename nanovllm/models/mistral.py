"""Mistral: the Llama decoder with sliding-window attention (chapter 12 §5).

Every query attends to its last ``sliding_window`` keys only (``config.json``'s
``sliding_window``; ``null`` in Mistral v0.2 and later, which then is plain Llama). The window
lives in the attention layer and its backends (``nanovllm/layers/attention.py``); the weights
are named as Llama's.
"""

from nanovllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same modules as Llama; ``ModelConfig.sliding_window`` reaches every ``Attention``."""

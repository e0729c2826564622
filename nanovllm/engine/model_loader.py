"""Build a model and load its weights (chapters 01 and 08): the target's, in the model runner,
and a speculative draft model's (chapter 14), the same way."""

from __future__ import annotations

import torch

from nanovllm.config import EngineConfig
from nanovllm.layers.attention import building_with
from nanovllm.layers.attention_backends import AttentionBackend
from nanovllm.layers.quantization.fp8_checkpoint import Fp8CheckpointFormat
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.weights.loader import load_dummy, load_safetensors


def build_model(model_config: ModelConfig, folder: str, config: EngineConfig,
                device: torch.device, dtype: torch.dtype, backend: AttentionBackend,
                checkpoint_format: Fp8CheckpointFormat | None = None) -> torch.nn.Module:
    """``model_config``'s architecture in ``dtype`` on ``device``, every attention layer on
    ``backend``, with weights: random ones for ``load_format="dummy"`` (seeded), else
    ``folder``'s safetensors (read as ``checkpoint_format``: a quantized checkpoint's, chapter
    08). Quantizing the loaded weights is the caller's (``process_weights_after_loading``)."""
    cls = get_model_class(model_config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the model's dtype
    try:
        with torch.device(device), building_with(backend):
            model = cls(model_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        load_dummy(model, config.seed)
    else:
        load_safetensors(model, folder, checkpoint_format)
    return model

"""Model definitions, looked up by the architecture name in ``config.json`` (chapter 01)."""

from nanovllm.models.model_config import ModelConfig
from nanovllm.models.registry import get_model_class, supported_architectures

__all__ = ["ModelConfig", "get_model_class", "supported_architectures"]

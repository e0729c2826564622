"""``speculative_config``: vLLM's keys, validated when the engine is built (chapter 14;
the machinery is ``nanovllm/engine/spec_decode/``).

Three methods are built: ``"ngram"`` (prompt lookup: the tokens that followed the most recent
earlier occurrence of the request's last few tokens), ``"draft_layers"`` (self-speculative,
LayerSkip-style: the target's first ``num_layers`` layers, its final norm and its LM head are
the draft) and ``"draft_model"`` (a separate, smaller model sharing the target's vocabulary:
``{"model": path}``, as in vLLM, where ``method`` may be left out). Every bad value raises
``ValueError`` naming the key, the value and what is allowed, as ``EngineConfig`` does
(chapter 00); that the draft's vocabulary is the target's is checked when the engine loads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nanovllm.validation import is_positive_int

METHODS = ("ngram", "draft_layers", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "num_layers", "model")
# vLLM's default when neither prompt_lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: tokens proposed per request per step
    prompt_lookup_min: int = 0  # ngram: the shortest suffix that may match
    prompt_lookup_max: int = 0  # ngram: the longest suffix tried first
    num_layers: int = 0  # draft_layers: how many of the target's layers draft
    model: str | None = None  # draft_model: the draft's folder (loaded as the target is)

    def check_model(self, num_model_layers: int) -> None:
        """Refuse a draft that is not smaller than the target (known once the model is)."""
        if self.method == "draft_layers" and not self.num_layers < num_model_layers:
            raise ValueError(
                f"speculative_config num_layers is {self.num_layers} but the model has "
                f"{num_model_layers} layers; the draft must use fewer (1 to "
                f"{num_model_layers - 1})")


def _positive(options: dict, key: str, default: Any = None) -> int:
    value = options.get(key, default)
    if not is_positive_int(value):
        raise ValueError(f"speculative_config {key} is {value!r}; it must be an int >= 1")
    return int(value)


def parse_speculative_config(options: object) -> SpeculativeConfig | None:
    """A validated ``SpeculativeConfig`` from vLLM-style ``options`` (a dict), or None."""
    if options is None:
        return None
    if isinstance(options, SpeculativeConfig):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"speculative_config must be a dict or None, not {options!r}")
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {unknown}; valid keys: "
                         f"{sorted(KEYS)}")
    method = options.get("method")
    if method is None and options.get("model") is not None:
        method = "draft_model"  # vLLM's reading of {"model": path}
    if method not in METHODS:
        raise ValueError(f"speculative_config method is {method!r}; choose from {list(METHODS)}")
    k = _positive(options, "num_speculative_tokens")
    _refuse_foreign_keys(options, method)
    if method == "draft_model":
        return SpeculativeConfig(method, k, model=_draft_folder(options.get("model")))
    if method == "ngram":
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = _positive(options, "prompt_lookup_min", high if low is None else low)
        high = _positive(options, "prompt_lookup_max", low if high is None else high)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) exceeds "
                             f"prompt_lookup_max ({high})")
        return SpeculativeConfig(method, k, prompt_lookup_min=low, prompt_lookup_max=high)
    return SpeculativeConfig(method, k, num_layers=_positive(options, "num_layers"))


# The keys only one method reads.
_OWNER = {"prompt_lookup_min": "ngram", "prompt_lookup_max": "ngram",
          "num_layers": "draft_layers", "model": "draft_model"}


def _refuse_foreign_keys(options: dict, method: str) -> None:
    for key, owner in _OWNER.items():
        if options.get(key) is not None and owner != method:
            raise ValueError(f"speculative_config {key} belongs to {owner!r}, not {method!r}")


def _draft_folder(model: object) -> str:
    """The draft model's folder: like ``EngineConfig.model``, one with a config.json."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isfile(
            os.path.join(model, "config.json")):
        raise ValueError(f"speculative_config model is {model!r}; pass the path of a model "
                         "folder with a config.json (the draft), e.g. "
                         "nanovllm.configs.config_path(name) with load_format='dummy'")
    return str(model)

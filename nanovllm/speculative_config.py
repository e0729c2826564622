"""``speculative_config``: vLLM's keys, validated when the engine is built (chapter 14;
the machinery is ``nanovllm/engine/spec_decode/``).

Two methods are built: ``"ngram"`` (prompt lookup: the tokens that followed the most recent
earlier occurrence of the request's last few tokens) and ``"draft_layers"`` (self-speculative,
LayerSkip-style: the target's first ``num_layers`` layers, its final norm and its LM head are
the draft). A separate draft model (``{"model": path}``) is refused with a clear error: it is
not built yet. Every bad value raises ``ValueError`` naming the key, the value and what is
allowed, as ``EngineConfig`` does (chapter 00).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanovllm.validation import is_positive_int

METHODS = ("ngram", "draft_layers")
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
    if options.get("model") is not None:
        raise ValueError("speculative_config 'model' (a separate draft model) is not supported "
                         "yet; use method 'ngram' or 'draft_layers' (the target's first layers "
                         "as the draft)")
    method = options.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config method is {method!r}; choose from {list(METHODS)}")
    k = _positive(options, "num_speculative_tokens")
    if method == "ngram":
        for key in ("num_layers",):
            if key in options:
                raise ValueError(f"speculative_config {key} belongs to 'draft_layers', not "
                                 "'ngram'")
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = _positive(options, "prompt_lookup_min", high if low is None else low)
        high = _positive(options, "prompt_lookup_max", low if high is None else high)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) exceeds "
                             f"prompt_lookup_max ({high})")
        return SpeculativeConfig(method, k, prompt_lookup_min=low, prompt_lookup_max=high)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in options:
            raise ValueError(f"speculative_config {key} belongs to 'ngram', not 'draft_layers'")
    return SpeculativeConfig(method, k, num_layers=_positive(options, "num_layers"))

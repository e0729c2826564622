"""The mixture-of-experts fields of ``config.json`` (chapter 16), read beside ``ModelConfig``.

Two spellings reach us. Qwen3-MoE: ``num_experts`` (transformers 5 writes
``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size`` (each expert's MLP
width; ``intermediate_size`` is the width of its dense layers), ``norm_topk_prob`` (renormalize
the top-k probabilities to sum to 1), and which layers are sparse: layer ``i`` is a MoE layer
unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``. Mixtral:
``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` is the expert's width,
every layer is sparse and the top-k weights are always renormalized. A config without experts
gives ``None`` (a dense model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanovllm.validation import is_bool, is_int, is_positive_int

MIXTRAL = "MixtralForCausalLM"


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts each token visits
    intermediate_size: int  # one expert's MLP width
    renormalize: bool  # scale the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or a dense MLP (False)


def _field(cfg: dict[str, Any], name: str, test, allowed: str, source: str) -> Any:
    value = cfg.get(name)
    if value is not None and not test(value):
        raise ValueError(f"{source}: field {name!r} must be {allowed}, got {value!r}")
    return value


def read_moe_config(cfg: dict[str, Any], source: str = "config.json") -> MoeConfig | None:
    """The experts of a parsed ``config.json``, or ``None`` when it has none."""
    def positive(name: str) -> int | None:
        return _field(cfg, name, is_positive_int, "an int >= 1", source)

    def count(name: str) -> int | None:  # 0 experts: every layer dense (transformers' reading)
        return _field(cfg, name, lambda x: is_int(x) and x >= 0, "an int >= 0", source)

    experts = count("num_experts") or count("num_local_experts")
    if not experts:
        return None
    top_k = positive("num_experts_per_tok")
    if top_k is None or top_k > experts:
        raise ValueError(f"{source}: field 'num_experts_per_tok' must be an int from 1 to the "
                         f"{experts} experts, got {cfg.get('num_experts_per_tok')!r}")
    layers = cfg["num_hidden_layers"]
    if cfg["architectures"][0] == MIXTRAL:
        return MoeConfig(experts, top_k, cfg["intermediate_size"], True, (True,) * layers)
    width = positive("moe_intermediate_size")
    if width is None:
        raise ValueError(f"{source} lacks the required field 'moe_intermediate_size'")
    renormalize = _field(cfg, "norm_topk_prob", is_bool, "true or false", source)
    step = positive("decoder_sparse_step") or 1
    dense = _field(cfg, "mlp_only_layers", lambda x: isinstance(x, list) and all(
        isinstance(i, int) and 0 <= i < layers for i in x), f"a list of layer indices < {layers}",
        source) or []
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoeConfig(experts, top_k, width, bool(renormalize), sparse)

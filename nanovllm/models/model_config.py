"""The architecture hyper-parameters nanovllm needs, read straight from ``config.json``.

Reading the JSON ourselves (not through ``transformers.AutoConfig``) keeps the model code
independent of how a transformers release spells things (4.x's ``rope_theta``, 5.x's
``rope_parameters``). Chapter 01. Every field read is checked: a bad file or field raises
``ValueError`` naming both, not a ``KeyError`` or a shape error deep in the model;
``architectures`` must be a list, as Hugging Face writes it. EOS ids merge ``config.json``'s and
``generation_config.json``'s (Qwen lists several there), in that order, without repeats.

RoPE scaling (chapter 12) is read as transformers reads it (``rope_scaling``, or a
``rope_parameters`` whose ``rope_type``, old spelling ``type``, is not ``default``), completed
with ``original_max_position_embeddings``; ``max_position_embeddings`` becomes the length the
scaled model serves, as vLLM derives it. ``sliding_window`` is read unless
``use_sliding_window`` is false (Qwen2 ships a window it does not use). Refused: a
``partial_rotary_factor`` other than 1 and Phi-3's rope scaling (``longrope``, also ``su`` or
``yarn`` in Phi-3 configs).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanovllm.layers.rotary import SCALING_TYPES, scaling_type
from nanovllm.models.moe_config import MoeConfig, read_moe_config
from nanovllm.validation import Rule, is_bool, is_finite, is_int, is_positive_int

REQUIRED = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")


def _positive_number(x: object) -> bool:
    return is_finite(x) and x > 0


def _class_names(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(n, str) and n for n in x)


def _token_ids(x: object) -> bool:
    ids = x if isinstance(x, list) else [x]
    return all(is_int(t) and t >= 0 for t in ids)


# Optional fields may also be absent or null; the model's defaults apply then.
_RULES: tuple[Rule, ...] = (
    ("architectures", _class_names, 'a list of class names, e.g. ["LlamaForCausalLM"]'),
    *((name, is_positive_int, "an int >= 1") for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")),
    ("rms_norm_eps", _positive_number, "a number > 0"),
    ("rope_theta", _positive_number, "a number > 0"),
    ("rope_parameters", lambda x: isinstance(x, dict), "an object"),
    ("rope_scaling", lambda x: isinstance(x, dict), "an object"),
    ("tie_word_embeddings", is_bool, "true or false"),
    ("attention_bias", is_bool, "true or false"),
    ("eos_token_id", _token_ids, "a token id (int >= 0) or a list of them"),
    ("sliding_window", is_positive_int, "an int >= 1"),
    ("original_max_position_embeddings", is_positive_int, "an int >= 1"),
)


def _check(cfg: dict[str, Any], source: str) -> None:
    if not isinstance(cfg, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(cfg).__name__}")
    for name in REQUIRED:
        if cfg.get(name) is None:
            raise ValueError(f"{source} lacks the required field {name!r}")
    for name, test, allowed in _RULES:
        value = cfg.get(name)
        if value is not None and not test(value):
            raise ValueError(f"{source}: field {name!r} must be {allowed}, got {value!r}")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")  # where transformers 5 puts it
    if theta is not None and not _positive_number(theta):
        raise ValueError(f"{source}: field 'rope_parameters.rope_theta' must be a number > 0, "
                         f"got {theta!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 1
    if heads % kv_heads:  # grouped-query attention shares each K/V head among a group
        raise ValueError(f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide "
                         f"num_attention_heads ({heads})")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise ValueError(f"{source}: field 'hidden_size' ({cfg['hidden_size']}) must be a "
                         f"multiple of num_attention_heads ({heads}) when head_dim is not given")


def _rope_scaling(cfg: dict[str, Any], source: str) -> tuple[dict | None, int]:
    """The scaling dictionary, completed, and the maximum position the scaled model serves."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or (rope if scaling_type(rope) != "default" else {}))
    length = cfg.get("max_position_embeddings") or 2048
    for where in (cfg, rope, scaling):  # RoPE on part of each head only (Phi-4-mini)
        if where.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
            raise ValueError(f"{source}: partial_rotary_factor "
                             f"{where['partial_rotary_factor']!r} (RoPE on part of each head) "
                             "is not supported; only 1")
    kind = scaling_type(scaling)
    if kind == "default":
        return None, length
    if cfg.get("model_type") == "phi3" or cfg["architectures"][0] == "Phi3ForCausalLM":
        raise ValueError(f"{source}: Phi-3's rope scaling {kind!r} is not supported (Phi-3 "
                         "configs mean longrope, which they also spell 'su' or 'yarn')")
    if kind not in SCALING_TYPES:
        raise ValueError(f"{source}: rope scaling type {kind!r} is not supported; supported: "
                         f"{', '.join(SCALING_TYPES)}")
    if kind == "dynamic":  # transformers scales from max_position_embeddings itself
        scaling["original_max_position_embeddings"] = length
    elif kind in ("yarn", "llama3"):  # a top-level value wins (Phi-3's habit), as in transformers
        scaling["original_max_position_embeddings"] = (
            cfg.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings") or length)
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = length / scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if not _positive_number(factor):
        raise ValueError(f"{source}: rope scaling {kind!r} needs a 'factor' > 0, got {factor!r}")
    if kind in ("linear", "dynamic"):
        length = int(length * factor)
    elif kind == "yarn":
        length = int(scaling["original_max_position_embeddings"] * factor)
    return scaling, length


def _sliding_window(cfg: dict[str, Any], source: str) -> int | None:
    if "use_sliding_window" in cfg:  # Qwen2/Qwen3: a window on some layers only, if switched on
        if cfg["use_sliding_window"]:
            raise ValueError(f"{source}: use_sliding_window (a window on some layers only) is "
                             "not supported")
        return None
    return cfg.get("sliding_window")


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(t) for t in ids))  # keeps order, drops repeats


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not a readable JSON file: {err}") from None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool | None = None  # None: as attention_bias (Qwen2 has it without o_proj's)
    sliding_window: int | None = None  # each query sees its last `sliding_window` keys
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model (chapter 16)

    def __post_init__(self) -> None:
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.attention_bias)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed ``config.json``; ``source`` names it in error messages."""
        _check(cfg, source)
        rope = dict(cfg.get("rope_parameters") or {})
        scaling, max_position = _rope_scaling(cfg, source)
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=cfg["architectures"][0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            sliding_window=_sliding_window(cfg, source),
            moe=read_moe_config(cfg, source),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` and, if present, the EOS ids of ``generation_config.json``."""
        file = Path(path) / "config.json"
        config = cls.from_dict(_read_json(file), source=str(file))
        gen_file = Path(path) / "generation_config.json"
        if not gen_file.is_file():
            return config
        gen = _read_json(gen_file)
        if not isinstance(gen, dict):
            raise ValueError(f"{gen_file} must hold a JSON object, got {type(gen).__name__}")
        eos = gen.get("eos_token_id")
        if eos is not None and not _token_ids(eos):
            raise ValueError(f"{gen_file}: field 'eos_token_id' must be a token id (int >= 0) "
                             f"or a list of them, got {eos!r}")
        merged = _eos_ids([*config.eos_token_ids, *_eos_ids(eos)])
        return dataclasses.replace(config, eos_token_ids=merged)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V that one token occupies across all layers (chapter 03)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

"""Fill a model's parameters from safetensors files, or with random values (chapter 01).

Checkpoints store ``q_proj``, ``k_proj``, ``v_proj`` (and ``gate_proj``, ``up_proj``) as
separate matrices; our model packs them. The model's ``packed_modules_mapping`` says where
each one goes, and each parameter's own ``weight_loader`` copies it into place (and takes
its tensor-parallel shard), so this loop stays generic.
"""

from __future__ import annotations

from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    param.data.copy_(loaded)


def load_safetensors(model: nn.Module, path: str | Path) -> None:
    """Load every ``*.safetensors`` file in ``path`` into ``model``; fail on missing weights."""
    files = sorted(glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    loaded_names = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target, shard_id = _resolve(name, mapping)
                if target not in params:
                    if name == "lm_head.weight" or "rotary_emb" in name:
                        continue  # tied to the embedding, or recomputed
                    raise ValueError(f"checkpoint weight {name!r} has no place in the model")
                param = params[target]
                loader = getattr(param, "weight_loader", _default_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
                loaded_names.add(target)
    missing = set(params) - loaded_names
    if missing:
        raise ValueError(f"checkpoint in {path} lacks weights for {sorted(missing)[:5]}")


def _resolve(name: str, mapping: dict) -> tuple[str, object]:
    for fragment, (packed, shard_id) in mapping.items():
        if f".{fragment}." in name:
            return name.replace(fragment, packed), shard_id
    return name, None


def load_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights of a sensible scale, for benchmarks where values do not matter."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=gen) * 0.02
            param.data.copy_(values)

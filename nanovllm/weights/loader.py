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
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.distributed import tp_size


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    param.data.copy_(loaded)


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id: object) -> None:
    # A whole (unpacked) tensor on one rank must match its parameter exactly; packed shards
    # and tensor-parallel slices are checked by the parameter's own weight_loader.
    if shard_id is None and tp_size() == 1 and tensor.shape != param.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    loader = getattr(param, "weight_loader", _default_loader)
    loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)


def load_safetensors(model: nn.Module, path: str | Path) -> None:
    """Load every ``*.safetensors`` file in ``path`` into ``model``.

    Raises ``ValueError`` naming the file and tensor for a tensor that has no place in the
    model or the wrong shape, and listing what is missing when weights are left unloaded.
    """
    files = sorted(glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                loaded |= _load_file(f, file, params, mapping)
        except SafetensorError as err:
            raise ValueError(f"{file} is not a readable safetensors file: {err}") from None
    expected = _expected_names(params, mapping)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"the checkpoint in {path} lacks {len(missing)} of the {len(expected)} tensors "
            f"the model needs: {shown}"
        )


def _load_file(f, file: str, params: dict[str, nn.Parameter], mapping: dict) -> set[str]:
    """Load one open safetensors file; return the checkpoint names it filled."""
    names = set()
    for name in f.keys():
        target, shard_id = _resolve(name, mapping)
        if target not in params:
            if name == "lm_head.weight" or "rotary_emb" in name:
                continue  # tied to the embedding, or recomputed
            raise ValueError(f"{file}: tensor {name!r} has no place in the model")
        try:
            _load_one(params[target], f.get_tensor(name), shard_id)
        except ValueError as err:
            raise ValueError(
                f"{file}: tensor {name!r} does not fit parameter {target!r}: {err}"
            ) from None
        names.add(name)
    return names


def _expected_names(params: dict[str, nn.Parameter], mapping: dict) -> set[str]:
    """The checkpoint names that fill ``params``: a packed parameter needs all its parts,
    or part of it would keep whatever ``torch.empty`` left there."""
    names = set()
    for target in params:
        parts = [(frag, packed) for frag, (packed, _) in mapping.items() if f".{packed}." in target]
        names.update(target.replace(f".{packed}.", f".{frag}.") for frag, packed in parts)
        if not parts:
            names.add(target)
    return names


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

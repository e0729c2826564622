"""Fill a model's parameters from safetensors files, or with random values (chapter 01).

Checkpoints store ``q_proj``, ``k_proj``, ``v_proj`` (and ``gate_proj``, ``up_proj``) as
separate matrices; our model packs them. The model's ``packed_modules_mapping`` says where
each one goes, and each parameter's own ``weight_loader`` copies it into place (and takes
its tensor-parallel shard), so this loop stays generic. A model whose checkpoints store such
matrices already fused (Phi-3's ``qkv_proj``, chapter 12 §6) defines
``split_fused_tensor(name, tensor)``, which returns the pieces under the separate names; the
loop loads those, so the shard ids reach the loaders and tensor parallelism keeps working.
"""

from __future__ import annotations

from contextlib import ExitStack
from glob import glob
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.distributed import as_single_rank, tp_size
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.layers.quantization.fp8_checkpoint import FP8_STORAGE_DTYPES, Fp8CheckpointFormat


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    param.data.copy_(loaded)


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id: object) -> None:
    # A whole (unpacked) tensor on one rank must match its parameter exactly; packed shards
    # and tensor-parallel slices are checked by the parameter's own weight_loader.
    if shard_id is None and tp_size() == 1 and tensor.shape != param.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    loader = getattr(param, "weight_loader", _default_loader)
    packed = (QKVParallelLinear, MergedColumnParallelLinear)
    if shard_id is None and isinstance(getattr(loader, "__self__", None), packed):
        raise ValueError(  # a fused checkpoint tensor the model does not split (Phi-3's)
            "a packed parameter loads its parts (q, k, v or gate, up) one by one, with their "
            "shard ids; this model has no split_fused_tensor for a fused checkpoint tensor"
        )
    loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)


def load_safetensors(
    model: nn.Module, path: str | Path, checkpoint_format: Fp8CheckpointFormat | None = None
) -> None:
    """Load every ``*.safetensors`` file in ``path`` into ``model``.

    Raises ``ValueError`` naming the file and tensor for a tensor that has no place in the
    model or the wrong shape, and listing what is missing when weights are left unloaded.
    ``checkpoint_format`` (an fp8 checkpoint's, chapter 08) turns fp8 tensors back into
    numbers with their scale tensors, which may sit in another file of the checkpoint.
    """
    files = sorted(glob(str(Path(path) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    split = getattr(model, "split_fused_tensor", _unsplit)
    with ExitStack() as stack:
        where = {}  # tensor name -> (open file, its path)
        for file in files:
            f = stack.enter_context(_open(file))
            where.update((name, (f, file)) for name in f.keys())

        def get(name: str) -> torch.Tensor | None:
            return _read(*where[name], name) if name in where else None

        loaded = {
            part
            for name, (f, file) in where.items()
            for part in _load_tensor(name, file, get, params, mapping, checkpoint_format, split)
        }
    expected = _expected_names(params, mapping)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"the checkpoint in {path} lacks {len(missing)} of the {len(expected)} tensors "
            f"the model needs: {shown}"
        )


def _open(file: str):
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:
        raise ValueError(f"{file} is not a readable safetensors file: {err}") from None


def _read(f, file: str, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{file} is not a readable safetensors file: {err}") from None


class _NoPlace(Exception):
    """A checkpoint tensor (or a piece of a fused one) that no parameter takes."""


def _unsplit(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]  # checkpoints of most models hold no fused tensors


def _load_tensor(name, file, get, params, mapping, checkpoint_format, split) -> list[str]:
    """Load checkpoint tensor ``name`` into its parameter(s); the names it filled, once a
    fused tensor is split (none: a scale, or a tensor we recompute)."""
    if checkpoint_format is not None and checkpoint_format.is_companion(name):
        return []  # a scale: read together with its weight
    target = _resolve(name, mapping)[0]
    if target not in params and (name == "lm_head.weight" or "rotary_emb" in name):
        return []  # tied to the embedding, or recomputed
    tensor = get(name)
    try:
        if tensor.dtype in FP8_STORAGE_DTYPES:
            if checkpoint_format is None:
                raise ValueError(
                    f"it is stored as {tensor.dtype} but config.json has no quantization_config "
                    "saying how to scale it"
                )
            tensor = checkpoint_format.dequantize(name, tensor, get)
        pieces = split(name, tensor)
        places = [_resolve(part, mapping) for part, _ in pieces]
        if any(target not in params for target, _ in places):
            raise _NoPlace
        for (target, shard_id), (_, piece) in zip(places, pieces):
            _load_one(params[target], piece, shard_id)
    except _NoPlace:
        raise ValueError(f"{file}: tensor {name!r} has no place in the model") from None
    except ValueError as err:
        raise ValueError(
            f"{file}: tensor {name!r} does not fit parameter {target!r}: {err}"
        ) from None
    return [part for part, _ in pieces]


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
    """Random weights of a sensible scale, for benchmarks where values do not matter.

    The values are drawn for the *whole* checkpoint tensors, then loaded like a checkpoint's,
    so every tensor-parallel rank takes its slice of the same model: TP=2 computes exactly
    what TP=1 does (chapter 09 checks its greedy tokens against one rank on these weights).
    """
    with as_single_rank(), torch.device("meta"):
        whole = type(model)(model.config)  # the unsharded shapes; meta: no memory
    whole_modules = dict(whole.named_modules())
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        shape = whole.get_parameter(name).shape
        if name.endswith("norm.weight"):
            values = torch.ones(shape, device=device)
        else:
            values = torch.randn(shape, generator=gen, device=device) * 0.02
        module = whole_modules[name.rpartition(".")[0]]
        for shard_id, part in _unpack(module, values):
            _load_one(param, part, shard_id)


def _unpack(module: nn.Module, values: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
    """A packed parameter's values split back into its checkpoint tensors (with their ids)."""
    if isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
        return list(zip("qkv", values.split([q, kv, kv])))
    if isinstance(module, MergedColumnParallelLinear):
        return list(enumerate(values.split(module.output_sizes)))
    return [(None, values)]

"""Checkpoints stored in fp8, in the Hugging Face layout (chapter 08 §6).

``config.json`` says so in ``quantization_config`` (``{"quant_method": "fp8",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``), and each quantized linear
weight ``W`` ``[out, in]`` is stored as ``torch.float8_e4m3fn`` codes beside the scales with
``W = codes * scales``: ``<name>.weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``, one per
128 x 128 block (the Qwen3 and DeepSeek FP8 releases; "inv": the loader multiplies by it), or
``<name>.weight_scale``, one for the tensor (``[]``, ``[1]``) or per output channel (``[out]``,
``[out, 1]``), as AutoFP8 / llm-compressor write them. ``input_scale`` and
``k_scale``/``v_scale`` are skipped: activations are scaled dynamically per token here, and the
fp8 KV cache uses its own scale (``kv_cache.py``).

The loader *dequantizes* each tensor as it reads it and lets ``process_weights_after_loading``
quantize the layer to e4m3 per output channel, the one fp8 GEMM this engine has (``fp8.py``).
Why not keep the blocks: the packed ``qkv_proj``/``gate_up_proj`` and tensor-parallel slices
then need no block alignment (q, k, v of a small model are not multiples of 128), and row-wise
``torch._scaled_mm`` runs on every torch we support, while block-scaled GEMMs need newer builds
or a kernel of our own. The price: a second rounding (about half an e4m3 step more error), and
the layer passing through the model's dtype once at load time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

FP8_STORAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Tensors read together with their weight (or ignored), never loaded on their own.
COMPANION_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".k_scale",
                      ".v_scale")


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """The ``quantization_config`` of an fp8 checkpoint, and how to read its weights."""

    weight_block_size: tuple[int, int] | None  # None: per-tensor or per-channel scales
    activation_scheme: str = "dynamic"  # recorded; activations are always dynamic here

    @classmethod
    def from_config(cls, qc: dict, source: str) -> Fp8CheckpointFormat:
        block = qc.get("weight_block_size")
        if block is not None and not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ValueError(
                f"{source}: quantization_config.weight_block_size must be two ints > 0, "
                f"e.g. [128, 128], got {block!r}"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        return cls(tuple(block) if block else None, str(scheme))

    def is_companion(self, name: str) -> bool:
        return name.endswith(COMPANION_SUFFIXES)

    def dequantize(
        self, name: str, codes: torch.Tensor, get: Callable[[str], torch.Tensor | None]
    ) -> torch.Tensor:
        """float32 values of fp8 tensor ``name``; ``get(name)`` reads another tensor (or None)."""
        stem = name.removesuffix(".weight")
        scale_inv, scale = get(stem + ".weight_scale_inv"), get(stem + ".weight_scale")
        if scale_inv is not None:
            return dequantize_blocks(codes, scale_inv, self.weight_block_size, name)
        if scale is not None:
            return dequantize_per_tensor_or_channel(codes, scale, name)
        raise ValueError(
            f"tensor {name!r} is stored as {codes.dtype} but the checkpoint has neither "
            f"{stem + '.weight_scale_inv'!r} nor {stem + '.weight_scale'!r} to scale it"
        )


def dequantize_blocks(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, name: str
) -> torch.Tensor:
    """``codes`` ``[out, in]`` times one scale per ``block`` tile (the last tiles may be short)."""
    if block is None:
        raise ValueError(
            f"tensor {name!r} has a weight_scale_inv but quantization_config has no "
            "weight_block_size"
        )
    rows, cols = codes.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}: weight_scale_inv must be {expected} for a {tuple(codes.shape)} weight "
            f"in {block[0]} x {block[1]} blocks, got {tuple(scale_inv.shape)}"
        )
    full = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return codes.float() * full[:rows, :cols]


def dequantize_per_tensor_or_channel(
    codes: torch.Tensor, scale: torch.Tensor, name: str
) -> torch.Tensor:
    """``codes`` ``[out, in]`` times a scalar scale or one scale per output row."""
    if scale.numel() == 1:
        return codes.float() * scale.float().reshape(())
    if scale.numel() == codes.shape[0] and scale.dim() <= 2:
        return codes.float() * scale.float().reshape(-1, 1)
    raise ValueError(
        f"{name}: weight_scale must hold 1 or {codes.shape[0]} values (per tensor or per "
        f"output channel), got shape {tuple(scale.shape)}"
    )


def read_checkpoint_quantization(model_dir: str | Path) -> Fp8CheckpointFormat | None:
    """The fp8 format that ``model_dir/config.json`` declares, None for an unquantized model.

    Raises ``ValueError`` for a ``quant_method`` this engine cannot load (GPTQ, AWQ, ...).
    An unreadable ``config.json`` returns None: ``ModelConfig`` reports it with more detail.
    """
    file = Path(model_dir) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise ValueError(
            f"{file}: quantization_config.quant_method {method!r} is not supported; nanovllm "
            "loads unquantized checkpoints and fp8 ones (quant_method 'fp8')"
        )
    return Fp8CheckpointFormat.from_config(qc, str(file))

"""Quantization: int8 and fp8 weights, fp8 KV cache, fp8 checkpoints (chapter 08).

Taught in ``chapters/08_quantization.py``. Switched on from ``EngineConfig`` with vLLM's names:
``quantization=None | "int8" | "fp8"`` and ``kv_cache_dtype="auto" | "fp8"``.

- ``scales.py``: symmetric per-row scales, int8 and fp8 e4m3 (the shared arithmetic);
- ``base.py``: ``LinearMethod``, what a method does to a linear layer;
- ``int8.py``: W8A16, int8 weights (our Triton GEMM on a GPU, ``nanovllm/kernels/int8_gemm.py``);
- ``fp8.py``: W8A8, e4m3 weights and dynamically scaled e4m3 activations (``torch._scaled_mm``);
- ``fp8_checkpoint.py``: loading checkpoints stored in fp8 (Hugging Face's layout);
- ``kv_cache.py``: the fp8 KV cache.

Quantization is *online*: the checkpoint (bf16/fp32) loads as usual, then
``process_weights_after_loading`` turns every linear layer of the decoder into its quantized
form, after all the shards of a packed layer (q/k/v, gate/up) are in place.
"""

from __future__ import annotations

from torch import nn

from nanovllm.layers.quantization.base import LinearMethod

QUANTIZATION_METHODS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")


def get_linear_method(name: str) -> LinearMethod:
    """The ``LinearMethod`` for a ``quantization`` name (``QUANTIZATION_METHODS``)."""
    from nanovllm.layers.quantization.fp8 import Fp8LinearMethod
    from nanovllm.layers.quantization.int8 import Int8LinearMethod

    methods = {"int8": Int8LinearMethod, "fp8": Fp8LinearMethod}
    if name not in methods:
        raise ValueError(f"unknown quantization {name!r}; choose one of {QUANTIZATION_METHODS}")
    return methods[name]()


def process_weights_after_loading(model: nn.Module, quantization: str | None) -> int:
    """Quantize every linear layer of ``model`` in place; return how many were quantized.

    Only ``LinearBase`` layers (attention and MLP projections) change. The token embedding and
    the LM head keep the model's dtype, as in vLLM and most published int8/fp8 checkpoints:
    the embedding is a table lookup (no matmul to speed up, and a step reads only the rows of
    its tokens), and the LM head's errors land directly on the logits, where a small shift
    between two close candidates changes the sampled token; it is also often tied to the
    embedding. Together they are a small share of a large model's bytes.
    """
    if quantization is None:
        return 0
    from nanovllm.layers.linear import LinearBase

    method = get_linear_method(quantization)
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            method.process_weights_after_loading(module)
            module.quant_method = method
            count += 1
    return count

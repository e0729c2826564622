"""Architecture configs shipped with nanovllm, for benchmarks with random weights (chapter 11).

``config_path("qwen3-0.6b")`` is a folder that ``LLM(..., load_format="dummy")`` accepts.
``qwen3-8b`` (Qwen3-8B's dimensions: 36 layers, hidden 4096, 32 heads over 8 KV heads) is the
larger shape of chapter 08's quantization measurements (``nanovllm/benchmarks/quantization.py``);
``qwen3-32b`` (64 layers, hidden 5120, 64 heads over 8 KV heads, MLP 25600) the largest shape
of chapter 09's tensor-parallel scaling (``tests/gpu/tp_scaling.sh``). Chapter 16's mixtures
of experts: ``qwen3-30b-a3b`` (Qwen3-30B-A3B's config: 48 layers, hidden 2048, 32 heads over 4
KV heads, 128 experts of width 768, 8 per token; 30.5B parameters, 3.3B active per token) and
``qwen3-moe-small``, not a published model: Qwen3-0.6B's attention and width with 64 experts of
width 384, 8 per token, in every layer (2.4B parameters, 0.6B active).
"""

from pathlib import Path

SHIPPED = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "smollm2-135m", "qwen3-30b-a3b",
           "qwen3-moe-small")


def config_path(name: str) -> Path:
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped config {name!r}; choose from {SHIPPED}")
    return Path(__file__).parent / name

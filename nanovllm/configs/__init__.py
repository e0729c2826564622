"""Architecture configs shipped with nanovllm, for benchmarks with random weights (chapter 11).

``config_path("qwen3-0.6b")`` is a folder that ``LLM(..., load_format="dummy")`` accepts.
``qwen3-8b`` (Qwen3-8B's dimensions: 36 layers, hidden 4096, 32 heads over 8 KV heads) is the
larger shape of chapter 08's quantization measurements (``nanovllm/benchmarks/quantization.py``);
``qwen3-32b`` (64 layers, hidden 5120, 64 heads over 8 KV heads, MLP 25600) the largest shape
of chapter 09's tensor-parallel scaling (``tests/gpu/tp_scaling.sh``).
"""

from pathlib import Path

SHIPPED = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "smollm2-135m")


def config_path(name: str) -> Path:
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped config {name!r}; choose from {SHIPPED}")
    return Path(__file__).parent / name

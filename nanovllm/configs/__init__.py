"""Architecture configs shipped with nanovllm, for benchmarks with random weights (chapter 11).

``config_path("qwen3-0.6b")`` is a folder that ``LLM(..., load_format="dummy")`` accepts.
"""

from pathlib import Path

SHIPPED = ("qwen3-0.6b", "smollm2-135m")


def config_path(name: str) -> Path:
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped config {name!r}; choose from {SHIPPED}")
    return Path(__file__).parent / name

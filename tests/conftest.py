"""Shared pytest setup: the `gpu` marker's auto-skip and fixtures used across test files."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `@pytest.mark.gpu` tests on machines without CUDA (CI is CPU-only)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # don't pay for importing torch when nothing asks for a GPU
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted once per cache, ~20 s)."""
    from nanovllm.weights.smollm2 import smollm2_path

    return smollm2_path()

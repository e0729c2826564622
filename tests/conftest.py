"""Shared pytest setup: the `gpu` marker's auto-skip and fixtures used across test files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton decides whether to interpret or compile its own library functions when it is first
# imported, so on a machine without CUDA the interpreter must be chosen before any test
# module imports triton (see tests/kernels/conftest.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `@pytest.mark.gpu` tests on machines without CUDA (CI is CPU-only)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
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

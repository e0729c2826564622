"""``show_source`` (nanovllm/viz/source.py): the chapters' one way to show the package's code."""

from __future__ import annotations

import pytest

from nanovllm.engine.block_manager import chain_hash
from nanovllm.viz import source

Markdown = pytest.importorskip("IPython.display").Markdown  # (a bare GPU image lacks IPython)


def shown(monkeypatch, *objects) -> str:
    out = []
    monkeypatch.setattr("IPython.display.display", out.append)
    source.show_source(*objects)
    assert len(out) == 1 and isinstance(out[0], Markdown)
    return out[0].data


def test_functions_render_as_one_python_block(monkeypatch):
    text = shown(monkeypatch, chain_hash, source.show_source)
    assert text.startswith("```python\n") and text.endswith("```")
    assert "def chain_hash(" in text and "def show_source(" in text


def test_a_triton_kernel_renders_its_python_function(monkeypatch):
    pytest.importorskip("triton")
    from nanovllm.kernels import rmsnorm

    kernels = [v for v in vars(rmsnorm).values() if type(v).__module__.startswith("triton")]
    assert kernels, "rmsnorm.py defines a @triton.jit kernel"
    text = shown(monkeypatch, kernels[0])
    assert f"def {kernels[0].fn.__name__}(" in text

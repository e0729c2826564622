"""The attention backends' registry (``nanovllm/layers/attention_backends.py``).

Every backend class has the ``AttentionBackend`` shape; its ``check`` says why it cannot run a
configuration (``None``: it can), and ``resolve_backend`` refuses with that reason and every
other backend's verdict. The fused kernels switch through one attribute, and no layer or
model imports anything inside ``forward``.
"""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

import nanovllm
from nanovllm.config import ATTENTION_BACKENDS
from nanovllm.layers import flash_attention
from nanovllm.layers.attention import Attention, building_with
from nanovllm.layers.attention_backends import (
    BACKENDS,
    AttentionBackend,
    TorchBackend,
    resolve_backend,
    resolve_backend_name,
    select_backend,
)

CPU = torch.device("cpu")


def settings(backend="auto", dtype="float32", block_size=16, kv_cache_dtype="auto"):
    return types.SimpleNamespace(attention_backend=backend, dtype=dtype, block_size=block_size,
                                 kv_cache_dtype=kv_cache_dtype)


def without_package(monkeypatch, missing: str) -> None:
    real = flash_attention.importlib.util.find_spec
    monkeypatch.setattr(flash_attention.importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))


def test_the_registry_names_every_backend_the_config_accepts():
    assert set(BACKENDS) == set(ATTENTION_BACKENDS) - {"auto"}
    assert all(name == cls.name for name, cls in BACKENDS.items())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_class_has_the_protocol_shape(name):
    cls = BACKENDS[name]
    for attr in ("name", "uses_fused_kernels", "cuda_graphs"):
        assert isinstance(getattr(cls, attr), str if attr == "name" else bool), attr
    assert isinstance(inspect.getattr_static(cls, "check"), classmethod)
    for method in ("store_kv", "attend", "check"):
        want = list(inspect.signature(getattr(AttentionBackend, method)).parameters)
        got = list(inspect.signature(getattr(cls, method)).parameters)
        assert got == want, f"{name}.{method}{got} is not the protocol's {want}"
    assert list(inspect.signature(cls).parameters)[0] == "kv_cache_dtype"


def test_a_built_torch_backend_is_an_attention_backend():
    backend = TorchBackend("fp8")
    assert isinstance(backend, AttentionBackend) and backend.kv_cache_dtype == "fp8"
    assert not isinstance(types.SimpleNamespace(name="torch"), AttentionBackend)


def test_torch_runs_everything():
    for kv in ("auto", "fp8"):
        assert TorchBackend.check(settings(block_size=1, kv_cache_dtype=kv), CPU) is None


def test_flash_attn_on_a_cpu_says_why():
    reason = BACKENDS["flash_attn"].check(settings("flash_attn"), CPU)
    assert "CUDA GPUs only" in reason and "'cpu'" in reason


def test_triton_without_triton_says_why(monkeypatch):
    without_package(monkeypatch, "triton")
    reason = BACKENDS["triton"].check(settings("triton"), CPU)
    assert reason is not None and "needs the triton package" in reason
    assert resolve_backend_name("auto", "cuda") == "torch"  # auto falls back only then


def test_triton_with_small_blocks_says_why(monkeypatch):
    assert "block_size 8 is too small" in BACKENDS["triton"].check(settings(block_size=8), CPU)


def test_refusal_names_the_reason_and_every_other_verdict():
    with pytest.raises(ValueError) as err:
        resolve_backend(settings("flash_attn"), CPU)
    message = str(err.value)
    assert message.startswith("attention_backend='flash_attn'")
    assert "torch: runs" in message and "triton: " in message
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_backend(settings("flash"), CPU)


def test_auto_on_a_cpu_is_the_torch_backend():
    assert resolve_backend(settings(), CPU) is TorchBackend
    backend = select_backend(settings(kv_cache_dtype="fp8"), CPU)
    assert type(backend) is TorchBackend and backend.kv_cache_dtype == "fp8"


def test_layers_take_the_backend_they_are_built_with():
    backend = TorchBackend()
    with building_with(backend):
        inside = [Attention(2, 1, 8, 0.1) for _ in range(2)]
    outside = Attention(2, 1, 8, 0.1)
    assert all(layer.backend is backend for layer in inside)
    assert outside.backend is not backend and isinstance(outside.backend, TorchBackend)


def _package_modules():
    root = Path(nanovllm.__file__).parent
    return sorted(p for p in root.rglob("*.py"))


def test_no_import_inside_forward():
    """Kernels are chosen when a backend is built or switched on, never per call."""
    offenders = []
    for path in _package_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "forward":
                offenders += [f"{path.name}:{n.lineno}" for n in ast.walk(node)
                              if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not offenders, offenders


def test_fused_kernels_switch_through_one_attribute():
    sources = {p.name: p.read_text() for p in _package_modules()}
    assert not [name for name, text in sources.items() if "use_triton" in text]

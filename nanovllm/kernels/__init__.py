"""Triton kernels of the engine.

Each module holds one kernel and its Python launcher; each module's docstring names the
chapter that teaches it. Importing a kernel module needs ``triton``; without it the import
raises ``ImportError`` and the engine falls back to its pure-PyTorch attention backend.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # the backend dispatch catches this and keeps the torch path
    raise ImportError(
        "nanovllm.kernels needs the 'triton' package (pip install triton); without it, use "
        "attention_backend='torch'"
    ) from exc

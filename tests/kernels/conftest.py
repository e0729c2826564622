"""Kernel tests: run Triton kernels under the interpreter on machines without CUDA.

Triton decides between compiling and interpreting when a function is decorated with
``@triton.jit`` -- its own library functions when ``triton`` is first imported, ours when
their module is imported -- by reading TRITON_INTERPRET. So the variable must be set
before the first ``import triton`` of the process. pytest imports this conftest when it
reaches this folder, before this folder's test modules. If something imported triton
earlier without the variable (a root conftest, a test module collected before this
folder), the kernel tests notice and rerun their cases in a fresh subprocess (see
``test_cases_in_fresh_process`` in test_prefill_kernel.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

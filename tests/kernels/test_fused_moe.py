"""The fused MoE Triton kernel against the per-expert float32 reference (chapter 16).

``fused_moe`` (two grouped-GEMM launches over ``moe_align_block_size``'s blocks) against
``moe_reference`` on fresh random inputs: odd sizes (hidden and intermediate widths that are
not multiples of the 64-wide tiles), a single token, more experts than assignments, skewed
routing, every block size. Without CUDA it runs under the Triton interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), so the shapes are small.

Tolerance (``torch.testing.assert_close``, ``rtol = atol``): 1e-5 in fp32 (the same products,
summed in another order); bf16: 2e-2, the reference rounding its gate/up projection and the
activation to bf16 before the down projection where the kernel keeps fp32 (outputs of order
0.1 to 1). The model test: a tiny random Qwen3-MoE with every fused kernel switched on gives
the logits of transformers within 1e-4 (fp32).
"""

from __future__ import annotations

import os

import pytest
import torch
from course_ids import MODEL

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.skipif(not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                       reason="no GPU and no interpreter"),
    pytest.mark.assignment("16.route", "16.align"),  # the inputs are routed, the kernel aligns
]

from nanovllm.kernels.fused_moe import fused_moe, pick_block_m  # noqa: E402
from nanovllm.layers.fused_moe import moe_reference  # noqa: E402
from nanovllm.layers.router import route  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def moe_inputs(tokens, experts, k, hidden, inter, seed, dtype=torch.float32, skew=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += skew  # a hot expert
    weights, ids = route(logits, k, renormalize=True)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            weights.to(**to), ids.to(**to))


CASES = [  # tokens, experts, k, hidden, inter, block_m (None: the kernel's choice)
    (1, 4, 1, 64, 32, None),
    (7, 8, 2, 72, 40, None),
    (3, 16, 4, 64, 64, 16),  # more experts than assignments
    (40, 4, 2, 64, 96, 32),
    (70, 4, 2, 48, 24, 64),
]


@pytest.mark.parametrize("tokens,experts,k,hidden,inter,block_m", CASES)
def test_fused_moe_matches_reference_fp32(tokens, experts, k, hidden, inter, block_m):
    args = moe_inputs(tokens, experts, k, hidden, inter, seed=tokens + 10 * experts)
    out = fused_moe(*args, block_m=block_m)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out, moe_reference(*args), atol=tol, rtol=tol)


def test_fused_moe_with_a_hot_expert_and_no_tokens():
    args = moe_inputs(33, 8, 2, 64, 32, seed=5, skew=4.0)
    assert bool((args[4] == 0).any(dim=1).all())  # every token visits expert 0
    torch.testing.assert_close(fused_moe(*args), moe_reference(*args), atol=1e-5, rtol=1e-5)
    empty = moe_inputs(0, 8, 2, 64, 32, seed=6)
    assert fused_moe(*empty).shape == (0, 64)


def test_fused_moe_bf16():
    args = moe_inputs(9, 8, 2, 64, 48, seed=7, dtype=torch.bfloat16)
    out = fused_moe(*args)
    assert out.dtype == torch.bfloat16
    exact = moe_reference(args[0].float(), args[1].float(), args[2].float(), *args[3:])
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), exact, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), moe_reference(*args).float(), atol=tol, rtol=tol)


def test_block_m_follows_assignments_per_expert():
    assert pick_block_m(8, 128) == 16 and pick_block_m(256 * 8, 128) == 16
    assert pick_block_m(4096, 128) == 32 and pick_block_m(8192 * 8, 128) == 64


@pytest.mark.assignment(*MODEL)
def test_model_with_fused_moe_matches_transformers(tmp_path):
    from test_moe_models import tiny_moe_model

    from nanovllm.context import attention_metadata
    from nanovllm.layers.fused import set_fused_kernels
    from nanovllm.layers.fused_moe import FusedMoE
    from nanovllm.models import ModelConfig, get_model_class
    from nanovllm.weights.loader import load_safetensors

    hf = tiny_moe_model("qwen3moe", tmp_path).to(DEVICE)
    cfg = ModelConfig.from_pretrained(tmp_path)
    with torch.device(DEVICE):
        ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, tmp_path)
    set_fused_kernels(ours, True)
    moe = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.fused_kernel is fused_moe for m in moe)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(21, device=DEVICE)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4

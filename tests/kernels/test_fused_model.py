"""The fused kernels inside the model: layers switched to them agree with the PyTorch path.

Layers: the fused RMSNorm (with its residual add) and SiluAndMul round like the PyTorch path
(round the fp32 result to the activation dtype, multiply, round again), so in bf16 and fp16
almost every element is bit-equal. The rest differ where fp32 sums or ``rsqrt``/``exp``, computed
in another order, round the intermediate the other way: one ulp of it, times the weight or
``up``, which is at most two ulps of the result.

Model: tiny random Llama and Qwen3 models in fp32, called directly (no engine, so attention is
PyTorch's causal attention); hidden states and logits with ``set_fused_kernels(model, True)``
equal the PyTorch path's within 1e-5 (values of order 1 to 10).
"""

from __future__ import annotations

import os

import pytest
import torch
from course_ids import MODEL

from nanovllm.context import attention_metadata
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.fused import Fusable, set_fused_kernels
from nanovllm.layers.norm import RMSNorm
from nanovllm.models import ModelConfig, get_model_class

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"), reason="no GPU and no interpreter"
)
HALF = [torch.float16, torch.bfloat16]


def assert_nearly_bit_equal(fused: torch.Tensor, reference: torch.Tensor) -> None:
    """At most 1% of the elements differ, each by at most two ulps of its magnitude."""
    differ = fused != reference
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} differ"
    two_ulps = 2 * torch.finfo(fused.dtype).eps * reference.float().abs()
    assert bool(((fused.float() - reference.float()).abs() <= two_ulps).all())


@pytest.mark.assignment("01.rmsnorm")
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rmsnorm_layer_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(576, generator=gen))
    x = torch.randn(33, 576, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(33, 576, generator=gen).to(DEVICE, dtype)
    heads = torch.randn(5, 9, 576, generator=gen).to(DEVICE, dtype)  # leading dims, like q_norm

    with torch.no_grad():
        expected, expected_residual = norm(x, residual)
        expected_heads = norm(heads)
        set_fused_kernels(norm, True)
        fused, fused_residual = norm(x, residual.clone())
        fused_heads = norm(heads)
    assert torch.equal(fused_residual, expected_residual)
    assert_nearly_bit_equal(fused, expected)
    assert fused_heads.shape == heads.shape
    assert_nearly_bit_equal(fused_heads, expected_heads)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_silu_and_mul_layer_matches_torch_path(dtype):
    gate_up = 2 * torch.randn(2, 17, 2 * 300, generator=torch.Generator().manual_seed(1))
    gate_up = gate_up.to(DEVICE, dtype)
    act = SiluAndMul()
    expected = act(gate_up)
    set_fused_kernels(act, True)
    fused = act(gate_up)
    assert fused.shape == expected.shape == (2, 17, 300)
    assert_nearly_bit_equal(fused, expected)


MODELS = {
    # name: (architecture, heads, kv heads, head dim, hidden)
    "llama-gqa3-d64": ("LlamaForCausalLM", 6, 2, 64, 192),
    "qwen3-gqa2-d128": ("Qwen3ForCausalLM", 4, 2, 128, 256),
}


def tiny_random_model(arch: str, heads: int, kv_heads: int, head_dim: int, hidden: int):
    cfg = ModelConfig.from_dict(
        {
            "architectures": [arch],
            "vocab_size": 300,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": 256,
        }
    )
    torch.manual_seed(0)
    model = get_model_class(arch)(cfg).to(DEVICE)
    with torch.no_grad():  # activations of order 1; norm weights away from 1 so none hides
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


@pytest.mark.assignment(*MODEL)
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_model_matches_torch_path(name):
    model = tiny_random_model(*MODELS[name])
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (13,), generator=gen).to(DEVICE)
    positions = (torch.arange(13) + 100).to(DEVICE)  # not starting at 0: the tables are indexed

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), attention_metadata(None):
            hidden = model(ids, positions)
            return hidden, model.compute_logits(hidden)

    hidden, logits = run()
    set_fused_kernels(model, True)
    flags = [m.fused_kernel is not None for m in model.modules() if isinstance(m, Fusable)]
    # per layer: 2 norms, attention, SiluAndMul (+ q/k norms in Qwen3); and the final norm
    assert all(flags) and len(flags) == 2 * (4 + 2 * model.config.architecture.startswith("Q")) + 1
    fused_hidden, fused_logits = run()
    torch.testing.assert_close(fused_hidden, hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=1e-5)
    assert fused_logits.abs().max() > 1  # a test on values of order 1, not of 1e-5

    set_fused_kernels(model, False)
    assert torch.equal(run()[1], logits)

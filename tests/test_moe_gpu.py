"""MoE on a GPU (chapter 16; ``make test-gpu``, skipped without CUDA).

Tiny random Qwen3-MoE and Mixtral models: greedy tokens equal transformers' in fp32 through the
Triton backend, the fused MoE kernel and CUDA graphs (decode batches replayed from graphs whose
MoE buffers were sized at capture); a launch never waits for the device (the alignment reads
nothing back); and the kernel in bf16 on the Qwen3-30B-A3B layer shape stays within 2e-2 of
the float32 reference at 1 to 256 tokens.
"""

from __future__ import annotations

import pytest
import torch
from course_ids import ENGINE
from test_moe_models import VARIANTS, hf_greedy, tiny_moe_model

from nanovllm import LLM, SamplingParams
from nanovllm.layers.fused_moe import FusedMoE, moe_reference
from nanovllm.layers.router import route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.assignment(*ENGINE, "16.route", "16.align"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gpu-{request.param}")
    return tiny_moe_model(request.param, path).cuda(), str(path)


def test_fp32_greedy_matches_transformers_with_kernel_and_graphs(tiny):
    hf, path = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40, 77)]
    llm = LLM(path, dtype="float32", attention_backend="triton", max_num_batched_tokens=64,
              kv_cache_memory=1 << 28)
    assert llm.engine.runner.graphs is not None
    moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.fused_kernel is not None for m in moe)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    hf_cpu = hf.cpu()
    try:
        assert [o.token_ids for o in outs] == hf_greedy(hf_cpu, prompts, 16)
    finally:
        hf.cuda()


def test_moe_launch_without_a_host_sync(tiny, monkeypatch):
    _, path = tiny
    llm = LLM(path, kv_cache_memory=1 << 28, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([[1, 2, 3, 4] * 10], params, use_tqdm=False)  # warm-up: graphs, compiles
    runner, launch = llm.engine.runner, llm.engine.runner.launch

    def checked(batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch", checked)
    outs = llm.generate([[1, 2, 3, 4] * 10, [7, 8, 9] * 20], params, use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)


@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_bf16_kernel_on_the_30b_a3b_layer_shape(tokens):
    from nanovllm.kernels.fused_moe import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, k, hidden, inter = 128, 8, 2048, 768
    x = torch.randn(tokens, hidden, generator=gen, device="cuda")
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, generator=gen, device="cuda"), k, True)
    out = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    exact = moe_reference(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(),
                          weights, ids)
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)

"""GPU checks of the whole engine (run with ``make test-gpu``; skipped without CUDA).

A random model of SmolLM2's shape (6 of its 30 layers) stands in for real weights, which
cannot travel to the GPU machine. Greedy tokens must equal transformers' in fp32 with the
Triton backend, its fused kernels and CUDA graphs on, with and without async scheduling;
bf16 logits must stay within 2% (relative norm) of transformers' fp32 logits, the usual
distance of one bf16 rounding per layer; async scheduling must not change a sampled token.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.layers.fused import set_fused_kernels
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.weights.loader import load_safetensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    import transformers

    from nanovllm.configs import config_path

    config = transformers.AutoConfig.from_pretrained(config_path("smollm2-135m"))
    config.num_hidden_layers = 6
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("smollm2-shaped")
    model.save_pretrained(path)
    return model.cuda().eval(), path


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fp32_greedy_matches_transformers_with_graphs(smollm2_shaped, async_scheduling):
    hf, path = smollm2_shaped
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (7, 33, 100, 250)]
    llm = LLM(
        path,
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=128,
        kv_cache_memory=1 << 30,  # not 90% of the GPU: the other test's engine may linger
        async_scheduling=async_scheduling,
    )
    assert llm.engine.runner.graphs is not None
    assert all(m.use_triton for m in llm.engine.runner.model.modules() if hasattr(m, "use_triton"))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expected = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == expected[0, len(prompt) :].tolist()


def test_async_scheduling_changes_no_token_in_bf16(smollm2_shaped):
    _, path = smollm2_shaped
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in range(5, 400, 13)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = {}
    for mode in (False, True):
        llm = LLM(path, max_num_batched_tokens=512, kv_cache_memory=1 << 30, async_scheduling=mode)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_logits_close_to_fp32_transformers(smollm2_shaped, fused):
    hf, path = smollm2_shaped
    cfg = ModelConfig.from_pretrained(path)
    torch.set_default_dtype(torch.bfloat16)  # as the engine builds it: RoPE tables stay fp32
    try:
        with torch.device("cuda"):
            ours = get_model_class(cfg.architecture)(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    load_safetensors(ours, path)
    set_fused_kernels(ours, fused)
    ids = torch.randint(0, 49152, (64,), device="cuda")
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(64, device="cuda"))).float()
        expected = hf(ids[None]).logits[0]
    rel = (logits - expected).norm() / expected.norm()
    assert rel < 2e-2, f"relative error {rel:.3g}"

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
from nanovllm.layers.fused import Fusable, set_fused_kernels
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
    fusable = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fusable)]
    assert fusable and all(m.fused_kernel is not None for m in fusable)
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


def _hf_greedy(hf, prompt: list[int], n: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fp32_penalties_and_logprobs_match_transformers_with_graphs(
    smollm2_shaped, async_scheduling
):
    """The repetition penalty reads each request's newest token, which under async
    scheduling is still on the device when the next step's penalties are built."""
    hf, path = smollm2_shaped
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (9, 40, 130)]
    llm = LLM(path, dtype="float32", attention_backend="triton", kv_cache_memory=1 << 30,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, logprobs=4)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.token_ids == _hf_greedy(hf, prompt, 12, repetition_penalty=1.3)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=4)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            expected = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
            assert abs(entry[token].logprob - expected[i, token].item()) < 1e-3
            assert entry[token].rank == 1  # greedy


def test_async_scheduling_changes_no_token_with_sampling_features(smollm2_shaped):
    _, path = smollm2_shaped
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in range(5, 300, 37)]
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=10 + 3 * i, ignore_eos=True, n=1 + i % 3,
            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
            logit_bias={i: 2.0}, min_tokens=4, logprobs=3,
        )
        for i in range(len(prompts))
    ]
    outs = {}
    for mode in (False, True):
        llm = LLM(path, max_num_batched_tokens=512, kv_cache_memory=1 << 30, async_scheduling=mode)
        outs[mode] = [
            [c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs[True] == outs[False]


def test_sampling_features_launch_without_a_host_sync(smollm2_shaped, monkeypatch):
    """Penalties, bias, bans, logprobs and prompt logprobs are queued on the device: a
    launch never waits for it (with async scheduling the CPU must run ahead)."""
    _, path = smollm2_shaped
    llm = LLM(path, kv_cache_memory=1 << 30, async_scheduling=True)
    params = SamplingParams(
        temperature=0.7, seed=1, max_tokens=12, repetition_penalty=1.2, presence_penalty=0.5,
        logit_bias={5: 1.0}, allowed_token_ids=list(range(100, 5000)), min_tokens=3,
        logprobs=5, prompt_logprobs=2,
    )
    llm.generate([[1, 2, 3, 4] * 10], params, use_tqdm=False)  # warm-up: graphs, allocator
    runner, launch = llm.engine.runner, llm.engine.runner.launch

    def checked(batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch", checked)
    outs = llm.generate([[1, 2, 3, 4] * 10, [7, 8, 9] * 20], params, use_tqdm=False)
    assert all(len(o.token_ids) == 12 and o.prompt_logprobs[1] is not None for o in outs)

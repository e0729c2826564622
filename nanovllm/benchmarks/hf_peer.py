"""The peer of ``python -m nanovllm.benchmarks.throughput --peer hf``: transformers on the
same requests, in the same process (chapter 11). On a GPU its continuous batching (paged
attention), on a CPU its padded batched ``generate``. Either returns the seconds it took.
"""

from __future__ import annotations

import torch

from nanovllm.benchmarks.timing import stopwatch
from nanovllm.benchmarks.workload import Workload


def _hf_model(path: str, load_format: str, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_padded(path: str, load_format: str, work: Workload, dtype, device: str) -> float:
    """transformers' batched generate: left-padded prompts, all run to the longest output."""
    model = _hf_model(path, load_format, dtype, device)
    width = max(map(len, work.prompts))
    ids = torch.zeros(len(work.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(work.output_lens)
    with stopwatch(device) as watch:
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=0.6,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=0,
        )
    return watch.seconds


def run_hf_continuous(path: str, load_format: str, work: Workload, dtype, device: str) -> float:
    """transformers' continuous batching (paged attention), one request per prompt. (Not
    under inference_mode: its generation thread updates tensors created here.)"""
    from transformers import GenerationConfig

    model = _hf_model(path, load_format, dtype, device)
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        max_new_tokens=max(work.output_lens),
        eos_token_id=-1,
        pad_token_id=0,
    )
    with (model.continuous_batching_context_manager(generation_config=config) as manager,
          stopwatch(device) as watch):
        for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        generated = 0
        for _ in range(len(work.prompts)):
            result = manager.get_result(timeout=600)
            if result is None or result.error:
                raise RuntimeError(f"transformers' continuous batching failed: {result}")
            generated += len(result.generated_tokens)
    if generated != work.output_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens, not {work.output_tokens}")
    return watch.seconds

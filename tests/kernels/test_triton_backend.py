"""The engine on the ``triton`` attention backend gives the same greedy tokens as on ``torch``.

On CPU the kernels run under the Triton interpreter (see conftest.py), so the model is tiny;
the batch mixes decodes with prefill chunks that start after a cached prefix, which is the
path where the backend splits a batch between the decode and the prefill kernel.
"""

from __future__ import annotations

import os

import pytest
import torch
from course_ids import ENGINE

from nanovllm import LLM, SamplingParams

interpreted = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(
    not (interpreted or torch.cuda.is_available()), reason="triton was imported uninterpreted"
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@needs_kernels
# Every decode step of these short sequences takes one split (choose_num_splits: fewer than
# 128 keys in the table), so the merge kernel (05.combine_splits) is not reached.
@pytest.mark.assignment(*ENGINE, "05.decode_kernel")
def test_triton_backend_matches_torch_backend(tiny_llama):
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 19, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama, attention_backend=backend, max_num_batched_tokens=48,
                  dtype="float32", device="cpu" if not torch.cuda.is_available() else "cuda",
                  enforce_eager=True)
        llm.generate([shared + [1]], greedy, use_tqdm=False)  # cache the shared prefix
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert llm.engine.block_manager.hit_tokens > 0
    assert outputs["triton"] == outputs["torch"]

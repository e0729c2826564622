"""Speculative decoding in the engine (chapter 14): greedy output identical, token for
token, to no speculation and to transformers, under every scheduling feature; the
counters add up; what speculation does not support is refused with a clear error.

Every step of every test runs the engine's KV invariant check (conftest's ``kv_leak_check``):
a rollback that leaked a block, or registered one holding a rejected proposal in the prefix
cache, fails the step that did it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from course_ids import ENGINE
from test_scheduler import PROMPTS, make_tiny_llama, one_torch_thread  # noqa: F401
from test_tensor_parallel import ranks_deadline

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.executor import WorkerDiedError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
LAYERS = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3}
SPEC = ENGINE + ("14.rejection_sample",)
# A prompt that repeats itself, so that prompt lookup has something to find.
REPEAT = [7, 8, 9, 10, 11, 12] * 5
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"))


def generate(path, params, prompts=PROMPTS, **options):
    llm = LLM(path, num_kv_blocks=options.pop("num_kv_blocks", 256), **options)
    with ranks_deadline(llm):  # (tensor parallelism: a deadlock fails, not hangs)
        outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks  # every block back, rejected slots included
    return llm, outs


@pytest.fixture(scope="module")
def reference(tiny):
    return [o.token_ids for o in generate(tiny, GREEDY, PROMPTS + [REPEAT])[1]]


@pytest.mark.parametrize("spec", [NGRAM, LAYERS], ids=["ngram", "draft_layers"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill next to verification
        {"num_kv_blocks": 12, "max_num_batched_tokens": 40},  # preemption
    ],
    ids=["default", "chunks-of-7", "preemption"],
)
@pytest.mark.assignment(*SPEC, "14.ngram_propose")
def test_greedy_equals_no_speculation(tiny, reference, spec, options):
    llm, outs = generate(tiny, GREEDY, PROMPTS + [REPEAT],
                         speculative_config=spec, **options)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    # The per-request counters add up to the engine's.
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


@pytest.mark.assignment(*SPEC, "14.ngram_propose")
def test_ngram_accepts_on_a_repetitive_prompt_in_a_mixed_batch(tiny, reference):
    # Shared prompts hit the prefix cache; the repetitive one proposes, others rarely do.
    prompts = [REPEAT, REPEAT, PROMPTS[3], PROMPTS[0]]
    llm, outs = generate(tiny, GREEDY, prompts, speculative_config=NGRAM)
    expected = [reference[-1], reference[-1], reference[3], reference[0]]
    assert [o.token_ids for o in outs] == expected
    proposed = [o.metrics.num_draft_tokens for o in outs]
    assert proposed[0] > 0 and min(proposed) < max(proposed)  # with and without proposals


def test_stop_token_among_accepted_proposals_ends_there(tiny, reference):
    ref = reference[-1]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[5]])
    cut = ref.index(ref[5])
    _, outs = generate(tiny, params, [REPEAT], speculative_config=LAYERS)
    assert outs[0].token_ids == ref[: cut + 1]
    assert outs[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec", [NGRAM, LAYERS], ids=["ngram", "draft_layers"])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny, spec):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    _, alone = generate(tiny, [seeded], [REPEAT], speculative_config=spec)
    _, mixed = generate(tiny, [others, seeded, others], [PROMPTS[2], REPEAT, PROMPTS[5]],
                        speculative_config=spec)
    assert mixed[1].token_ids == alone[0].token_ids


def test_max_model_len_is_respected(tiny, reference):
    _, outs = generate(tiny, GREEDY, [REPEAT], speculative_config=LAYERS,
                       max_model_len=40)
    assert outs[0].token_ids == reference[-1][: 40 - len(REPEAT)]
    assert outs[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({**NGRAM, "num_layers": 1}, "belongs to 'draft_layers'"),
        ({**LAYERS, "prompt_lookup_max": 2}, "belongs to 'ngram'"),
        ({"method": "draft_layers", "num_speculative_tokens": 2}, "num_layers"),
        ({**LAYERS, "num_layers": 2}, "fewer"),  # the tiny model has 2 layers
        ({**NGRAM, "typo": 1}, "unknown speculative_config key"),
        ({"model": "/some/draft", "num_speculative_tokens": 2}, "config.json"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_configs_are_refused_at_construction(tiny, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny, num_kv_blocks=16, speculative_config=spec)


@pytest.mark.parametrize("spec", [NGRAM, LAYERS], ids=["ngram", "draft_layers"])
@pytest.mark.assignment(*SPEC, "14.ngram_propose", "09.row_shard", "09.vocab_embed")
def test_under_tensor_parallelism_equals_one_rank(tiny, reference, spec):
    """TP=2 on gloo: the workers follow each verify step (its k + 1 LM-head rows per
    request) and each draft pass of the target's first layer, and the greedy tokens are
    those of one rank without speculation."""
    llm, outs = generate(tiny, GREEDY, PROMPTS + [REPEAT], speculative_config=spec,
                         tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in outs] == reference
        stats = llm.engine.speculator.stats
        assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens
    finally:
        llm.shutdown()


def test_a_worker_killed_mid_speculation_fails_the_call_within_seconds(tiny):
    """Most of a step's collectives are in its draft passes: a worker lost there is the
    engine's failure (``WorkerDiedError``), not each request's failed proposals."""
    llm = LLM(tiny, num_kv_blocks=256, speculative_config=LAYERS, tensor_parallel_size=2)
    worker = llm.engine.runner.executor.workers[0]
    killed_at = []
    threading.Timer(1.0, lambda: (killed_at.append(time.monotonic()), worker.kill())).start()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(WorkerDiedError):
        llm.generate([REPEAT] * 4, long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 10
    llm.shutdown()


def test_a_draft_refused_under_tensor_parallelism_stops_the_workers(tiny):
    # Refused once the model is known, after the workers started: they stop with it.
    with pytest.raises(ValueError, match="fewer"):
        LLM(tiny, num_kv_blocks=16, speculative_config={**LAYERS, "num_layers": 2},
            tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()  # the next engine may start its ranks


@pytest.mark.parametrize("spec", [NGRAM, LAYERS], ids=["ngram", "draft_layers"])
def test_async_scheduling_keeps_greedy_tokens(tiny, reference, spec):
    """With async scheduling, steps of prompts alone stay in flight, and the step after one
    lands it before proposing; chunked prefill makes such steps common here."""
    llm, outs = generate(tiny, GREEDY, PROMPTS + [REPEAT], speculative_config=spec,
                         async_scheduling=True, max_num_batched_tokens=7)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("params", [
    SamplingParams(logprobs=2), SamplingParams(prompt_logprobs=1),
    SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
    SamplingParams(logit_bias={3: 1.0}), SamplingParams(min_tokens=2, max_tokens=4),
    SamplingParams(allowed_token_ids=[1, 2, 3]),
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
])
def test_unsupported_sampling_is_refused_at_submission(tiny, params):
    llm = LLM(tiny, num_kv_blocks=16, speculative_config=LAYERS)
    with pytest.raises(ValueError, match="speculative decoding"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# -- against transformers, and on the real model ---------------------------------------------
@pytest.fixture(scope="module")
def hf_reference(tiny):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    outputs = []
    for prompt in (PROMPTS[2], PROMPTS[5], REPEAT):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


@pytest.mark.parametrize("spec", [NGRAM, LAYERS], ids=["ngram", "draft_layers"])
@pytest.mark.assignment(*SPEC, "14.ngram_propose")
def test_greedy_matches_transformers(tiny, hf_reference, spec):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    _, outs = generate(tiny, params, [PROMPTS[2], PROMPTS[5], REPEAT], speculative_config=spec)
    assert [o.token_ids for o in outs] == hf_reference


SMOL_PROMPTS = ["The capital of France is"]


@pytest.mark.assignment(*SPEC)
def test_smollm2_self_speculation_is_exact_and_accepts(smollm2_dir):
    # SmolLM2 was not trained for early exit: its first 28 of 30 layers agree with the whole
    # model on about half of the tokens (chapter 14 measures it by position).
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(smollm2_dir, num_kv_blocks=64)
    reference = [o.token_ids for o in llm.generate(SMOL_PROMPTS, params, use_tqdm=False)]
    spec = {"method": "draft_layers", "num_layers": 28, "num_speculative_tokens": 3}
    llm = LLM(smollm2_dir, num_kv_blocks=64, speculative_config=spec)
    outs = llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference  # (test_parity: equal to transformers')
    stats = llm.engine.speculator.stats
    assert stats.acceptance_rate > 0.2


def test_the_benchmark_runs_on_a_cpu_with_tiny_sizes(tmp_path):
    import json

    from nanovllm.benchmarks import spec_decode

    out = tmp_path / "spec.json"
    spec_decode.main(["--tiny", "--batch-sizes", "1", "3", "--ks", "2", "--max-tokens", "8",
                      "--prompt-len", "8", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert {r["method"] for r in runs} == {"none (eager)", "ngram", "draft_layers", "draft_model"}
    assert all(r["output_tokens"] == 8 * r["batch"] for r in runs)
    assert all(r["acceptance"] > 0.5 for r in runs if r["k"])  # random weights repeat

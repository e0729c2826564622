"""A separate draft model (chapter 14 §4, ``engine/spec_decode/draft_model.py``): greedy output
identical to no speculation whatever the draft (the target itself, another random model, the
target's first layer as a model of its own), under chunked prefill and preemption; sampled
output in the target's distribution; the counters move; a draft of another vocabulary is
refused.

Every step runs the engine's KV invariant check (conftest's ``kv_leak_check``).
"""

from __future__ import annotations

import json

import pytest
import test_scheduler
import torch
from course_ids import ENGINE
from safetensors.torch import load_file, save_file
from test_scheduler import PROMPTS, make_tiny_llama, one_torch_thread  # noqa: F401
from test_spec_decode_sampler import ALPHA, SMALL_VOCAB, homogeneity, sample_positions
from test_tensor_parallel import ranks_deadline

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPEC = ENGINE + ("14.rejection_sample",)


def draft(folder, k: int = 3) -> dict:
    return {"model": str(folder), "num_speculative_tokens": k}


def first_layer_of(target, folder):
    """The target's first layer, final norm and LM head as a model folder of its own: the
    draft that ``{"method": "draft_layers", "num_layers": 1}`` runs inside the target."""
    weights = load_file(str(target / "model.safetensors"))
    folder.mkdir()
    save_file({n: t for n, t in weights.items() if ".layers." not in n or ".layers.0." in n},
              str(folder / "model.safetensors"))
    config = json.loads((target / "config.json").read_text()) | {"num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-model")
    target = make_tiny_llama(root / "target")
    return {"self": target, "other": make_tiny_llama(root / "other", seed=1),
            "first-layer": first_layer_of(target, root / "first-layer")}


def generate(path, prompts, params=GREEDY, **options):
    llm = LLM(path, num_kv_blocks=options.pop("num_kv_blocks", 128), **options)
    with ranks_deadline(llm):  # (tensor parallelism: a deadlock fails, not hangs)
        outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back, rejected slots included
    return llm, outs


@pytest.fixture(scope="module")
def reference(models):
    return [o.token_ids for o in generate(models["self"], PROMPTS)[1]]


@pytest.mark.parametrize(("name", "options"), [
    ("self", {}),
    ("other", {}),
    ("other", {"max_num_batched_tokens": 7}),  # chunked prefill next to verification
    ("other", {"num_kv_blocks": 12, "max_num_batched_tokens": 40}),  # preemption
], ids=["self", "other", "other-chunks-of-7", "other-preemption"])
@pytest.mark.assignment(*SPEC)
def test_greedy_equals_no_speculation(models, reference, name, options):
    llm, outs = generate(models["self"], PROMPTS, speculative_config=draft(models[name]),
                         **options)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    if name == "self":  # the target drafting for itself: every proposal is right
        assert stats.acceptance_rate == 1.0
    else:  # an unrelated random model: mostly wrong, and the output is the same
        assert stats.acceptance_rate < 0.5
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.assignment(*SPEC)
def test_the_first_layer_as_a_model_drafts_as_draft_layers_does(models, reference):
    # The same network, with its own cache instead of the target's: the same proposals.
    layers = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3}
    runs = [generate(models["self"], PROMPTS, speculative_config=spec)
            for spec in (draft(models["first-layer"]), layers)]
    for _, outs in runs:
        assert [o.token_ids for o in outs] == reference
    separate, inside = (llm.engine.speculator.stats for llm, _ in runs)
    assert separate.num_accepted_tokens_per_pos == inside.num_accepted_tokens_per_pos
    assert 0 < separate.acceptance_rate < 1


def test_random_weights_draft_for_themselves(models):
    # load_format="dummy" loads the draft as the target, from the same seed: the same model.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm, _ = generate(models["self"], PROMPTS[:2], params, load_format="dummy",
                      speculative_config=draft(models["other"]))
    assert llm.engine.speculator.stats.acceptance_rate == 1.0
    proposer = llm.engine.speculator.proposer
    llm.shutdown()  # the draft's weights and cache go with the target's
    assert not hasattr(proposer, "kv_cache") and not hasattr(proposer, "model")


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_scheduler, "VOCAB", SMALL_VOCAB)
        small = make_tiny_llama(tmp_path / "small-vocab")
    with pytest.raises(ValueError, match=f"{SMALL_VOCAB} tokens but the target has 49152"):
        LLM(models["self"], num_kv_blocks=16, speculative_config=draft(small))
    with pytest.raises(ValueError, match="belongs to 'draft_model'"):
        LLM(models["self"], num_kv_blocks=16, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "model": str(small)})


@pytest.mark.parametrize("name", ["self", "first-layer"])
@pytest.mark.assignment(*SPEC, "09.row_shard", "09.vocab_embed")
def test_under_tensor_parallelism_equals_one_rank(models, reference, name):
    """TP=2 on gloo: every rank holds a shard of the draft and of its cache; the workers
    follow its proposal passes and its replay of each verified step."""
    llm, outs = generate(models["self"], PROMPTS, speculative_config=draft(models[name]),
                         tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in outs] == reference
        stats = llm.engine.speculator.stats
        assert stats.num_accepted_tokens > 0
        if name == "self":  # the draft's shards compute what the target's do
            assert stats.acceptance_rate == 1.0
    finally:
        llm.shutdown()


def test_a_draft_that_does_not_shard_is_refused(models, tmp_path):
    # One KV head cannot be split over two ranks: refused before any worker starts.
    folder = tmp_path / "one-kv-head"
    folder.mkdir()
    config = json.loads((models["other"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 1}))
    with pytest.raises(ValueError, match="does not divide the draft model .*'s 1 KV heads"):
        LLM(models["self"], num_kv_blocks=16, speculative_config=draft(folder),
            tensor_parallel_size=2)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-vocab12")
    with pytest.MonkeyPatch.context() as patch:  # a 12-token vocabulary: cells fill up
        patch.setattr(test_scheduler, "VOCAB", SMALL_VOCAB)
        return make_tiny_llama(root / "target", seed=3), make_tiny_llama(root / "draft", seed=4)


@pytest.mark.assignment(*ENGINE, "01.filter_logits", "14.rejection_sample")
def test_sampled_tokens_keep_the_distribution_per_position(small_vocab_pair):
    # The draft samples from its own distribution q != p: the residual path is exercised.
    target, other = small_vocab_pair
    plain = sample_positions(target, None, seed=11, n=600)
    speculative = sample_positions(target, draft(other), seed=12, n=600)
    for position in range(plain.shape[1]):
        p_value = homogeneity(plain[:, position], speculative[:, position], SMALL_VOCAB)
        assert p_value > ALPHA, f"position {position}: p = {p_value:.2e}"
    assert not torch.equal(plain, speculative)  # two seeds: two samples, not one twice

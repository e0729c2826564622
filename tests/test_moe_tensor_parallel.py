"""Tensor parallelism for MoE on CPU (gloo), chapter 16 §8: every rank holds every expert's
slice of the intermediate dimension, so two ranks give the greedy tokens of one (and of
transformers), from a checkpoint's per-expert tensors and from random (dummy) weights."""

from __future__ import annotations

import pytest
from course_ids import ENGINE
from test_moe_models import hf_greedy, tiny_moe_model
from test_tensor_parallel import tokens

TP = (*ENGINE, "09.row_shard", "09.vocab_embed", "16.route")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, list(range(10, 50))]


@pytest.fixture(scope="module", params=["qwen3moe", "mixtral"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    return str(path), tiny_moe_model(request.param, path)


@pytest.mark.assignment(*TP)
def test_tp2_equals_tp1_and_transformers(tiny):
    path, hf = tiny
    one = tokens(path, PROMPTS)
    assert tokens(path, PROMPTS, tensor_parallel_size=2) == one
    assert one == hf_greedy(hf, PROMPTS, 16)


@pytest.mark.assignment(*TP)
def test_dummy_weights_are_the_same_model_at_every_size(tiny):
    path, _ = tiny
    options = dict(load_format="dummy", seed=3)
    assert tokens(path, PROMPTS, tensor_parallel_size=2, **options) == tokens(path, PROMPTS,
                                                                              **options)

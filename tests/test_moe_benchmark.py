"""The MoE benchmark (``nanovllm/benchmarks/moe.py``) at tiny sizes on CPU: every method of the
layer section agrees with the per-expert loop and reports consistent rates; the workload section
runs a tiny dummy-weight MoE model (with the transformers peer) and counts every assignment in
its expert load; the MoE bandwidth bound reads every expert for a large batch and ``k`` for one
token."""

from __future__ import annotations

import json

import pytest
import torch
from course_ids import ENGINE

from nanovllm.benchmarks import moe
from nanovllm.benchmarks.workload import Workload
from nanovllm.models import ModelConfig

TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 10240, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "norm_topk_prob": True, "max_position_embeddings": 512, "tie_word_embeddings": True}


@pytest.fixture
def tiny_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


@pytest.mark.assignment("16.route", "16.align")  # routed inputs; the fused kernel aligns
def test_layer_section_at_tiny_sizes(tiny_folder, tmp_path):
    out = tmp_path / "layer.json"
    record = moe.main(["layer", "--model", str(tiny_folder), "--device", "cpu",
                       "--tokens", "1", "9", "--reps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == record["rows"]
    methods = {r["method"] for r in record["rows"]}
    assert {"loop", "grouped", "fused"} <= methods  # fused: the interpreter (conftest)
    for row in record["rows"]:
        assert row["max_abs_diff_vs_loop"] <= 1e-4
        assert row["bytes_per_s"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["flops"] == 2 * row["tokens"] * 2 * 3 * 32 * 16
        assert 1 <= row["experts_touched"] <= min(8, 2 * row["tokens"])


@pytest.mark.assignment(*ENGINE, "16.route")
def test_workload_section_with_the_peer(tiny_folder, monkeypatch):
    from nanovllm.benchmarks import workload

    monkeypatch.setattr(workload, "warm_up", lambda *args, **kwargs: None)  # (compiles nothing)
    prompts = [[5, 6, 7, 8] * 3, list(range(100, 120))]
    work = Workload(prompts, [6, 4])
    record = moe.workload_benchmark(str(tiny_folder), "dummy", work, device="cpu")
    assert record["output_tokens"] == 10 and record["tok_s"] > 0
    assert [sum(c) for c in record["expert_load"]] == [2 * 32] * 2  # every prompt token, k=2
    assert record["max_over_mean"] >= 1
    peer = moe.peer_run(str(tiny_folder), "dummy", work, 1, device="cpu")
    assert peer["hf_tok_s"] > 0 and peer["nanovllm_tok_s"] > 0, peer


def test_bound_reads_all_experts_only_for_large_batches(tiny_folder):
    cfg = ModelConfig.from_pretrained(tiny_folder)
    one = Workload([[1]], [4])
    big = Workload([[1]] * 256, [4] * 256)
    _, w1 = moe.moe_bound_bytes(one, cfg, 1000, 10, 2)
    _, w256 = moe.moe_bound_bytes(big, cfg, 1000, 10, 2)
    assert w1 == pytest.approx(4 * (1000 + 2 * 10))  # k = 2 experts per step
    assert w256 == pytest.approx(4 * (1000 + 8 * 10))  # every expert


@pytest.mark.assignment("16.route")
def test_grouped_mm_path_matches_the_loop():
    if moe.GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 32, generator=gen)
    w13, w2 = torch.randn(4, 48, 32, generator=gen), torch.randn(4, 32, 24, generator=gen)
    weights, ids = moe.route(torch.randn(11, 4, generator=gen), 2, False)
    torch.testing.assert_close(moe.moe_grouped_mm(x, w13, w2, weights, ids),
                               moe.moe_reference(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)

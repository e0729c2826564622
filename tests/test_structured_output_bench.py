"""The structured-output benchmark's CPU path (chapter 15): ``--quick`` with tiny sizes
records the mask cost per batch size and the throughput with and without constrained
requests (SmolLM2's shape, dummy weights, SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest
from test_scheduler import one_torch_thread  # noqa: F401

pytest.importorskip("xgrammar")


def test_quick_cpu_run_records_mask_cost_and_throughput(tmp_path, smollm2_dir):
    from nanovllm.benchmarks import structured_output

    out = tmp_path / "so.json"
    structured_output.main(["--device", "cpu", "--quick", "--tokenizer", str(smollm2_dir),
                            "--batch-sizes", "1", "3", "--num-requests", "2",
                            "--max-tokens", "3", "--skip-overlap", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["config"] == "smollm2-135m" and result["workload"] == "cpu"
    assert [r["batch_size"] for r in result["mask_cost"]] == [1, 3]
    for row in result["mask_cost"]:
        assert row["fill_ms"] > 0 and row["apply_ms"] > 0 and row["vocab_size"] == 49152
    runs = result["throughput"]
    assert [r["constrained_requests"] for r in runs] == [0, 2]
    assert runs[0]["output_tokens"] == 6  # unconstrained: every request to its length
    assert all(r["output_tok_s"] > 0 and r["requests"] == 2 for r in runs)

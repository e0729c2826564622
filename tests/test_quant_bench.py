"""``nanovllm.benchmarks.quantization`` (chapter 08's speed and memory tool) runs end to end on CPU.

The real measurements need an H200 (``tests/gpu/h200_session.sh quant``); here the tool runs
in-process on a tiny random Qwen3 with the CPU sizes (a few seconds) and the JSON it writes
is checked for the schema chapter 08 reads: keys and types, not the numbers (CPU timings
mean nothing for a GPU tool).
"""

from __future__ import annotations

import json

import pytest

from nanovllm.benchmarks.gemm import layer_gemms
from nanovllm.benchmarks.quantization import main, split_variant
from nanovllm.configs import config_path
from nanovllm.models import ModelConfig

TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 10240,  # the workloads' ids < 10001
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
}


def test_cpu_smoke_run_writes_the_schema(tmp_path, capsys):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "quant.json"
    main(["--device", "cpu", "--quick", "--in-process", "--shapes", str(folder),
          "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "[5/5] engine tiny fp8+fp8kv done" in printed and "KV blocks fp8 / auto" in printed

    for key in ("device", "date", "command", "torch", "triton"):
        assert isinstance(result[key], str), key
    assert result["command"].startswith("python -m nanovllm.benchmarks.quantization --device cpu")
    assert "--out" not in result["command"]  # where it was written is not part of the record
    assert result["errors"] == []
    assert set(result["weight_bytes"]["tiny"]) == {"bf16", "int8", "fp8"}
    assert all(isinstance(v, int) for v in result["weight_bytes"]["tiny"].values())
    assert set(result["kv_blocks"]["tiny"]) == {"auto", "fp8"}
    assert all(isinstance(v, int) for v in result["kv_blocks"]["tiny"].values())
    steps = result["decode_step_ms"]["tiny"]
    assert set(steps) == {"bf16", "int8", "fp8", "fp8+fp8kv"}
    assert all(set(v) == {"1", "4"} and all(isinstance(ms, float) for ms in v.values())
               for v in steps.values())
    assert set(result["bench_tok_s"]["tiny"]) == {"bf16", "int8", "fp8", "fp8+fp8kv"}
    assert all(isinstance(v, float) for v in result["bench_tok_s"]["tiny"].values())
    assert isinstance(result["bench_requests"]["tiny"], int)
    gemm = result["gemm"]["tiny"]
    assert len(gemm) == 4 * 2  # four layers x rows (1, 8)
    for row in gemm:
        assert set(row) == {"layer", "m", "n", "k", "bf16_us", "int8_us", "fp8_us"}
        assert all(isinstance(row[k], int) for k in ("m", "n", "k"))
        assert all(isinstance(row[k], float) for k in ("bf16_us", "int8_us", "fp8_us"))


def test_layer_gemms_of_qwen3_8b():
    cfg = ModelConfig.from_pretrained(config_path("qwen3-8b"))
    assert layer_gemms(cfg) == [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096),
                                ("gate_up_proj", 24576, 4096), ("down_proj", 4096, 12288)]


def test_variants():
    assert split_variant("bf16") == ("bf16", None, "auto")
    assert split_variant("int8+fp8kv") == ("int8", "int8", "fp8")
    for bad in ("int4", "fp8+kv", "bf16+fp8kv+x"):
        with pytest.raises(ValueError, match="unknown variant"):
            split_variant(bad)

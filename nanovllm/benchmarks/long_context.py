"""Perplexity by position past a model's trained length, with and without RoPE scaling.

Chapter 12 plots it. One long window of the shipped public-domain text (Alice in Wonderland,
chapters I-V: ``nanovllm/data``) is scored by the engine as one prompt (prompt logprobs,
fp32, chunked prefill); each token's negative log-likelihood is kept, then averaged in bins
of positions. Only the ``rope_scaling`` of the model folder differs between variants.

    python -m nanovllm.benchmarks.long_context --tokens 10240 \\
        --out figures/data/12_long_context_cpu.json

Variants (SmolLM2-135M, trained length 8,192 in its ``config.json``; factor 2): no scaling,
linear, dynamic NTK (the engine's fixed frequencies of its maximum length, 16,384) and YaRN.
A 10,240-token window costs minutes per variant on a 2-core CPU, seconds on a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.benchmarks.timing import stopwatch
from nanovllm.models import ModelConfig

DATA = Path(__file__).parents[1] / "data"
TEXTS = ("alice_in_wonderland_ch1-2.txt", "alice_in_wonderland_ch3-5.txt")


def variants(trained_length: int, factor: float = 2.0) -> dict[str, dict | None]:
    """The ``rope_scaling`` of each variant measured, for a model trained on ``trained_length``."""
    return {
        "no scaling": None,
        "linear": {"rope_type": "linear", "factor": factor},
        "dynamic NTK": {"rope_type": "dynamic", "factor": factor},
        "YaRN": {"rope_type": "yarn", "factor": factor,
                 "original_max_position_embeddings": trained_length},
    }


def shipped_text() -> str:
    """Chapters I-V of Alice in Wonderland, as shipped (15,701 SmolLM2 tokens)."""
    return "\n".join((DATA / name).read_text() for name in TEXTS)


def scaled_model_dir(
    path: str | Path, scaling: dict | None, length: int, into: str | Path
) -> Path:
    """A model folder in ``into``: ``path``'s files (linked), its ``config.json`` with
    ``rope_scaling`` replaced by ``scaling``. ``None``: no scaling, with the position limit
    raised to ``length`` (plain RoPE extrapolated past the trained length)."""
    path, into = Path(path), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for file in path.iterdir():
        if file.name != "config.json" and not (into / file.name).exists():
            (into / file.name).symlink_to(file.resolve())
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_scaling", None)
    rope = raw.get("rope_parameters") or {}
    raw["rope_parameters"] = {"rope_theta": rope.get("rope_theta", raw.get("rope_theta", 1e4)),
                              "rope_type": "default"}
    if scaling is None:
        raw["max_position_embeddings"] = max(raw["max_position_embeddings"], length)
    else:
        raw["rope_scaling"] = scaling
    (into / "config.json").write_text(json.dumps(raw, indent=1))
    return into


def token_nll(model_dir: str | Path, ids: list[int], device: str | None = None) -> torch.Tensor:
    """Negative log-likelihood of tokens 1.. of ``ids`` given the ones before: ``[len - 1]``.

    The engine scores the text as one prompt (``prompt_logprobs=0``), in fp32, prefilled in
    chunks of 512 tokens, so no ``[len, len]`` score matrix or ``[len, vocab]`` logits ever
    exist at once."""
    from nanovllm import LLM, SamplingParams

    block = 16
    llm = LLM(model_dir, dtype="float32", max_model_len=len(ids) + 1, block_size=block,
              max_num_batched_tokens=512, enable_prefix_caching=False,
              num_kv_blocks=len(ids) // block + 2, **({"device": device} if device else {}))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    return torch.tensor([-pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])])


def binned_perplexity(nll: torch.Tensor, bin_size: int) -> list[float]:
    """exp(mean NLL) of each run of ``bin_size`` predicted tokens (the last may be shorter)."""
    starts = range(0, len(nll), bin_size)
    return [float(nll[i : i + bin_size].double().mean().exp()) for i in starts]


def text_ids(path: str | Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(shipped_text()).ids


def measure(path: str | Path, tokens: int, bin_size: int, device: str = "cpu") -> dict:
    """Each variant's perplexity by bin of ``bin_size`` positions over the first ``tokens``
    tokens of the shipped text, and the seconds it took."""
    ids = text_ids(path)
    if len(ids) < tokens:
        raise ValueError(f"the shipped text has {len(ids)} tokens, fewer than {tokens}")
    ids = ids[:tokens]
    trained = ModelConfig.from_pretrained(path).max_position_embeddings
    result = {"tokens": tokens, "bin_size": bin_size, "trained_length": trained, "variants": {}}
    work = Path(tempfile.mkdtemp(prefix="nanovllm_long_context_"))
    for i, (name, scaling) in enumerate(variants(trained).items()):
        with stopwatch(device) as watch:
            folder = scaled_model_dir(path, scaling, tokens + 1, work / str(i))  # + 1 generated
            nll = token_nll(folder, ids, device)
        result["variants"][name] = {"rope_scaling": scaling,
                                    "perplexity_by_bin": binned_perplexity(nll, bin_size),
                                    "seconds": round(watch.seconds, 1)}
        print(f"{name}: {result['variants'][name]['seconds']} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    from nanovllm import smollm2_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=10240)
    parser.add_argument("--bin-size", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = {**run_metadata("nanovllm.benchmarks.long_context", argv, args.device),
              **measure(args.model or smollm2_path(), args.tokens, args.bin_size, args.device)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""How much accuracy quantization costs: a short table (chapter 08; CPU or GPU).

    python -m nanovllm.benchmarks.quant_eval        # SmolLM2: int8, fp8, fp8 KV, int8 + fp8 KV
    python -m nanovllm.benchmarks.quant_eval --variants int8 fp8 --text some.txt --json out.json

The texts: by default the public-domain text the package ships (``nanovllm/data/``, chapters
I-II of *Alice's Adventures in Wonderland*, ~6,100 SmolLM2 tokens; its README gives source
and licence), cut into pieces of about ``--chunk`` characters at paragraph breaks;
``--text`` scores another file, ``--builtin-texts`` four short prompts instead.

Each *variant* (``int8``, ``fp8``, ``kv-fp8``, or weights and KV together as ``int8+kv-fp8``)
is compared with the unquantized engine of the same model, device and dtype:

- per-layer SQNR (dB): every linear layer's output on its real input (recorded from the
  unquantized model on the first text), exact vs quantized, ``10 log10(|y|^2 / |y - yq|^2)``;
  each layer's own error, before any accumulation (min and median over layers);
- logit KL(ref || variant) in nats (mean over positions) and top-1 agreement, the model run
  without a KV cache on every text (so ``kv-fp8`` shows no change here: see perplexity);
- perplexity through the engine (``nanovllm.evaluate.perplexity``, prompt logprobs: prefill
  reads the KV cache, so fp8 KV counts);
- greedy agreement (``nanovllm.evaluate.greedy_agreement``) of ``--max-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.context import attention_metadata
from nanovllm.evaluate import greedy_agreement, perplexity
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization import get_linear_method

SHIPPED_TEXT = Path(__file__).parents[1] / "data" / "alice_in_wonderland_ch1-2.txt"
TEXTS = [  # a few kinds of text (--builtin-texts)
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the "
    "Louvre, and its cafes along the river Seine.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
    "wife. Every morning he rowed out before dawn.",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the air pressure "
    "is lower, so it boils at a lower temperature.",
]


def text_chunks(body: str, chunk: int) -> list[str]:
    """``body`` in pieces of about ``chunk`` characters, cut between paragraphs (a paragraph
    longer than ``chunk`` is a piece of its own)."""
    pieces, current = [], ""
    for paragraph in body.split("\n\n"):
        if current and len(current) + len(paragraph) + 2 > chunk:
            pieces.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    return [p for p in pieces + [current] if p.strip()]


def split_variant(variant: str) -> tuple[str | None, str]:
    """``"int8+kv-fp8"`` -> (``"int8"``, ``"fp8"``); ``"kv-fp8"`` -> (None, ``"fp8"``)."""
    weights, kv = None, "auto"
    for part in variant.split("+"):
        if part == "kv-fp8":
            kv = "fp8"
        elif part in ("int8", "fp8"):
            weights = part
        else:
            raise ValueError(f"unknown variant part {part!r}: use int8, fp8, kv-fp8, joined by +")
    return weights, kv


def make_engine(model: str, device: str, dtype: str, variant: str | None) -> LLM:
    quantization, kv = split_variant(variant) if variant else (None, "auto")
    # A fixed KV budget: several engines live in one process, and on a GPU the default would
    # give the first 90% of the free memory. 4,096 blocks of 16 hold far more than the texts.
    return LLM(model, device=device, dtype=dtype, quantization=quantization,
               kv_cache_dtype=kv, enable_prefix_caching=False, num_kv_blocks=4096)


@torch.inference_mode()
def position_logits(llm: LLM, ids: list[list[int]]) -> list[torch.Tensor]:
    """The logits at every position of each text (the model run without a KV cache), one
    ``[len, vocab]`` tensor per text, on the CPU in the model's dtype. (Kept per text and not
    widened: 6,000 positions x SmolLM2's 49,152 logits are 1.2 GB in fp32, 2.4 in fp64.)"""
    model, device = llm.engine.runner.model, llm.engine.runner.device
    rows = []
    with attention_metadata(None):
        for seq in ids:
            t = torch.tensor(seq, device=device)
            rows.append(model.compute_logits(model(t, torch.arange(len(t), device=device))).cpu())
    return rows


@torch.inference_mode()
def layer_inputs(llm: LLM, ids: list[int]) -> dict[str, tuple[LinearBase, torch.Tensor]]:
    """Every linear layer of the (unquantized) model, with its input on ``ids``."""
    model, captured, hooks = llm.engine.runner.model, {}, []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            hook = lambda mod, args, name=name: captured.__setitem__(name, (mod, args[0]))  # noqa: E731
            hooks.append(module.register_forward_pre_hook(hook))
    position_logits(llm, [ids])
    for hook in hooks:
        hook.remove()
    return captured


@torch.inference_mode()
def layer_sqnr(inputs: dict, method: str) -> list[float]:
    """Output SQNR in dB of each linear layer quantized with ``method``, on its real input."""
    linear_method, values = get_linear_method(method), []
    for layer, x in inputs.values():
        exact = F.linear(x, layer.weight).double()
        copy = SimpleNamespace(weight=layer.weight.detach().clone())
        linear_method.process_weights_after_loading(copy)
        noise = (linear_method.apply(copy, x).double() - exact).pow(2).sum()
        values.append(10 * math.log10(exact.pow(2).sum() / noise.clamp(min=1e-30)))
    return values


def kl_and_top1(logits: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """Mean KL(ref || logits) in nats and top-1 agreement over all positions of all texts
    (float64, one text at a time)."""
    kl_sum, same, positions = 0.0, 0, 0
    for lq, lr in zip(logits, ref):
        lq, lr = lq.double(), lr.double()
        kl = F.kl_div(lq.log_softmax(-1), lr.log_softmax(-1), log_target=True, reduction="none")
        kl_sum += kl.sum().item()
        same += (lq.argmax(-1) == lr.argmax(-1)).sum().item()
        positions += len(lq)
    return kl_sum / positions, same / positions


def evaluate(model: str, variants: list[str], texts: list[str | list[int]], device: str,
             dtype: str, max_tokens: int) -> list[dict]:
    """One row per variant (the first row is the unquantized reference); ``texts`` are
    strings or token-id lists."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = make_engine(model, device, dtype, None)
    ids = [ref.tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
    ref_logits = position_logits(ref, ids)
    ref_out = ref.generate(ids, greedy, use_tqdm=False)
    inputs = layer_inputs(ref, ids[0])
    rows = [{"variant": "none", "perplexity": perplexity(ref, ids).perplexity}]
    del ref
    for variant in variants:
        weights, _ = split_variant(variant)
        llm = make_engine(model, device, dtype, variant)
        kl, top1 = kl_and_top1(position_logits(llm, ids), ref_logits)
        agreement = greedy_agreement(ref_out, llm.generate(ids, greedy, use_tqdm=False))
        row = {"variant": variant, "perplexity": perplexity(llm, ids).perplexity,
               "kl": kl, "top1": top1, "greedy_token_agreement": agreement.token_agreement}
        if weights is not None:
            sqnr = layer_sqnr(inputs, weights)
            row.update(sqnr_min=min(sqnr), sqnr_median=statistics.median(sqnr))
        rows.append(row)
        del llm
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'variant':<12} {'SQNR min/med dB':>16} {'KL nats':>9} {'top-1':>6} " \
           f"{'greedy':>6} {'ppl':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        sqnr = f"{r['sqnr_min']:.1f} / {r['sqnr_median']:.1f}" if "sqnr_min" in r else "-"
        kl = f"{r['kl']:.2e}" if "kl" in r else "-"
        top1 = f"{r['top1']:.3f}" if "top1" in r else "-"
        agree = f"{r['greedy_token_agreement']:.3f}" if "kl" in r else "-"
        lines.append(f"{r['variant']:<12} {sqnr:>16} {kl:>9} {top1:>6} {agree:>6} "
                     f"{r['perplexity']:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--variants", nargs="+", default=["int8", "fp8", "kv-fp8", "int8+kv-fp8"])
    parser.add_argument("--text", default=str(SHIPPED_TEXT),
                        help="a text file, scored in pieces of about --chunk characters "
                             "(default: the shipped public-domain text)")
    parser.add_argument("--builtin-texts", action="store_true",
                        help="score the four short built-in prompts instead of --text")
    parser.add_argument("--chunk", type=int, default=2000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="also write the rows (and the settings) here")
    args = parser.parse_args(argv)
    if args.model is None:
        from nanovllm.weights.smollm2 import smollm2_path

        args.model = str(smollm2_path())
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    texts = TEXTS
    if not args.builtin_texts:
        texts = text_chunks(Path(args.text).read_text(encoding="utf-8"), args.chunk)
    rows = evaluate(args.model, args.variants, texts, args.device, dtype, args.max_tokens)
    meta = run_metadata("nanovllm.benchmarks.quant_eval", argv, args.device)
    print(f"{args.model} on {meta['device']} ({dtype}), {len(texts)} texts")
    print(format_table(rows))
    if args.json:
        settings = {**vars(args), "dtype": dtype, "device_name": meta["device"]}
        record = {**meta, "texts": len(texts), "settings": settings, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

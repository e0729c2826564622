"""Speed and memory of quantization, one JSON file (chapter 08; GPU, or a CPU smoke test).

    python -m nanovllm.benchmarks.quantization --out quant_h200.json   # all (H200: < 8 min)
    python -m nanovllm.benchmarks.quantization --shapes qwen3-0.6b --variants bf16 int8 --quick
    python -m nanovllm.benchmarks.quantization --sweep-int8            # int8 GEMM tiles, printed
    python -m nanovllm.benchmarks.quantization --device cpu --quick --shapes MODEL_FOLDER  # smoke

Shapes: shipped configs with random weights (``qwen3-0.6b``, ``qwen3-8b``) or a model folder.
Variants: ``bf16`` (the model's dtype, fp32 on a CPU), ``int8`` (W8A16), ``fp8`` (W8A8), and
any of them with ``+fp8kv`` (an e4m3 KV cache). Each engine runs in a fresh subprocess, so
every one starts from an empty GPU (``--in-process`` runs them in this process, freed in
between). The JSON (``--out``) holds, besides device, date, command and versions:

- ``weight_bytes`` {shape: {bf16, int8, fp8}}: bytes of the linear layers (codes, scales) and
  of the embedding and LM head, as the engine holds them after loading;
- ``kv_blocks`` {shape: {auto, fp8}}: KV-cache blocks the engine sized at the same
  ``gpu_memory_utilization``, with the same weights (``kv_blocks_weights``: which ones);
- ``decode_step_ms`` {shape: {variant: {batch: ms}}}: one engine decode step
  (``decode_step.py``) at context 1024, CUDA graphs on, batches 1, 64, 256;
- ``gemm`` {shape: [{layer, m, n, k, bf16_us, int8_us, fp8_us}]}: each linear layer's matmul
  alone (fp8: with the activations' quantization), CUDA events around each call with the L2
  flushed before it, median of ``--gemm-reps``;
- ``bench_tok_s`` {shape: {variant: tok/s}}: the nano-vllm workload (``workload.py``, default
  engine settings), ``bench_requests`` requests per shape (fewer on qwen3-8b, to keep the
  whole run under ~8 minutes);
- ``engines`` (per engine: blocks, timings, settings) and ``errors`` (items that failed).

``--sweep-int8`` instead times a grid of tile configurations of the int8 GEMM
(``nanovllm/kernels/int8_gemm.py``) on every layer shape and prints the best beside the one
``pick_config`` chooses, so the tiles can be tuned from one run. The GEMM timing and the sweep
live in ``gemm.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanovllm.benchmarks.gemm import SWEEP_ROWS, measure_gemms, sweep_int8
from nanovllm.benchmarks.metadata import device_name, run_metadata
from nanovllm.configs import SHIPPED, config_path
from nanovllm.models import ModelConfig

SHAPES = ("qwen3-0.6b", "qwen3-8b")
VARIANTS = ("bf16", "int8", "fp8", "fp8+fp8kv")
WEIGHTS = ("bf16", "int8", "fp8")
# nano-vllm's workload is 256 requests. On Qwen3-8B half of it, so that its four engines fit
# the ~8 minute budget with the rest (an estimate until the first H200 run times it).
REQUESTS = {"qwen3-8b": 128}
SIZES = {  # batches, context, decode iters, GEMM rows, GEMM reps, requests (None: REQUESTS)
    "full": dict(batches=[1, 64, 256], context=1024, iters=30,
                 gemm_rows=[1, 16, 64, 256, 1024, 4096], gemm_reps=50, requests=None),
    "quick": dict(batches=[1, 64, 256], context=1024, iters=10, gemm_rows=[1, 64, 4096],
                  gemm_reps=20, requests=32),
    "cpu": dict(batches=[1, 4], context=32, iters=3, gemm_rows=[1, 8], gemm_reps=5,
                requests=2),
}
CPU_KV_BYTES = 16 << 20  # the CPU smoke test's KV budget (the engine's CPU default: 1 GiB)
ITEM_TIMEOUT_S = {"qwen3-8b": 420}  # per subprocess; others 240


# ----------------------------------------------------------------------------- engines


def model_folder(shape: str) -> str:
    return str(config_path(shape)) if shape in SHIPPED else shape


def shape_key(shape: str) -> str:
    return shape if shape in SHIPPED else Path(shape).name


def split_variant(variant: str) -> tuple[str, str | None, str]:
    """``"fp8+fp8kv"`` -> (weights ``"fp8"``, quantization ``"fp8"``, kv_cache_dtype ``"fp8"``)."""
    weights, _, kv = variant.partition("+")
    if weights not in WEIGHTS or kv not in ("", "fp8kv"):
        raise ValueError(f"unknown variant {variant!r}: one of {WEIGHTS}, optionally +fp8kv")
    return weights, None if weights == "bf16" else weights, "fp8" if kv else "auto"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear layers (codes, scales, biases), the embedding and the LM head."""
    from nanovllm.layers.embed_head import VocabParallelEmbedding
    from nanovllm.layers.linear import LinearBase

    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, LinearBase | VocabParallelEmbedding):
            for p in module.parameters(recurse=False):
                if p.data_ptr() not in seen:  # a tied LM head is the embedding
                    seen.add(p.data_ptr())
                    total += p.numel() * p.element_size()
    return total


def bench_workload(settings: dict, shape: str):
    from nanovllm.benchmarks.workload import Workload, make_workload

    if settings["device"] == "cpu":  # a smoke test: few, short requests
        work = make_workload("cpu", settings["requests"])
        return Workload([p[:32] for p in work.prompts], [min(n, 8) for n in work.output_lens])
    n = settings["num_requests"] or settings["requests"] or REQUESTS.get(shape, 256)
    return make_workload("nano-vllm", n)


def measure_engine(shape: str, variant: str, settings: dict) -> dict:
    """Build one engine; its weight bytes, KV blocks, decode steps and workload tok/s."""
    from nanovllm import LLM
    from nanovllm.benchmarks.decode_step import decode_step_benchmark
    from nanovllm.benchmarks.workload import free, time_workload

    _, quantization, kv = split_variant(variant)
    options = dict(device=settings["device"], quantization=quantization, kv_cache_dtype=kv,
                   gpu_memory_utilization=settings["gpu_memory_utilization"])
    if settings["device"] == "cpu":
        options["kv_cache_memory"] = CPU_KV_BYTES
    start = time.perf_counter()
    llm = LLM(model_folder(shape), load_format="dummy", **options)
    runner = llm.engine.runner
    row = {"variant": variant, "weight_bytes": weight_bytes(runner.model),
           "num_kv_blocks": runner.num_kv_blocks, "kv_cache_dtype": str(runner.kv_dtype),
           "attention_backend": runner.backend.name, "cuda_graphs": runner.graphs is not None,
           "startup_s": time.perf_counter() - start, "errors": []}
    try:
        work = bench_workload(settings, shape)
        seconds = time_workload(llm, work)
        row.update(bench_seconds=seconds, bench_requests=len(work.prompts),
                   bench_output_tokens=work.output_tokens,
                   bench_tok_s=work.output_tokens / seconds, **llm.engine.stats.summary())
    except Exception as err:  # keep the other measurements
        row["errors"].append(f"bench: {err!r}")
    try:
        steps = decode_step_benchmark(llm, settings["batches"], settings["context"],
                                      settings["iters"], modes=("graphs",), unfused=False)
        row["decode_step_ms"] = {str(r["batch"]): r["graphs_ms"] for r in steps}
    except Exception as err:
        row["errors"].append(f"decode_step: {err!r}")
    free(llm)
    return row


# ----------------------------------------------------------------------------- the run


def run_item(item: tuple, settings: dict) -> dict | list:
    """One measurement: ("engine", shape, variant) or ("gemm", shape)."""
    if item[0] == "engine":
        return measure_engine(item[1], item[2], settings)
    return measure_gemms(ModelConfig.from_pretrained(model_folder(item[1])), settings)


def run_in_subprocess(item: tuple, settings: dict) -> tuple[dict | list, str]:
    """``run_item`` in a fresh process: (its measurements, the device's name)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "item.json"
        cmd = [sys.executable, "-m", "nanovllm.benchmarks.quantization", "--worker",
               json.dumps({"item": item, "settings": settings}), "--worker-out", str(out)]
        timeout = ITEM_TIMEOUT_S.get(item[1], 240)
        try:
            proc = subprocess.run(cmd, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"timed out after {timeout} s") from err
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"worker exited with {proc.returncode}")
        job = json.loads(out.read_text())
        return job["value"], job["device"]


def collect(result: dict, item: tuple, value) -> None:
    """Put one item's measurements where the schema wants them."""
    key = shape_key(item[1])
    if item[0] == "gemm":
        result["gemm"][key] = value
        return
    variant = item[2]
    weights, _, kv = split_variant(variant)
    result["engines"].setdefault(key, {})[variant] = value
    result["errors"] += [{"item": list(item), "error": e} for e in value["errors"]]
    if kv == "auto":
        result["weight_bytes"].setdefault(key, {})[weights] = value["weight_bytes"]
    if "decode_step_ms" in value:
        result["decode_step_ms"].setdefault(key, {})[variant] = value["decode_step_ms"]
    if "bench_tok_s" in value:
        result["bench_tok_s"].setdefault(key, {})[variant] = value["bench_tok_s"]
        result["bench_requests"][key] = value["bench_requests"]
        result["bench_output_tokens"][key] = value["bench_output_tokens"]
    engines = result["engines"][key]
    for w in WEIGHTS:  # the first weights measured with both KV dtypes
        if w in engines and f"{w}+fp8kv" in engines:
            result["kv_blocks"][key] = {"auto": engines[w]["num_kv_blocks"],
                                        "fp8": engines[f"{w}+fp8kv"]["num_kv_blocks"]}
            result["kv_blocks_weights"][key] = w
            break


def header(argv: list[str], settings: dict, in_process: bool = True) -> dict:
    on_gpu = settings["device"].startswith("cuda")
    meta = run_metadata("nanovllm.benchmarks.quantization", argv, settings["device"],
                        device_label="" if on_gpu and not in_process else None)
    return {
        **meta,
        # (a GPU's name then comes from the first worker: CUDA here would hold memory)
        "device": meta["device"] or None,
        "dtype": "bfloat16" if on_gpu else "float32",
        "settings": settings,
        "weight_bytes": {}, "kv_blocks": {}, "kv_blocks_weights": {}, "decode_step_ms": {},
        "gemm": {}, "bench_tok_s": {}, "bench_requests": {}, "bench_output_tokens": {},
        "engines": {}, "errors": [],
    }


def run(argv: list[str], args: argparse.Namespace) -> dict:
    settings = {"device": args.device, "size": args.size, "num_requests": args.num_requests,
                "gpu_memory_utilization": args.gpu_memory_utilization, **SIZES[args.size]}
    if args.gemm_reps:
        settings["gemm_reps"] = args.gemm_reps
    result = header(argv, settings, args.in_process)
    items = [("gemm", shape) for shape in args.shapes] if args.gemm else []
    items += [("engine", shape, v) for shape in args.shapes for v in args.variants]
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        label = " ".join(shape_key(x) if j == 1 else x for j, x in enumerate(item))
        print(f"[{i}/{len(items)}] {label} ...", flush=True)
        t0 = time.perf_counter()
        try:
            if args.in_process:
                value = run_item(item, settings)
            else:
                value, result["device"] = run_in_subprocess(item, settings)
        except Exception as err:
            result["errors"].append({"item": list(item), "error": repr(err)})
            print(f"[{i}/{len(items)}] {label} FAILED: {err!r}", flush=True)
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        collect(result, item, value)
        result["seconds"] = time.perf_counter() - start
        if args.out:  # after every item: a later failure keeps what was measured
            args.out.write_text(json.dumps(result, indent=1))
        print(f"[{i}/{len(items)}] {label} done in {time.perf_counter() - t0:.0f} s", flush=True)
    result["seconds"] = time.perf_counter() - start
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    lines = []
    for shape, engines in result["engines"].items():
        batches = next((list(e["decode_step_ms"]) for e in engines.values()
                        if "decode_step_ms" in e), [])
        lines.append(f"{shape}: {result['bench_requests'].get(shape, '-')} requests, "
                     f"{result['dtype']}")
        steps = "/".join(batches)
        lines.append(f"  {'variant':<11} {'weights MB':>10} {'KV blocks':>9} "
                     f"{'step ms @ ' + steps:>24} {'tok/s':>8}")
        for variant, e in engines.items():
            ms = "/".join(f"{e['decode_step_ms'][b]:.2f}" for b in batches) \
                if "decode_step_ms" in e else "-"
            tok_s = f"{e['bench_tok_s']:.0f}" if "bench_tok_s" in e else "-"
            lines.append(f"  {variant:<11} {e['weight_bytes'] / 1e6:>10.1f} "
                         f"{e['num_kv_blocks']:>9} {ms:>24} {tok_s:>8}")
        lines += ratio_lines(result, shape, engines, batches)
    for shape, rows in result["gemm"].items():
        lines.append(f"{shape} GEMMs, us (bf16 / int8 / fp8):")
        for r in rows:
            fp8 = f"{r['fp8_us']:.1f}" if r["fp8_us"] is not None else "-"
            lines.append(f"  {r['layer']:<13} m={r['m']:<5} n={r['n']:<6} k={r['k']:<6} "
                         f"{r['bf16_us']:>8.1f} / {r['int8_us']:>8.1f} / {fp8:>8}")
    for err in result["errors"]:
        lines.append(f"error: {err['item']}: {err['error']}")
    return "\n".join(lines)


def ratio_lines(result: dict, shape: str, engines: dict, batches: list[str]) -> list[str]:
    """The questions of issue 11: int8's batch-1 speedup against its byte savings; KV x2."""
    lines = []
    if batches and all("decode_step_ms" in engines.get(v, {}) for v in ("bf16", "int8")):
        b = batches[0]
        speed = engines["bf16"]["decode_step_ms"][b] / engines["int8"]["decode_step_ms"][b]
        size = engines["bf16"]["weight_bytes"] / engines["int8"]["weight_bytes"]
        lines.append(f"  int8 vs bf16 at batch {b}: step {speed:.2f}x faster, weights "
                     f"{size:.2f}x smaller")
    if shape in result["kv_blocks"]:
        kv = result["kv_blocks"][shape]
        lines.append(f"  KV blocks fp8 / auto: {kv['fp8'] / kv['auto']:.2f}x "
                     f"({result['kv_blocks_weights'][shape]} weights)")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help=f"shipped configs ({', '.join(SHIPPED)}) or model folders")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help="bf16, int8, fp8, each optionally +fp8kv")
    parser.add_argument("--no-gemm", dest="gemm", action="store_false",
                        help="skip the per-layer GEMM timings")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests (32) and repetitions: a sanity run")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests of the workload on every shape (default: 256, "
                             "qwen3-8b 128)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: tiny sizes whatever else is asked (a smoke test)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every engine in this process (freed in between)")
    parser.add_argument("--sweep-int8", action="store_true",
                        help="instead: time a grid of int8 GEMM tiles on the layer shapes")
    parser.add_argument("--gemm-reps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for variant in args.variants:
        try:
            split_variant(variant)
        except ValueError as err:
            parser.error(str(err))
    args.size = "cpu" if args.device == "cpu" else "quick" if args.quick else "full"
    return args


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:  # one item, in a subprocess of run_in_subprocess
        job = json.loads(args.worker)
        value = run_item(tuple(job["item"]), job["settings"])
        args.worker_out.write_text(json.dumps({"value": value,
                                               "device": device_name(job["settings"]["device"])}))
        return None
    if args.sweep_int8:
        device = torch.device(args.device)
        reps = args.gemm_reps or (20 if device.type == "cuda" else 2)
        shapes = {shape_key(s): ModelConfig.from_pretrained(model_folder(s)) for s in args.shapes}
        rows = sweep_int8(shapes, SWEEP_ROWS if device.type == "cuda" else [1, 32], reps, device)
        result = {**run_metadata("nanovllm.benchmarks.quantization", argv, args.device),
                  "int8_sweep": rows}
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        return result
    result = run(argv, args)
    print(format_table(result), flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()

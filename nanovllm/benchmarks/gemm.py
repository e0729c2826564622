"""Timing the linear layers' matmuls alone: bf16 vs int8 (W8A16) vs fp8 (W8A8), and a sweep
of the int8 GEMM's tiles (chapter 08). ``quantization.py`` runs both (``--sweep-int8``);
this module holds the timing itself.

Single eager calls, one at a time, with the L2 cache flushed before each: on a GPU a small
call's time includes its launch from Python, which CUDA graphs hide in the engine.
"""

from __future__ import annotations

import itertools
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nanovllm.benchmarks.timing import time_calls
from nanovllm.models import ModelConfig

L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2 (H200: 50 MB)


def layer_gemms(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(layer, n, k) of each linear layer of one decoder layer: ``y[m, n] = x[m, k] W^T``."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv_proj", q + 2 * kv, cfg.hidden_size), ("o_proj", cfg.hidden_size, q),
            ("gate_up_proj", 2 * cfg.intermediate_size, cfg.hidden_size),
            ("down_proj", cfg.hidden_size, cfg.intermediate_size)]


_FLUSH: dict[str, torch.Tensor] = {}


def time_us(fn, x: torch.Tensor, reps: int, device: torch.device) -> float:
    """Median microseconds of ``fn(x)``; on a GPU from CUDA events around each call, with the
    L2 cache flushed before it (as a layer's weights arrive in a real step)."""
    flush = None
    if device.type == "cuda":
        flush = _FLUSH.setdefault(str(device), torch.empty(L2_FLUSH_BYTES, dtype=torch.int8,
                                                           device=device)).zero_
    times = time_calls(lambda: fn(x), reps, warmup=3, device=device, events=True, before=flush)
    return statistics.median(times) * 1e6


def quantized_layer(w: torch.Tensor, method: str) -> SimpleNamespace:
    from nanovllm.layers.quantization import get_linear_method

    linear_method = get_linear_method(method)
    layer = SimpleNamespace(weight=w.clone())
    linear_method.process_weights_after_loading(layer)
    layer.apply = lambda x: linear_method.apply(layer, x)
    return layer


@torch.inference_mode()
def measure_gemms(cfg: ModelConfig, settings: dict) -> list[dict]:
    """bf16 / int8 / fp8 time of every linear layer's matmul, at each row count."""
    from nanovllm.layers.quantization.fp8 import fp8_supported

    device = torch.device(settings["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen, reps = torch.Generator(device=device).manual_seed(0), settings["gemm_reps"]
    rows = []
    for layer, n, k in layer_gemms(cfg):
        w = torch.randn(n, k, generator=gen, device=device, dtype=dtype) * 0.02
        calls = {"bf16": lambda x, w=w: F.linear(x, w),
                 "int8": quantized_layer(w, "int8").apply, "fp8": quantized_layer(w, "fp8").apply}
        for m in settings["gemm_rows"]:
            x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            row = {"layer": layer, "m": m, "n": n, "k": k}
            for name, call in calls.items():
                runs = name != "fp8" or fp8_supported(device)
                row[f"{name}_us"] = time_us(call, x, reps, device) if runs else None
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- int8 tile sweep

SWEEP_ROWS = [1, 16, 64, 256, 4096]


def sweep_configs(m: int):
    """The tile grid ``--sweep-int8`` tries for ``m`` rows (decode-like or prefill-like)."""
    from nanovllm.kernels.int8_gemm import Int8GemmConfig

    if m <= 16:
        for bn, bk, split, stages in itertools.product((32, 64, 128), (64, 128, 256),
                                                       (1, 2, 4, 8), (3, 4)):
            yield Int8GemmConfig(16, bn, bk, split, num_warps=4, num_stages=stages)
        return
    tiles = [(64, 64, 64), (64, 128, 64), (128, 128, 64), (128, 256, 64), (128, 128, 128)]
    for (bm, bn, bk), warps, stages in itertools.product(tiles, (4, 8), (3, 4)):
        if bm <= max(16, 2 * m):
            yield Int8GemmConfig(bm, bn, bk, 1, num_warps=warps, num_stages=stages)


def tiles(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} split_k={cfg.split_k} "
            f"warps={cfg.num_warps} stages={cfg.num_stages}")


@torch.inference_mode()
def sweep_int8(
    shapes: dict[str, ModelConfig], rows: list[int], reps: int, device: torch.device
) -> list[dict]:
    """Time every ``sweep_configs`` tile on every layer of each named shape; print and return
    the best beside the one ``pick_config`` chooses."""
    from nanovllm.kernels.int8_gemm import _num_sms, int8_gemm, pick_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results, gen = [], torch.Generator(device=device).manual_seed(0)
    print(f"{'shape':<12} {'layer':<13} {'m':>5} {'n':>6} {'k':>6} {'bf16':>8} {'picked':>8} "
          f"{'best':>8}  (us)  best tiles (BLOCK_M x BLOCK_N x BLOCK_K)", flush=True)
    for shape, cfg in shapes.items():
        for layer, n, k in layer_gemms(cfg):
            q = quantized_layer(torch.randn(n, k, generator=gen, device=device) * 0.02, "int8")
            w = (q.weight.float() * q.weight_scale[:, None]).to(dtype)
            for m in rows:
                x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
                picked = pick_config(m, n, k, _num_sms(device))
                timed = {}
                for cfg in [picked, *sweep_configs(m)]:
                    call = lambda x, cfg=cfg, q=q: int8_gemm(x, q.weight, q.weight_scale,
                                                            config=cfg)
                    try:
                        timed[cfg] = time_us(call, x, reps, device)
                    except Exception as err:  # e.g. a tile that needs too much shared memory
                        if "resource" not in repr(err).lower():
                            print(f"   {cfg}: {err!r}", flush=True)
                if picked not in timed:  # the engine's own choice must run
                    raise RuntimeError(f"pick_config's {picked} failed on {m}x{n}x{k}")
                best = min(timed, key=timed.get)
                row = {"shape": shape, "layer": layer, "m": m, "n": n, "k": k,
                       "bf16_us": time_us(lambda x, w=w: F.linear(x, w), x, reps, device),
                       "picked_us": timed[picked], "picked": picked._asdict(),
                       "best_us": timed[best], "best": best._asdict(), "tried": len(timed)}
                results.append(row)
                print(f"{row['shape']:<12} {layer:<13} {m:>5} {n:>6} {k:>6} "
                      f"{row['bf16_us']:>8.1f} {row['picked_us']:>8.1f} {row['best_us']:>8.1f}  "
                      f"{tiles(best)}" + ("" if best == picked else f"  (picked {tiles(picked)})"),
                      flush=True)
    return results

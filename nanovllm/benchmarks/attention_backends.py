"""Our Triton attention kernels against FlashAttention-4 on the same shapes (chapters 02, 05, 11).

    python -m nanovllm.benchmarks.attention_backends --out attention_backends_h200.json

GPU only (Hopper or newer, with the flash-attn-4 package; without it only the Triton rows
are measured). Both backends run through the engine's own entry point, ``backend.attend(q,
k_cache, v_cache, meta, scale)``, on the same paged cache (blocks shuffled over the pool),
Qwen3-0.6B's attention shape (16 query heads over 8 KV heads, head_dim 128), bf16:

- prefill: one prompt of 1k..8k tokens, causal, no cached prefix; FLOPs counted as in
  ``benchmarks/prefill_kernel.py``: ``4 * head_dim * heads * L (L + 1) / 2`` (masked work not
  counted), TFLOP/s = FLOPs / device time;
- decode: batch 1..256 at context 1k and 4k; bytes = K and V read + q + out, TB/s = bytes /
  device time, beside the measured copy bandwidth;
- end to end (``--e2e``, default on): the nano-vllm workload (``nanovllm.bench``) with each
  ``attention_backend``, output tokens per second after the same warm-up.

Device time: the calls (rotating over disjoint block tables, at least 256 MB touched, so
they do not hit in L2) are captured in one CUDA graph, as the engine runs decode steps, and
replayed under ``triton.testing.do_bench`` (median, L2 cleared before each replay); a call
that cannot be captured is timed eagerly and says so. ``host_us``: the host time of one
eager call (prefill steps are not graphed: 28 layers pay it per step). ``first_call_s``:
the first call of each shape, compilation included (or a load from flash-attn's disk cache
where ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, recorded). Each case also records the
largest difference between the two backends' outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from nanovllm.benchmarks.decode_kernel import copy_bandwidth, host_us_per_call, time_per_call
from nanovllm.benchmarks.metadata import package_version, run_metadata
from nanovllm.context import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
PREFILL_LENS = (1024, 2048, 4096, 8192)
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 4096)
BLOCK_SIZES = (16, 128)  # the engine's default; flash-attn's TMA page (one 128-key tile)
ROTATION_BYTES = 256 * 2**20
MAX_ROTATION = 16


def paged_case(
    q_lens: list[int],
    k_lens: list[int],
    block_size: int,
    gen: torch.Generator,
    *,
    shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    dtype: torch.dtype = DTYPE,
    device: str = "cuda",
    rotation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """Random q and a paged K/V cache for one packed step, and ``rotation`` metadata copies
    whose block tables use disjoint, shuffled blocks of the same pool.

    Sequence b has ``q_lens[b]`` new tokens (its queries: the last of its ``k_lens[b]``
    keys, all already in the cache); decodes (q_len 1) must come first, as the engine packs
    them. Returns ``q [sum(q_lens), H, d]``, ``k_cache``, ``v_cache [num_blocks, block_size,
    Hkv, d]`` and the metadata list.
    """
    heads, kv_heads, head_dim = shape
    num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    if any(n == 1 for n in q_lens[num_decodes:]) or any(
        q > k for q, k in zip(q_lens, k_lens)
    ):
        raise ValueError("decodes first, and q_lens[b] <= k_lens[b]")
    pages = [-(-k // block_size) for k in k_lens]
    needed, width = sum(pages), max(pages)
    num_blocks = rotation * needed + 1  # one block nobody uses
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    metas = []
    for r in range(rotation):
        mine = order[r * needed : (r + 1) * needed].split(pages)
        tables = torch.full((len(k_lens), width), -1, dtype=torch.int32, device=device)
        for b, blocks in enumerate(mine):
            tables[b, : len(blocks)] = blocks
        metas.append(AttentionMetadata(
            slot_mapping=torch.full((cu_q[-1],), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
            block_tables=tables,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
            num_decodes=num_decodes,
            cu_seqlens_q_host=cu_q,
            seq_lens_k_host=list(k_lens),
        ))
    return q, k_cache, v_cache, metas


def measure(backends: dict, q_lens, k_lens, block_size, gen, work: float, unit: str) -> dict:
    """One shape, every backend: first call, device and host time, ``work / time``."""
    per_call = 2 * sum(k_lens) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    rotation = min(MAX_ROTATION, max(1, math.ceil(ROTATION_BYTES / per_call)))
    q, k_cache, v_cache, metas = paged_case(q_lens, k_lens, block_size, gen, rotation=rotation)
    scale = HEAD_DIM**-0.5
    row, outs = {"block_size": block_size, "rotation": rotation}, {}
    for name, backend in backends.items():
        def call(meta, attend=backend.attend):
            return attend(q, k_cache, v_cache, meta, scale)

        torch.cuda.synchronize()
        start = time.perf_counter()
        out = call(metas[0])
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        outs[name] = out.float()
        timing = time_per_call([lambda m=m: call(m) for m in metas])
        row[name] = {
            "first_call_s": first,
            **timing,
            unit: work / (timing["us"] * 1e-6),
            "host_us": host_us_per_call(lambda: call(metas[0])),
        }
    if len(outs) == 2:
        a, b = outs.values()
        row["max_abs_diff"] = (a - b).abs().max().item()
    return row


def load_backends(device: torch.device, block_size: int) -> tuple[dict, str | None]:
    """The Triton backend, and flash_attn where it can run (else why not)."""
    from types import SimpleNamespace

    from nanovllm.layers.attention_backends import FlashAttnBackend, TritonBackend

    backends = {"triton": TritonBackend()}
    settings = SimpleNamespace(dtype="bfloat16", block_size=block_size, kv_cache_dtype="auto")
    reason = FlashAttnBackend.check(settings, device)
    if reason is not None:
        return backends, reason
    backends["flash_attn"] = FlashAttnBackend()
    return backends, None


def end_to_end(names: list[str], model: str, num_requests: int | None) -> dict:
    """The nano-vllm workload with each attention backend, one engine after the other."""
    from nanovllm.benchmarks.workload import free, make_workload, resolve_model, run_nanovllm

    path, load_format = resolve_model(model, "cuda")
    work = make_workload("nano-vllm", num_requests)
    rows = {}
    for name in names:
        torch.cuda.empty_cache()
        start = time.perf_counter()
        seconds, llm = run_nanovllm(
            path, load_format, work, attention_backend=name, gpu_memory_utilization=0.5
        )
        rows[name] = {
            "seconds": seconds,
            "output_tok_per_s": work.output_tokens / seconds,
            "with_start_and_warm_up_s": time.perf_counter() - start,
            "cuda_graphs": llm.engine.runner.graphs is not None,
        }
        free(llm)
        print(f"end to end {name}: {rows[name]['output_tok_per_s']:,.0f} output tok/s", flush=True)
    return {"model": model, "requests": len(work.prompts), "output_tokens": work.output_tokens,
            **rows}


def comparison(record: dict, kind: str, block_size: int = 16) -> list[dict]:
    """Rows of a recorded run for the chapters: ``kind`` "prefill" (TFLOP/s per prompt length)
    or "decode" (TB/s per batch and context), at one cache block size, with ``ratio`` = our
    time / flash-attn's (above 1: ours is slower)."""
    unit, scale = ("flop_per_s", 1e12) if kind == "prefill" else ("bytes_per_s", 1e12)
    rows = []
    for row in record[kind]:
        if row["block_size"] != block_size or "flash_attn" not in row:
            continue
        case = {k: row[k] for k in ("tokens", "batch", "ctx") if k in row}
        rows.append({**case, "ours": row["triton"][unit] / scale,
                     "flash_attn": row["flash_attn"][unit] / scale,
                     "ratio": row["triton"]["us"] / row["flash_attn"]["us"]})
    return rows


def _line(kind: str, row: dict, names: list[str], unit: str, scale: float) -> str:
    cells = [f"{n} {row[n]['us']:8.1f} us {row[n][unit] / scale:6.2f}" for n in names]
    diff = f"  max|diff| {row['max_abs_diff']:.2e}" if "max_abs_diff" in row else ""
    return f"{kind} bs={row['block_size']:3d}: " + " | ".join(cells) + diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="attention_backends.json")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=list(PREFILL_LENS))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--no-e2e", dest="e2e", action="store_false",
                        help="skip the end-to-end workload")
    parser.add_argument("--model", default="qwen3-0.6b",
                        help="end to end: a shipped config or a model folder")
    parser.add_argument("--num-requests", type=int, default=None, help="end to end (default 256)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_backends needs a CUDA GPU")

    device = torch.device("cuda")
    backends, skipped = load_backends(device, min(args.block_sizes))
    names = list(backends)
    if skipped:
        print(f"flash_attn not measured: {skipped}", flush=True)
    result = {
        **run_metadata("nanovllm.benchmarks.attention_backends", argv, "cuda"),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "flash_attn_4": package_version("flash-attn-4"),
        "shape": {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16"},
        "flash_attn_skipped": skipped,
        # "1": compiled flash-attn kernels may come from disk (first_call_s then loads them)
        "flash_attn_disk_cache": os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0"),
        "copy_bytes_per_s": copy_bandwidth(),
        "prefill": [], "decode": [],
    }
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bs in args.block_sizes:
        for n in args.prefill_lens:
            flops = 4 * HEAD_DIM * HEADS * n * (n + 1) / 2
            row = {"tokens": n, "flops": flops,
                   **measure(backends, [n], [n], bs, gen, flops, "flop_per_s")}
            result["prefill"].append(row)
            print(_line(f"prefill L={n:5d} (TFLOP/s)", row, names, "flop_per_s", 1e12), flush=True)
        for ctx in args.contexts:
            for batch in args.batches:
                nbytes = 2 * batch * (ctx * KV_HEADS + HEADS) * HEAD_DIM * DTYPE.itemsize
                row = {"batch": batch, "ctx": ctx, "bytes": nbytes,
                       **measure(backends, [1] * batch, [ctx] * batch, bs, gen, nbytes,
                                 "bytes_per_s")}
                result["decode"].append(row)
                print(_line(f"decode B={batch:3d} ctx={ctx:4d} (TB/s)", row, names,
                            "bytes_per_s", 1e12), flush=True)
                torch.cuda.empty_cache()
    if args.e2e:
        result["end_to_end"] = end_to_end(names, args.model, args.num_requests)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

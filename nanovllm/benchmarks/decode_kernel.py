"""Micro-benchmark of the paged decode attention kernel against the memory roofline (GPU only).

    python -m nanovllm.benchmarks.decode_kernel --out results.json

Measures, in one run on one GPU:

1. the device-to-device copy bandwidth (a large ``Tensor.copy_``, bytes read + written): the
   practical ceiling for a kernel that only streams memory;
2. ``decode_attention`` on Qwen3-0.6B's attention shape (16 query heads over 8 KV heads,
   head_dim 128, bf16) for block sizes 16 and 256, batch 1/16/64/256 and context 1024/4096,
   with the blocks scattered in a shuffled order over a pool larger than the L2 cache: achieved
   bandwidth = (bytes of K and V read + q + out) / median time, and its fraction of the copy
   bandwidth;
3. the peer, in the same run: PyTorch SDPA on contiguous ``[B, H, L, D]`` K/V (GQA through
   ``enable_gqa``), with each backend that accepts the shape (cuDNN, flash, memory-efficient),
   and cuDNN on K/V repeated to all 16 heads (``cudnn_mha``: twice the K/V bytes, counted);
4. before any timing, every output is checked against a float32 PyTorch reference.

Device time per call: the calls of one timed pass rotate over block tables of disjoint blocks
(at least 256 MB touched, over 4x the 60 MB L2), are captured in one CUDA graph (as the engine
runs decode steps, so host launch overhead is excluded) and replayed under
``triton.testing.do_bench`` (median; it also clears the L2 before each replay). ``host_us`` is
the separate host cost of one eager call. Results go to a JSON file with the device, date,
versions and command. Used by chapter 05 (``chapters/05_paged_attention_kernel``)
to plot kernel bandwidth against the roofline.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
import warnings

import torch

try:
    from triton.testing import do_bench
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the decode benchmark needs Triton (`pip install triton`)") from exc

from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.split_kv import choose_num_splits, num_sms

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 4096)
BLOCK_SIZES = (16, 256)
ROTATION_BYTES = 256 * 2**20  # one timed pass touches at least this much: over 4x the L2
MAX_ROTATION = 64
MAX_REL_ERR = 1e-2


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy in bytes/s, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def time_per_call(fns) -> dict:
    """Median device time of one call, running ``fns`` (over disjoint data) back to back.

    The calls are captured in one CUDA graph, as the engine runs decode steps, so host launch
    overhead is not counted; ``do_bench`` clears the L2 before each replay, and the rotation
    over disjoint data keeps the calls inside a replay from hitting in L2 too. Falls back to
    eager launches (host overhead included) if capture fails.
    """
    for fn in fns:  # compile and warm up
        fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        ms = do_bench(graph.replay, warmup=5, rep=100, return_mode="median")
        return {"us": ms * 1e3 / len(fns), "timing": "cuda_graph"}
    except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        ms = do_bench(lambda: [fn() for fn in fns], warmup=5, rep=100, return_mode="median")
        return {"us": ms * 1e3 / len(fns), "timing": f"eager ({type(exc).__name__})"}


def host_us_per_call(fn, calls: int = 200) -> float:
    """Host time to launch one call (what an eager engine pays per layer), microseconds."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def make_case(batch: int, ctx: int, block_size: int, gen: torch.Generator):
    """A paged cache with ``R`` block tables over disjoint, shuffled blocks (R from the size)."""
    blocks_per_seq = ctx // block_size
    needed = batch * blocks_per_seq
    bytes_per_block = 2 * block_size * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V
    rotation = min(MAX_ROTATION, max(2, math.ceil(ROTATION_BYTES / (needed * bytes_per_block))))
    num_blocks = rotation * needed + 64  # a few blocks nobody uses
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_(generator=gen)
    v_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_(generator=gen)
    order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = [
        order[i * needed : (i + 1) * needed].view(batch, blocks_per_seq).contiguous()
        for i in range(rotation)
    ]
    q = torch.empty(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda").normal_(generator=gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, seq_lens, tables


def gather_contiguous(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Paged ``[num_blocks, bs, Hkv, D]`` -> contiguous ``[B, Hkv, L, D]`` through a table."""
    batch = table.shape[0]
    gathered = cache[table.long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)
    return gathered.transpose(1, 2).contiguous()


def reference(q, k, v, scale, chunk: int = 16) -> torch.Tensor:
    """float32 attention of one query per sequence over contiguous ``[B, Hkv, L, D]`` K/V."""
    group = NUM_HEADS // NUM_KV_HEADS
    outs = []
    for s in range(0, q.shape[0], chunk):
        qs = q[s : s + chunk].float().view(-1, NUM_KV_HEADS, group, HEAD_DIM)
        ks, vs = k[s : s + chunk].float(), v[s : s + chunk].float()
        p = torch.einsum("bkgd,bkld->bkgl", qs, ks).mul_(scale).softmax(dim=-1)
        outs.append(torch.einsum("bkgl,bkld->bkgd", p, vs).reshape(-1, NUM_HEADS, HEAD_DIM))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sdpa_peers():
    """(name, SDPBackend, expand K/V to all heads?) for each backend this torch knows.

    ``cudnn_mha`` runs cuDNN on K/V repeated to all query heads: twice the K/V bytes, counted.
    """
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return [("default", None, False)]
    names = [
        ("cudnn", "CUDNN_ATTENTION", False),
        ("flash", "FLASH_ATTENTION", False),
        ("efficient", "EFFICIENT_ATTENTION", False),
        ("cudnn_mha", "CUDNN_ATTENTION", True),
    ]
    return [
        (name, getattr(SDPBackend, attr), expand)
        for name, attr, expand in names
        if hasattr(SDPBackend, attr)
    ]


def bench_sdpa(q, contiguous_kv, scale, ref, io_bytes):
    """Time SDPA on contiguous K/V (one copy per rotation step) with each backend that runs."""
    from torch.nn.attention import sdpa_kernel

    group = NUM_HEADS // NUM_KV_HEADS
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    results = {}
    for name, backend, expand in sdpa_peers():
        kv = contiguous_kv
        if expand:
            kv = [(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for k, v in kv]
        extra = (group - 1) * 2 * kv[0][0].numel() // group * q.element_size() if expand else 0

        def call(k, v, backend=backend, expand=expand):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return torch.nn.functional.scaled_dot_product_attention(
                    q4, k, v, scale=scale, enable_gqa=not expand
                )

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "kernel not used because ..." chatter
                err = rel_err(call(*kv[0]).squeeze(2), ref)
                if not err < MAX_REL_ERR:
                    results[name] = {"error": f"rel_err {err:.3g}"}
                    continue
                timing = time_per_call([functools.partial(call, k, v) for k, v in kv])
        except Exception as exc:  # noqa: BLE001 - backend refuses this shape / dtype / GQA
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            continue
        nbytes = io_bytes + extra
        results[name] = {
            **timing,
            "rel_err": err,
            "bytes": nbytes,
            "bytes_per_s": nbytes / (timing["us"] * 1e-6),
        }
    return results


def bench_shape(batch, ctx, block_size, copy_bw, gen, with_sdpa: bool, sweep_splits: bool):
    q, k_cache, v_cache, seq_lens, tables = make_case(batch, ctx, block_size, gen)
    scale = HEAD_DIM**-0.5
    splits = choose_num_splits(
        batch, NUM_KV_HEADS, tables[0].shape[1] * block_size, num_sms(q.device)
    )

    def decode(table, ns=None):
        return decode_attention(q, k_cache, v_cache, seq_lens, table, scale, ns)

    # correctness first: first and last table, automatic and forced split counts
    refs = {}
    for i in (0, len(tables) - 1):
        kv = (gather_contiguous(k_cache, tables[i]), gather_contiguous(v_cache, tables[i]))
        refs[i] = reference(q, *kv, scale)
        for ns in (None, 1, 4):
            err = rel_err(decode(tables[i], ns), refs[i])
            if not err < MAX_REL_ERR:
                raise AssertionError(f"B={batch} ctx={ctx} bs={block_size} splits={ns}: {err}")

    kv_read = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    io_bytes = kv_read + 2 * q.numel() * q.element_size()  # + q in + out

    def timed(ns):
        timing = time_per_call([functools.partial(decode, t, ns) for t in tables])
        bw = io_bytes / (timing["us"] * 1e-6)
        return {**timing, "bytes_per_s": bw, "frac_copy": bw / copy_bw}

    row = {
        "batch": batch,
        "ctx": ctx,
        "block_size": block_size,
        "num_splits": splits,
        "rotation": len(tables),
        "bytes": io_bytes,
        "rel_err": rel_err(decode(tables[0]), refs[0]),
        **timed(None),
        "host_us": host_us_per_call(functools.partial(decode, tables[0])),
    }
    if sweep_splits:
        row["sweep"] = {ns: timed(ns) for ns in (1, 2, 4, 8, 16, 32)}
    if with_sdpa:
        kv = [(gather_contiguous(k_cache, t), gather_contiguous(v_cache, t)) for t in tables]
        row["sdpa"] = bench_sdpa(q, kv, scale, refs[0], io_bytes)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_kernel.json", help="where to write the JSON")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA peer")
    parser.add_argument(
        "--sweep-splits",
        action="store_true",
        help="also time num_splits 1..32 (for tuning the automatic rule)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the decode kernel benchmark needs a CUDA GPU (the interpreter times the CPU)")

    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for block_size in args.block_sizes:
        for ctx in args.contexts:
            for batch in args.batches:
                row = bench_shape(
                    batch, ctx, block_size, copy_bw, gen, not args.no_sdpa, args.sweep_splits
                )
                rows.append(row)
                torch.cuda.empty_cache()  # the case's caches died with bench_shape's frame
                print(
                    f"bs={block_size:3d} ctx={ctx:4d} B={batch:3d}: {row['us']:8.1f} us "
                    f"{row['bytes_per_s'] / 1e12:5.2f} TB/s ({row['frac_copy']:.0%}) "
                    f"[{row['timing']}; host {row['host_us']:.0f} us/call]",
                    flush=True,
                )
                if "sweep" in row:
                    print(
                        "    splits: "
                        + "  ".join(f"{ns}: {t['us']:.1f}" for ns, t in row["sweep"].items()),
                        flush=True,
                    )

    result = {
        **run_metadata("nanovllm.benchmarks.decode_kernel", argv, "cuda"),
        "num_sms": num_sms(torch.device("cuda")),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": str(DTYPE).removeprefix("torch."),
        },
        "copy_bytes_per_s": copy_bw,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"wrote {args.out}")


def print_table(result):
    copy_bw = result["copy_bytes_per_s"]
    print(
        f"\n{result['device']}, copy {copy_bw / 1e12:.2f} TB/s; Qwen3-0.6B attention shape, "
        "bf16; device us per call (CUDA graph); TB/s = (K + V + q + out bytes) / time"
    )
    header = f"{'bs':>4} {'ctx':>5} {'B':>4} {'splits':>6} {'ours us':>9} {'TB/s':>6} {'%copy':>6}"
    names = sorted({n for r in result["rows"] for n in r.get("sdpa", {})})
    header += "".join(f" {n + ' us':>13}" for n in names)
    print(header)
    for r in result["rows"]:
        line = (
            f"{r['block_size']:>4} {r['ctx']:>5} {r['batch']:>4} {r['num_splits']:>6} "
            f"{r['us']:>9.1f} {r['bytes_per_s'] / 1e12:>6.2f} {r['frac_copy']:>6.0%}"
        )
        for n in names:
            peer = r.get("sdpa", {}).get(n, {})
            line += f" {peer['us']:>13.1f}" if "us" in peer else f" {'-':>13}"
        print(line)


if __name__ == "__main__":
    main()

"""Tile sweep of the decode attention kernel for one attention shape (issue 17): which
(BLOCK_N, num_warps, num_stages) reads the paged KV cache fastest, against the fixed rule.

    python3 tests/gpu/decode_launch_sweep.py --shape 9 3 64 --out sweep.json

Each case: ``batch`` sequences of ``ctx`` keys in a shuffled paged cache of block size 16,
outputs checked against the rule's, timed as ``nanovllm.benchmarks.decode_kernel`` times them
(one CUDA graph over disjoint block tables, median of ``do_bench``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from nanovllm.benchmarks.decode_kernel import copy_bandwidth, time_per_call
from nanovllm.benchmarks.metadata import run_metadata
from nanovllm.kernels.decode_attention import decode_attention

BLOCK_SIZE, ROTATION = 16, 4


def case(heads: int, kv_heads: int, dim: int, batch: int, ctx: int, gen: torch.Generator):
    per_seq = ctx // BLOCK_SIZE
    blocks = ROTATION * batch * per_seq
    shape = (blocks, BLOCK_SIZE, kv_heads, dim)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    order = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    tables = list(order.view(ROTATION, batch, per_seq))
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k, v, lens, tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "KV", "D"))
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    heads, kv_heads, dim = args.shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    configs = [None] + list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
    rows = []
    for batch, ctx in itertools.product(args.batches, args.contexts):
        q, k, v, lens, tables = case(heads, kv_heads, dim, batch, ctx, gen)
        nbytes = 2 * batch * ctx * kv_heads * dim * 2
        expected = decode_attention(q, k, v, lens, tables[0], dim**-0.5)
        for launch in configs:
            call = functools.partial(decode_attention, q, k, v, lens, scale=dim**-0.5,
                                     launch=launch)
            got = call(block_tables=tables[0])
            err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max())
            assert err < 1e-2, (launch, float(err))
            us = time_per_call([functools.partial(call, block_tables=t) for t in tables])["us"]
            rows.append({"batch": batch, "ctx": ctx, "launch": launch or "rule", "us": us,
                         "frac_copy": nbytes / (us * 1e-6) / bandwidth})
        best = min((r for r in rows if r["batch"] == batch and r["ctx"] == ctx),
                   key=lambda r: r["us"])
        rule = next(r for r in rows if r["batch"] == batch and r["ctx"] == ctx
                    and r["launch"] == "rule")
        print(f"B={batch} ctx={ctx}: rule {rule['us']:.1f} us ({rule['frac_copy']:.0%}), best "
              f"{best['launch']} {best['us']:.1f} us ({best['frac_copy']:.0%})", flush=True)
    if args.out:
        meta = run_metadata("tests/gpu/decode_launch_sweep.py", argv, "cuda")
        with open(args.out, "w") as f:
            json.dump({**meta, "shape": args.shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

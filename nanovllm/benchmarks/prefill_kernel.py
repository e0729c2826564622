"""Benchmark the Triton paged prefill attention kernel against PyTorch's packed attention.

    python -m nanovllm.benchmarks.prefill_kernel --out figures/data/prefill_kernel_h200.json

GPU only. Chapter 02 (``chapters/02_attention``) plots the recorded JSON on CPU machines.

Workload: the benchmark's prefill shape, 256 prompts whose lengths are
``random.seed(0); [random.randint(100, 1024) for _ in range(256)]`` (144,831 tokens),
Qwen3-0.6B attention (16 query heads, 8 KV heads, head_dim 128; ``--shape`` picks
another), bf16, no cached prefix, the K/V in a paged cache of block size 256 and 16 with
shuffled block ids. ``--sweep`` also times a few tile configurations (how
``launch_config.prefill_tiles`` was chosen).

FLOPs: a causal chunk of q_len queries over k_len keys (prefix k_len - q_len) attends
``pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2`` (query, key) pairs; each pair
costs one multiply-add in Q K^T and one in P V per head dimension, so
``FLOPs = 4 * head_dim * num_heads * sum(pairs)``. Masked-out work is not counted.

Peers, in the same run, on the same values: ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention through PyTorch, contiguous packed K/V, causal via ``window_size=(-1, 0)``)
where this torch has it, and its paged form (``block_table=``) where it accepts one;
otherwise ``scaled_dot_product_attention`` per sequence. Timings are medians of
``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
from itertools import accumulate

import torch

from nanovllm.benchmarks.metadata import run_metadata

QWEN3_0_6B = (16, 8, 128)  # (num_heads, num_kv_heads, head_dim): the default shape


def prompt_lengths(num_prompts=256, low=100, high=1024, seed=0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_prompts)]


def attention_flops(seqs: list[tuple[int, int]], num_heads: int, head_dim: int) -> float:
    pairs = sum(q * (k - q) + q * (q + 1) / 2 for q, k in seqs)
    return 4.0 * head_dim * num_heads * pairs


def build_case(seqs, block_size, dtype, shape=QWEN3_0_6B, seed=0, device="cuda"):
    """Packed q, contiguous packed K/V (all keys of each sequence) and the same K/V paged."""
    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    num_seqs = len(seqs)
    total_q, total_k = sum(q for q, _ in seqs), sum(k for _, k in seqs)
    q = torch.randn(total_q, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(total_k, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(total_k, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    blocks_per_seq = [-(-kl // block_size) for _, kl in seqs]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    block_tables = torch.full((num_seqs, max(blocks_per_seq)), -1, dtype=torch.int32)
    k_cache = torch.zeros(
        num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype
    )
    v_cache = torch.zeros_like(k_cache)
    cu_k = [0, *accumulate(kl for _, kl in seqs)]
    for b, (_, kl) in enumerate(seqs):
        ids = [order.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(kl)
        blocks = block_tables[b, pos // block_size].long().to(device)
        rows = (pos % block_size).to(device)
        k_cache[blocks, rows] = k[cu_k[b] : cu_k[b + 1]]
        v_cache[blocks, rows] = v[cu_k[b] : cu_k[b + 1]]
    int32 = dict(dtype=torch.int32, device=device)
    return dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0, *accumulate(ql for ql, _ in seqs)], **int32),
        cu_seqlens_k=torch.tensor(cu_k, **int32),
        seq_lens_k=torch.tensor([kl for _, kl in seqs], **int32),
        block_tables=block_tables.to(device),
        max_seqlen_q=max(q for q, _ in seqs),
        max_seqlen_k=max(kl for _, kl in seqs),
        scale=head_dim**-0.5,
    )


def kernel_call(case, tiles=None):
    from nanovllm.kernels.prefill_attention import prefill_attention

    names = ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens_k", "block_tables")
    args = [case[n] for n in names]
    return lambda: prefill_attention(*args, case["scale"], case["max_seqlen_q"], tiles=tiles)


def sdpa_per_sequence(case, seqs, dtype=None):
    """Reference/peer: SDPA on each sequence's contiguous K/V (bottom-right causal mask)."""
    F = torch.nn.functional

    def run():
        outs = []
        for b, (ql, kl) in enumerate(seqs):
            qs, ks = case["cu_seqlens_q"][b], case["cu_seqlens_k"][b]
            qb = case["q"][qs : qs + ql].transpose(0, 1)
            kb = case["k"][ks : ks + kl].transpose(0, 1)
            vb = case["v"][ks : ks + kl].transpose(0, 1)
            if dtype is not None:
                qb, kb, vb = qb.to(dtype), kb.to(dtype), vb.to(dtype)
            kb = kb.repeat_interleave(qb.shape[0] // kb.shape[0], dim=0)
            vb = vb.repeat_interleave(qb.shape[0] // vb.shape[0], dim=0)
            mask = torch.ones(ql, kl, dtype=torch.bool, device=qb.device).tril(diagonal=kl - ql)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=case["scale"])
            outs.append(ob.transpose(0, 1))
        return torch.cat(outs)

    return run


def varlen_peers(case):
    """{name: callable} for torch's varlen_attn (contiguous, and paged where supported)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    params = inspect.signature(varlen_attn).parameters
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    peers = {
        "varlen_attn": lambda: varlen_attn(
            case["q"],
            case["k"],
            case["v"],
            case["cu_seqlens_q"],
            case["cu_seqlens_k"],
            case["max_seqlen_q"],
            case["max_seqlen_k"],
            scale=case["scale"],
            **extra,
        )
    }
    if "block_table" in params and "seqused_k" in params:
        peers["varlen_attn_paged"] = lambda: varlen_attn(
            case["q"],
            case["k_cache"],
            case["v_cache"],
            case["cu_seqlens_q"],
            None,
            case["max_seqlen_q"],
            case["max_seqlen_k"],
            scale=case["scale"],
            seqused_k=case["seq_lens_k"],
            block_table=case["block_tables"],
            **extra,
        )
    return peers


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_correctness(shape=QWEN3_0_6B) -> dict:
    """A smaller mixed case (prefixes and decode rows) vs SDPA in fp32 on contiguous K/V."""
    seqs = [(300, 1000), (1, 700), (1024, 1024), (1, 1), (129, 129), (64, 900), (517, 517)]
    errors = {}
    for block_size in (16, 256):
        case = build_case(seqs, block_size, torch.bfloat16, shape, seed=1)
        ref = sdpa_per_sequence(case, seqs, dtype=torch.float32)()
        out = kernel_call(case)()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        if not (torch.isfinite(out).all() and err < 1e-2):
            raise SystemExit(
                f"prefill kernel disagrees with SDPA (block_size {block_size}): rel err {err:.2e}"
            )
        errors[f"block_size_{block_size}"] = err
    return errors


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


SWEEP = [
    (64, 32, 4, 2),
    (64, 32, 4, 3),
    (64, 16, 4, 2),
    (64, 32, 8, 2),
    (64, 64, 4, 2),
    (128, 32, 4, 2),
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 16])
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        default=list(QWEN3_0_6B),
        metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
        help="attention shape (default Qwen3-0.6B: 16 8 128; SmolLM2: 9 3 64)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time a few (BLOCK_M, BLOCK_N, num_warps, num_stages)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the prefill kernel benchmark needs a CUDA GPU")
    from nanovllm.kernels.launch_config import prefill_tiles

    lens = prompt_lengths()
    seqs = [(n, n) for n in lens]
    shape = tuple(args.shape)
    num_heads, num_kv_heads, head_dim = shape
    flops = attention_flops(seqs, num_heads, head_dim)
    result = {
        **run_metadata("nanovllm.benchmarks.prefill_kernel", argv, "cuda"),
        "workload": {
            "num_prompts": len(lens),
            "total_tokens": sum(lens),
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "dtype": "bfloat16",
            "flops": flops,
            "flops_formula": "4*head_dim*num_heads*sum(q*(k-q) + q*(q+1)/2)",
        },
        "tiles": dict(
            zip(
                ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                prefill_tiles(head_dim, torch.device("cuda")),
            )
        ),
        "correctness_rel_err_vs_sdpa_fp32": check_correctness(shape),
        "runs": [],
    }
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}")
    print(f"{len(lens)} prompts, {sum(lens):,} tokens, {flops / 1e12:.3f} TFLOP per pass")
    print("correctness (rel err vs fp32 SDPA):", result["correctness_rel_err_vs_sdpa_fp32"])

    def record(name, block_size, fn, **extra):
        try:
            ms = bench(fn)
        except Exception as exc:  # a peer this torch cannot run
            why = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{name:<28} block {block_size!s:>4}: skipped ({why[:120]})")
            result["runs"].append({"name": name, "block_size": block_size, "error": why, **extra})
            return
        tflops = flops / (ms * 1e-3) / 1e12
        print(f"{name:<28} block {block_size!s:>4}: {ms * 1e3:9.1f} us  {tflops:7.1f} TFLOP/s")
        result["runs"].append(
            {"name": name, "block_size": block_size, "ms": ms, "tflops": tflops, **extra}
        )

    peers_done = False
    for block_size in args.block_sizes:
        case = build_case(seqs, block_size, torch.bfloat16, shape)
        out = kernel_call(case)()
        torch.cuda.synchronize()
        record("triton_prefill_paged", block_size, kernel_call(case))
        if args.sweep:
            for tiles in SWEEP:
                fn = kernel_call(case, tiles)
                record(f"triton tiles {tiles}", block_size, fn, tiles=list(tiles))
        peers = varlen_peers(case)
        if not peers_done:
            if "varlen_attn" in peers:
                ref = peers["varlen_attn"]()
                result.setdefault("agreement_rel_err_vs_varlen_attn", rel_err(out, ref))
                record("varlen_attn (contiguous)", None, peers["varlen_attn"])
            else:
                record("sdpa per sequence (contiguous)", None, sdpa_per_sequence(case, seqs))
            peers_done = True
        if "varlen_attn_paged" in peers:
            record("varlen_attn (paged)", block_size, peers["varlen_attn_paged"])
        del case
        torch.cuda.empty_cache()

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()

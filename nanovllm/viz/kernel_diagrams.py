"""Concept diagrams of memory and kernels, computed with the package's own code (chapters 02,
04, 05, 07, 09): the block tables come from a real ``BlockManager`` and the slots from
``pack_step``; the tiles from ``prefill_tiles``; the splits from ``choose_num_splits`` and
``decode_tiles``; the buckets from ``batch_buckets`` at the engine's default ``max_num_seqs``;
the shards from a shipped model config. Each ``*_example`` function returns the numbers its
diagram draws, so tests/test_diagrams.py checks them against the package. Shared drawing
helpers: ``diagrams.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from nanovllm.viz.diagrams import arrow, box, canvas
from nanovllm.viz.records import load_record
from nanovllm.viz.style import BOOK_COLORS


def h200_sms() -> int:
    """The streaming multiprocessors of the H200 the book measures on, as its decode-kernel run
    recorded them (chapter 05 §6), not typed here; read when a diagram is drawn, not at import
    (a course grader imports this module where the book's records are absent)."""
    return load_record("bench_decode_h200.json")["num_sms"]


def _default(field: str) -> Any:
    from nanovllm.config import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == field)


# -- block tables and the slot mapping (chapter 04) ------------------------------------------


def block_table_example(block_size: int | None = None) -> dict:
    """Four requests through a real ``BlockManager`` of 8 blocks (the engine's default block
    size): A (20 tokens), B (10) and C (30) are allocated, B finishes and is freed, D (50)
    arrives and gets the last fresh blocks and then B's; then one decode step for A, C and D,
    whose slots ``pack_step`` computes."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.step import pack_step
    from nanovllm.sampling_params import SamplingParams

    bs = block_size or _default("block_size")
    bm = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=False)
    lengths = {"A": 20 * bs // 16, "B": 10 * bs // 16, "C": 30 * bs // 16, "D": 50 * bs // 16}
    seqs = {}
    for name, n in lengths.items():
        seq = Sequence(list(range(n)), SamplingParams(max_tokens=8))
        assert bm.allocate(seq, n)
        seqs[name] = seq
        if name == "C":
            bm.free(seqs.pop("B"))
    for seq in seqs.values():  # prefilled; the next step decodes one token each
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(0)
        assert bm.allocate(seq, 1)
    step = pack_step(list(seqs.values()), [1] * len(seqs), bs, {})
    return {"block_size": bs, "num_blocks": 8,
            "tables": {k: list(s.block_table) for k, s in seqs.items()},
            "filled": {k: s.num_tokens for k, s in seqs.items()},
            "positions": dict(zip(seqs, step["positions"])),
            "slot_mapping": dict(zip(seqs, step["slot_mapping"]))}


def block_table_diagram(block_size: int | None = None) -> Any:
    """Chapter 04: block tables point into the physical cache; a decode token's slot."""
    ex = block_table_example(block_size)
    bs, tables = ex["block_size"], ex["tables"]
    colors = dict(zip(tables, (BOOK_COLORS[0], BOOK_COLORS[2], BOOK_COLORS[3])))
    fig, ax = canvas(bs + 14, ex["num_blocks"] + 3.2, (10.0, 5.0))
    from matplotlib.patches import Rectangle

    owner = {b: name for name, t in tables.items() for b in t}
    x0 = 13.0
    for b in range(ex["num_blocks"]):
        y = ex["num_blocks"] - b + 0.6
        ax.text(x0 - 0.2, y + 0.45, f"block {b}", ha="right",
                va="center", fontsize=7.5)
        name = owner.get(b)
        for k in range(bs):
            token = tables[name].index(b) * bs + k if name else None
            used = name is not None and token < ex["filled"][name]
            ax.add_patch(Rectangle((x0 + k, y), 0.92, 0.9, edgecolor="0.6", lw=0.4,
                                   facecolor=colors[name] if used else "white",
                                   alpha=0.8 if used and token != ex["positions"][name] else 1))
    for slot in ex["slot_mapping"].values():
        b, k = divmod(slot, bs)
        y = ex["num_blocks"] - b + 0.6
        ax.add_patch(Rectangle((x0 + k, y), 0.92, 0.9, fill=False, edgecolor="black", lw=2))
    for i, (name, table) in enumerate(tables.items()):
        y = ex["num_blocks"] - 1.2 - 2.2 * i
        box(ax, 0.2, y, 2.6, 0.9, f"{name}: {ex['filled'][name]} tokens", colors[name],
            alpha=0.35, fontsize=8)
        ax.text(3.1, y + 0.45, f"block table {table}", va="center", fontsize=8)
    lines = [f"{n}: position {ex['positions'][n]} -> block {tables[n][ex['positions'][n] // bs]}"
             f" x {bs} + {ex['positions'][n] % bs} = slot {s}"
             for n, s in ex["slot_mapping"].items()]
    ax.text(0.2, 0.9, "the decode step's slot_mapping (pack_step), ringed:\n" + "\n".join(lines),
            fontsize=7.5, va="bottom")
    ax.text(0.2, -0.3, f"slot_mapping = {list(ex['slot_mapping'].values())}", fontsize=8.5,
            family="monospace", va="bottom")
    ax.set_title(f"Block tables and the slot mapping: {ex['num_blocks']} blocks of {bs} slots "
                 "(B finished; its block went to D)", fontsize=10)
    return fig


# -- online-softmax tiling (chapter 02) ------------------------------------------------------


def tiling_example(seq_len: int = 256, head_dim: int = 128) -> dict:
    """The prefill kernel's tiles on a GPU (``prefill_tiles``) over one causal sequence: each
    (query tile, key tile) is "full" (entirely below the diagonal), "masked" (crosses it) or
    "skipped" (entirely above it, never loaded)."""
    import torch

    from nanovllm.kernels.launch_config import prefill_tiles

    block_m, block_n, *_ = prefill_tiles(head_dim, torch.device("cuda"))
    kinds = {}
    for i in range(math.ceil(seq_len / block_m)):
        q_lo, q_hi = i * block_m, min((i + 1) * block_m, seq_len) - 1
        for j in range(math.ceil(seq_len / block_n)):
            k_lo, k_hi = j * block_n, min((j + 1) * block_n, seq_len) - 1
            kinds[(i, j)] = ("skipped" if k_lo > q_hi else "full" if k_hi <= q_lo else "masked")
    return {"block_m": block_m, "block_n": block_n, "seq_len": seq_len, "kinds": kinds}


def online_softmax_diagram(seq_len: int = 256, head_dim: int = 128) -> Any:
    """Chapter 02: the score matrix cut into tiles; one query tile walks its key tiles,
    keeping a running max m, sum l and output acc."""
    ex = tiling_example(seq_len, head_dim)
    bm, bn, n = ex["block_m"], ex["block_n"], seq_len
    fig, ax = canvas(n * 2.1, n * 1.12, (10.0, 4.8))
    from matplotlib.patches import Polygon, Rectangle

    style = {"full": (BOOK_COLORS[0], 0.45), "masked": (BOOK_COLORS[1], 0.55),
             "skipped": ("white", 1.0)}
    top = n * 1.05
    walk = 2  # the query tile whose walk is annotated
    for (i, j), kind in ex["kinds"].items():
        color, alpha = style[kind]
        ax.add_patch(Rectangle((j * bn, top - (i + 1) * bm), bn, bm, facecolor=color,
                               alpha=alpha, edgecolor="0.3", lw=0.6 if i != walk else 1.6))
    ax.add_patch(Polygon([(0, top), (n, top - n), (0, top - n)], closed=True, fill=False,
                         edgecolor="0.2", ls="--", lw=0.8))
    ax.text(n / 2, top + 6, f"keys (tiles of {bn})", ha="center", fontsize=8)
    ax.text(-6, top - n / 2, f"queries (tiles of {bm})", ha="right", va="center", rotation=90,
            fontsize=8)
    x = n + 18
    counts = {k: sum(v == k for v in ex["kinds"].values()) for k in style}
    lines = [f"{seq_len} tokens, GPU tiles {bm} x {bn} (prefill_tiles, head_dim {head_dim})",
             f"blue: {counts['full']} full tiles, no mask",
             f"orange: {counts['masked']} tiles on the diagonal, masked",
             f"white: {counts['skipped']} tiles above it, never loaded",
             "",
             f"query tile {walk} (outlined) walks its key tiles left to right;",
             "for each key tile j, with scores S_j = Q K_j^T / sqrt(d):",
             "  m_new = max(m, rowmax(S_j))",
             "  l = l * exp(m - m_new) + rowsum(exp(S_j - m_new))",
             "  acc = acc * exp(m - m_new) + exp(S_j - m_new) V_j",
             "  m = m_new",
             "after the last tile: out = acc / l",
             "(never the whole row of scores in memory)"]
    ax.text(x, top - 4, "\n".join(lines), va="top", fontsize=8, family="monospace")
    y_walk = top - walk * bm - bm / 2
    arrow(ax, (4, y_walk), (min(n, (walk + 1) * bm) - 4, y_walk), color="black")
    ax.set_title("Online softmax, tile by tile (the Triton prefill kernel)", fontsize=10)
    return fig


# -- split-KV decode (chapter 05) ------------------------------------------------------------


def split_kv_example(batch: int = 16, seq_len: int = 2048, model: str = "qwen3-0.6b") -> dict:
    """``choose_num_splits`` for a decode batch of ``model`` on an H200, and the key ranges the
    kernel gives each split (rounded up to its key tile, ``decode_tiles``)."""
    from nanovllm.kernels.launch_config import decode_tiles
    from nanovllm.kernels.split_kv import choose_num_splits

    cfg = model_config(model)
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    splits = choose_num_splits(batch, kv_heads, seq_len, h200_sms())
    block_n = decode_tiles(head_dim, on_gpu=True)[0]
    split_len = math.ceil(math.ceil(seq_len / splits) / block_n) * block_n
    ranges = [(s * split_len, min((s + 1) * split_len, seq_len)) for s in range(splits)]
    by_batch = {b: choose_num_splits(b, kv_heads, seq_len, h200_sms()) for b in (1, 4, 16, 32, 64)}
    return {"batch": batch, "seq_len": seq_len, "kv_heads": kv_heads, "num_splits": splits,
            "ranges": ranges, "by_batch": by_batch}


def split_kv_diagram(batch: int = 16, seq_len: int = 2048) -> Any:
    """Chapter 05: one sequence's keys cut into splits, each a program writing (m, l, acc),
    merged by ``combine_splits``."""
    ex = split_kv_example(batch, seq_len)
    fig, ax = canvas(12, 6, (9.5, 4.2))
    scale = 11.0 / seq_len
    for s, (lo, hi) in enumerate(ex["ranges"]):
        color = BOOK_COLORS[s % 6]
        box(ax, 0.5 + lo * scale, 4.3, (hi - lo) * scale - 0.05, 0.7, f"keys {lo}-{hi - 1}", color,
            alpha=0.35, fontsize=7.5)
        cx = 0.5 + (lo + hi) / 2 * scale
        box(ax, cx - 0.8, 2.6, 1.6, 0.8, f"program {s}\n(m, l, acc)", color, alpha=0.6,
            fontsize=7.5)
        arrow(ax, (cx, 4.3), (cx, 3.4))
        arrow(ax, (cx, 2.6), (6.0, 1.5))
    box(ax, 4.3, 0.7, 3.4, 0.8, "combine_splits: M = max m_s,\nout = sum 2^(m_s-M) acc_s / "
        "sum 2^(m_s-M) l_s", "0.9", fontsize=7.5)
    table = ", ".join(f"{b}: {s}" for b, s in ex["by_batch"].items())
    ax.text(0.5, 5.3, f"batch {ex['batch']} x {ex['kv_heads']} KV heads = "
            f"{ex['batch'] * ex['kv_heads']} programs for {h200_sms()} SMs: too few, so each "
            f"sequence's {ex['seq_len']} keys are cut into {ex['num_splits']} splits",
            fontsize=8)
    ax.text(0.5, 0.1, f"choose_num_splits at {ex['seq_len']} keys, batch: splits = {table}",
            fontsize=8, color="0.3")
    ax.set_title("Split-KV decode (flash-decoding), Qwen3-0.6B on an H200", fontsize=10)
    return fig


# -- CUDA graph buckets (chapter 07) ---------------------------------------------------------


def graph_buckets_example(batches: tuple[int, ...] = (3, 13, 100, 250)) -> dict:
    """The buckets captured at the engine's default ``max_num_seqs``, and the bucket each of
    ``batches`` replays (the smallest that holds it)."""
    from nanovllm.engine.cuda_graphs import batch_buckets

    buckets = batch_buckets(_default("max_num_seqs"))
    return {"buckets": buckets, "replay": {n: min(b for b in buckets if b >= n) for n in batches}}


def cuda_graph_diagram() -> Any:
    """Chapter 07: one graph captured per bucket; a batch pads up to its bucket and replays."""
    ex = graph_buckets_example()
    buckets, top = ex["buckets"], ex["buckets"][-1]
    fig, ax = canvas(top * 1.65, 6, (10.0, 3.4))
    x0 = top * 0.06
    ax.plot([x0, x0 + top], [4.2, 4.2], color="0.3", lw=1)
    for b in buckets:
        ax.plot([x0 + b, x0 + b], [4.0, 4.4], color=BOOK_COLORS[0], lw=1.5)
    for b in buckets:
        if b == 8 or b % 64 == 0:
            ax.text(x0 + b, 4.55, str(b), ha="center", fontsize=7)
    ax.text(x0, 4.55, "1 2 4", ha="right", fontsize=7)
    ax.text(x0, 5.3, f"capture (start-up): {len(buckets)} graphs, one per bucket "
            f"(batch_buckets({top}), max_num_seqs = {top}): 1, 2, 4, 8, then every 16",
            fontsize=8)
    from matplotlib.patches import Rectangle

    for row, (n, b) in enumerate(ex["replay"].items()):
        y = 2.9 - row * 0.75
        ax.add_patch(Rectangle((x0, y), n, 0.5, facecolor=BOOK_COLORS[2], alpha=0.7))
        ax.add_patch(Rectangle((x0 + n, y), b - n, 0.5, facecolor="0.85", hatch="///",
                               edgecolor="0.6", lw=0.5))
        ax.text(x0 + b + 2, y + 0.25, f"batch {n} -> replays graph {b} ({b - n} padded rows: "
                "slot -1, length 0)", va="center", fontsize=7.5)
    ax.text(x0, 3.55, "replay (every decode step): copy inputs into the static buffers, pad, "
            "one launch", fontsize=8)
    ax.set_title("CUDA graphs: capture per bucket, replay with padding", fontsize=10)
    return fig


# -- tensor-parallel sharding of one layer (chapter 09) --------------------------------------


def model_config(name: str) -> dict:
    """A shipped model config (``nanovllm/configs/<name>/config.json``)."""
    from nanovllm.configs import config_path

    return json.loads((config_path(name) / "config.json").read_text())


def tp_layer_shards(cfg: dict, tp: int) -> dict[str, tuple[int, int]]:
    """Each rank's weight shape ``[out, in]`` of one decoder layer's four projections:
    column-parallel (split the outputs) qkv and gate_up, row-parallel (split the inputs) o and
    down, the latter two followed by an all-reduce."""
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter = cfg["intermediate_size"]
    return {"qkv_proj": ((heads + 2 * kv) * head_dim // tp, hidden),
            "o_proj": (hidden, heads * head_dim // tp),
            "gate_up_proj": (2 * inter // tp, hidden),
            "down_proj": (hidden, inter // tp)}


def tp_diagram(model: str = "qwen3-0.6b", tp: int = 2) -> Any:
    """Chapter 09: one decoder layer split over ``tp`` ranks, with the real shapes."""
    cfg = model_config(model)
    shards = tp_layer_shards(cfg, tp)
    heads, kv = cfg["num_attention_heads"] // tp, cfg["num_key_value_heads"] // tp
    fig, ax = canvas(14, 0.6 + 1.9 * tp, (10.5, 0.5 + 1.3 * tp))
    steps = [("qkv_proj", "column"), ("attention", None), ("o_proj", "row"), ("all-reduce", None),
             ("gate_up_proj", "column"), ("SiLU x mul", None), ("down_proj", "row"),
             ("all-reduce", None)]
    width = 14 / len(steps)
    for r in range(tp):
        y = 0.4 + 1.9 * (tp - 1 - r)
        ax.text(0.0, y + 1.25, f"rank {r}: query heads {r * heads}-{(r + 1) * heads - 1}, "
                f"KV heads {r * kv}-{(r + 1) * kv - 1}", fontsize=7.5)
        for k, (name, kind) in enumerate(steps):
            x = k * width
            if name == "all-reduce":
                continue
            label = (f"{name}\n{kind}\n{list(shards[name])}" if kind else
                     f"{name}\n(local)")
            box(ax, x + 0.05, y, width - 0.25, 1.0, label, BOOK_COLORS[0 if kind == "column" else
                2 if kind == "row" else 5], alpha=0.35, fontsize=7)
            if k + 1 < len(steps) and steps[k + 1][0] != "all-reduce":
                arrow(ax, (x + width - 0.2, y + 0.5), (x + width + 0.05, y + 0.5))
    for k, (name, _) in enumerate(steps):
        if name == "all-reduce":
            x = k * width
            box(ax, x + 0.15, 0.4, width - 0.45, 1.9 * tp - 0.9, f"all-reduce\n(sum)\n[tokens, "
                f"{cfg['hidden_size']}]", BOOK_COLORS[3], alpha=0.3, fontsize=7)
    ax.set_title(f"One decoder layer of {model} at TP={tp} (weights [out, in] per rank); the "
                 "input and the output are whole on every rank", fontsize=9)
    return fig

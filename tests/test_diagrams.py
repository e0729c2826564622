"""The concept diagrams (nanovllm/viz/diagrams.py, kernel_diagrams.py), the numbered figures
(viz/figures.py), the roadmap boxes and the bibliography: each diagram draws on a CPU, what it
draws is what the package computes, every chapter 01-13 opens with its roadmap, every figure of
a chapter is numbered and captioned (shown through ``figure``), every figure number the text
names exists and sits beside its figure, and every citation is in
book/references.bib.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from nanovllm.viz import diagrams, figures, kernel_diagrams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


def book_file(name: str) -> str:
    """A file of book/, which a student edition does not ship (then the test skips)."""
    path = ROOT / "book" / name
    if not path.exists():
        pytest.skip(f"no book/{name} in this tree (a student edition ships no book/)")
    return path.read_text()

DIAGRAMS = [diagrams.engine_step_diagram, diagrams.request_path_diagram,
            diagrams.async_overlap_diagram, kernel_diagrams.block_table_diagram,
            kernel_diagrams.online_softmax_diagram, kernel_diagrams.split_kv_diagram,
            kernel_diagrams.cuda_graph_diagram, kernel_diagrams.tp_diagram]


def texts(fig) -> str:
    return "\n".join([t.get_text() for ax in fig.axes for t in ax.texts]
                     + [ax.get_title(loc) for ax in fig.axes for loc in ("left", "center")])


@pytest.mark.parametrize("draw", DIAGRAMS, ids=lambda f: f.__name__)
def test_each_diagram_draws_on_a_cpu(draw) -> None:
    fig = draw()
    fig.canvas.draw()
    assert fig.axes and fig.axes[0].patches, draw.__name__
    plt.close(fig)


def test_slot_ids_drawn_are_the_package_slot_mapping() -> None:
    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.step import pack_step
    from nanovllm.sampling_params import SamplingParams

    ex = kernel_diagrams.block_table_example()
    bs = ex["block_size"]
    assert bs == kernel_diagrams._default("block_size") == 16
    seqs = []
    for name, table in ex["tables"].items():
        seq = Sequence(list(range(ex["filled"][name])), SamplingParams())
        seq.num_computed_tokens, seq.block_table = ex["filled"][name] - 1, table
        seqs.append(seq)
    expected = pack_step(seqs, [1] * len(seqs), bs, {})["slot_mapping"]
    assert list(ex["slot_mapping"].values()) == expected
    # and by the formula, independently
    for name, slot in ex["slot_mapping"].items():
        p = ex["positions"][name]
        assert slot == ex["tables"][name][p // bs] * bs + p % bs
    # The prose of chapter 04 says D's table starts at B's freed block, 2.
    assert ex["tables"]["D"][0] == 2 and "B" not in ex["tables"]
    fig = kernel_diagrams.block_table_diagram()
    assert f"slot_mapping = {expected}" in texts(fig)
    plt.close(fig)


def test_graph_buckets_drawn_are_the_runners() -> None:
    import torch

    from nanovllm.config import EngineConfig
    from nanovllm.context import AttentionMetadata
    from nanovllm.engine.cuda_graphs import StaticInputs, batch_buckets

    ex = kernel_diagrams.graph_buckets_example()
    default = EngineConfig.__dataclass_fields__["max_num_seqs"].default
    assert ex["buckets"] == batch_buckets(default)
    inputs = StaticInputs(ex["buckets"], max_blocks=1, device=torch.device("cpu"))
    for n, bucket in ex["replay"].items():
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(n, dtype=torch.int64),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
            seq_lens_k=torch.ones(n, dtype=torch.int32),
            block_tables=torch.zeros(n, 1, dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=1,
            num_decodes=n, cu_seqlens_q_host=list(range(n + 1)), seq_lens_k_host=[1] * n)
        ids = torch.zeros(n, dtype=torch.int64)
        assert inputs.fill(ids, ids.clone(), meta) == bucket, n
    fig = kernel_diagrams.cuda_graph_diagram()
    assert f"{len(ex['buckets'])} graphs" in texts(fig)
    plt.close(fig)


def test_tp_shards_drawn_are_the_layers_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanovllm import distributed
    from nanovllm.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    cfg = kernel_diagrams.model_config("qwen3-0.6b")
    monkeypatch.setitem(distributed._state, "size", 2)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    layers = {
        "qkv_proj": QKVParallelLinear(h, d, cfg["num_attention_heads"],
                                      cfg["num_key_value_heads"]),
        "o_proj": RowParallelLinear(cfg["num_attention_heads"] * d, h),
        "gate_up_proj": MergedColumnParallelLinear(h, [cfg["intermediate_size"]] * 2),
        "down_proj": RowParallelLinear(cfg["intermediate_size"], h),
    }
    shards = kernel_diagrams.tp_layer_shards(cfg, 2)
    for name, layer in layers.items():
        assert tuple(layer.weight.shape) == shards[name], name
    fig = kernel_diagrams.tp_diagram()
    assert str(list(shards["down_proj"])) in texts(fig)
    plt.close(fig)


def test_split_kv_drawn_is_the_kernels_choice() -> None:
    from nanovllm.kernels.split_kv import choose_num_splits

    ex = kernel_diagrams.split_kv_example(16, 2048)
    assert ex["num_splits"] == choose_num_splits(16, 8, 2048, kernel_diagrams.h200_sms()) == 5
    # the splits cover the keys end to end, each a whole number of key tiles but the last
    assert ex["ranges"][0][0] == 0 and ex["ranges"][-1][1] == 2048
    assert all(a[1] == b[0] for a, b in zip(ex["ranges"], ex["ranges"][1:]))
    assert all(hi > lo for lo, hi in ex["ranges"])


def test_tiles_drawn_are_the_kernels_and_the_mask_is_right() -> None:
    import torch

    from nanovllm.kernels.launch_config import prefill_tiles

    ex = kernel_diagrams.tiling_example(256, 128)
    assert (ex["block_m"], ex["block_n"]) == prefill_tiles(128, torch.device("cuda"))[:2]
    mask = torch.ones(256, 256).tril().bool()
    for (i, j), kind in ex["kinds"].items():
        tile = mask[i * ex["block_m"]:(i + 1) * ex["block_m"],
                    j * ex["block_n"]:(j + 1) * ex["block_n"]]
        assert kind == ("full" if tile.all() else "skipped" if not tile.any() else "masked")


def test_engine_step_and_request_path_names_come_from_the_package() -> None:
    names = diagrams.engine_step_names()
    assert names["schedule"] == "Scheduler.schedule" and names["pack"] == "pack_step"
    steps = diagrams.request_path_steps()
    assert [codes for _, codes in steps][:5] == [[401, 503, 429], [413, 415, 400, 404], [429],
                                                 [400, 429], [503]]
    assert steps[0][0].startswith("enter: authenticate")


def test_async_diagram_reads_the_record() -> None:
    record = {"device": "Test GPU", "runs": [
        {"async_scheduling": False, "batch": 8, "ms_per_step": 10.0, "gpu_busy_fraction": 0.6,
         "cpu_ms_per_step": {"schedule": 1.0, "launch": 2.0, "wait for tokens": 5.0,
                             "apply tokens": 6.0}},
        {"async_scheduling": True, "batch": 8, "ms_per_step": 7.0, "gpu_busy_fraction": 0.9,
         "cpu_ms_per_step": {}}]}
    assert diagrams.async_phases(record) == {"schedule": 1.0, "launch": 2.0, "apply": 1.0,
                                             "gpu": 6.0}
    fig = diagrams.async_overlap_diagram(record)
    assert "10.0 ms per step measured" in texts(fig) and "Test GPU" in texts(fig)
    plt.close(fig)


@pytest.mark.parametrize("chapter", range(1, 14))
def test_roadmap_highlights_something(chapter: int) -> None:
    assert diagrams.roadmap_components(chapter)
    fig = diagrams.roadmap(chapter)
    assert f"chapter {chapter:02d}" in texts(fig)
    plt.close(fig)


def test_figure_numbers_per_chapter() -> None:
    figures._numbers.clear()
    assert figures.caption_text("04_a", "A.") == "**Figure 4.1.** A."
    assert figures.figure_number("04_b") == "4.2"
    assert figures.figure_number("04_a") == "4.1"  # a re-run keeps its number
    assert figures.figure_number("11_a") == "11.1"
    with pytest.raises(ValueError):
        figures.figure_number("block_table")
    figures._numbers.clear()


# -- the chapters ----------------------------------------------------------------------------


def markdown_cells(source: str) -> list[str]:
    return [c for c in re.split(r"^# %%", source, flags=re.M) if c.startswith(" [markdown]")]


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.name[:2] != "00"],
                         ids=lambda p: p.stem)
def test_every_chapter_opens_with_its_roadmap(path: Path) -> None:
    cells = re.split(r"^# %%", path.read_text(), flags=re.M)
    title = next(i for i, c in enumerate(cells) if re.search(r"^# # Chapter", c, re.M))
    assert f"show_roadmap({int(path.name[:2])})" in cells[title + 1], path.name


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_figure_references_exist_and_sit_beside_their_figure(path: Path) -> None:
    source = path.read_text()
    numbers = figures.chapter_figure_numbers(path)
    chapter = int(path.name[:2])
    for cell in markdown_cells(source):
        for n in re.findall(r"Figure (\d+\.\d+)", cell):
            assert n.startswith(f"{chapter}.") and n in numbers.values(), (path.name, n)
    # The text beside each figure(...) cell names that figure's number: the nearest markdown
    # cell before it (which introduces it) or after it (which reads it).
    cells = re.split(r"^# %%", source, flags=re.M)
    for i, cell in enumerate(cells):
        beside = [next((c for c in reversed(cells[:i]) if c.startswith(" [markdown]")), ""),
                  next((c for c in cells[i + 1:] if c.startswith(" [markdown]")), "")]
        for label in figures.figure_labels(cell):
            assert any(f"Figure {numbers[label]}" in c for c in beside), (path.name, label)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_is_numbered_and_captioned(path: Path) -> None:
    """A chapter shows its figures through figure(...), never save_figure(...) alone, so every
    figure of the book has a number the text can name and a caption under it."""
    source = path.read_text()
    assert not re.search(r"\bsave_figure\(", source), path.name
    shown = re.findall(r"^\s*figure\(", source, flags=re.M)
    assert len(shown) == len(figures.figure_labels(source)), (path.name, "label not a literal")


def test_every_citation_is_in_the_bibliography() -> None:
    bib = book_file("references.bib")
    keys = set(re.findall(r"^@\w+\{([^,]+),", bib, flags=re.M))
    cited = set()
    for path in [*CHAPTERS, *(ROOT / "book").glob("*.md")]:
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", path.read_text()):
            cited |= {k.strip() for k in group.split(",")}
    assert cited, "no chapter cites anything"
    assert cited <= keys, sorted(cited - keys)
    assert len(keys) == len(re.findall(r"^@\w+\{", bib, flags=re.M)), "a key appears twice"


def test_the_book_is_wired_to_the_bibliography() -> None:
    config = book_file("_config.yml")
    assert re.search(r"^bibtex_bibfiles:\s*\[references\.bib\]", config, re.M)
    assert "file: bibliography" in book_file("_toc.yml")
    assert "{bibliography}" in book_file("bibliography.md")

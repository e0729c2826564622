"""The recorded measurements the chapters read: ``figures/data/*.json``, and which record holds
the one current value of each headline quantity (every chapter; the check is
``tests/test_book_truth.py``).

A number typed in prose goes stale the day the engine or the machine changes; a number read
from a record changes with it. Where several records measured the same thing (the H200's copy
bandwidth is measured by five tools, a little differently each time), ``HEADLINES`` names the
one every chapter quotes, so the book never shows two values for one quantity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nanovllm.viz.style import figures_dir


def records_dir() -> Path:
    """The repository's ``figures/data/``, where every measuring tool's JSON is kept."""
    return figures_dir() / "data"


def load_record(name: str) -> dict:
    """The record ``figures/data/<name>`` (device, date, command and the measured values)."""
    return json.loads((records_dir() / name).read_text())


@dataclass(frozen=True)
class Headline:
    """Where the current value of one quantity lives: ``record``'s ``field`` (keys joined by
    dots; list indices allowed), and the command that measures it again."""

    record: str
    field: str
    unit: str  # the unit ``current`` prints, after ``scale``
    command: str
    scale: float = 1.0  # the record's value times this is in ``unit``
    digits: int = 0  # decimals a chapter prints


HEADLINES: dict[str, Headline] = {
    # Qwen3-0.6B shapes, random bf16 weights, the nano-vllm workload, one H200, defaults of today.
    "h200_qwen3_0.6b_tok_s": Headline(
        "bench_h200.json", "nanovllm_tok_s", "tok/s",
        "python -m nanovllm.benchmarks.throughput --model qwen3-0.6b"),
    "h200_qwen3_0.6b_fraction_of_bound": Headline(
        "bench_h200.json", "fraction_of_bound", "%",
        "python -m nanovllm.benchmarks.throughput --model qwen3-0.6b", scale=100),
    # One decode step of Qwen3-0.6B at batch 1, context 1024, replayed from a CUDA graph with
    # the fused kernels (chapter 07's record; chapters 08, 09 and 11 compare with it).
    "h200_qwen3_0.6b_graph_decode_step_batch1": Headline(
        "cuda_graphs_h200.json", "rows.0.graphs_ms", "ms",
        "python -m nanovllm.bench --decode-step", digits=2),
    # A device-to-device copy, bytes read + written: the ceiling every memory-bound kernel and
    # every bandwidth bound in the book is measured against (chapters 02, 05, 07, 08, 11).
    "h200_copy_bytes_per_s": Headline(
        "peaks_h200.json", "copy_bytes_per_s", "TB/s",
        "python -m nanovllm.benchmarks.peaks", scale=1e-12, digits=2),
    # bf16 8192^3 torch.matmul: the compute roof (chapters 02, 05, 08, 11).
    "h200_bf16_matmul_flops": Headline(
        "peaks_h200.json", "bf16_matmul_flops_per_s", "TFLOP/s",
        "python -m nanovllm.benchmarks.peaks", scale=1e-12),
}

# Quantities whose record has not been measured yet: the value the chapters quote until it is,
# stated as unrecorded wherever it is printed. Remove an entry when its record lands.
PENDING: dict[str, float] = {}


def headline(name: str) -> float:
    """The current value of a headline quantity (see ``HEADLINES``) as its record holds it (not
    scaled to ``unit``); a quantity in ``PENDING`` whose record is missing gives the pending
    value."""
    spec = HEADLINES[name]
    path = records_dir() / spec.record
    if not path.exists() and name in PENDING:
        return PENDING[name]
    return field_value(load_record(spec.record), spec.field)


def current(name: str) -> str:
    """The current value of a headline quantity as a chapter prints it beside another
    record's measurement of the same thing: value, unit, record and date."""
    spec = HEADLINES[name]
    value = headline(name) * spec.scale
    date = str(load_record(spec.record).get("date", "undated"))[:10] if is_recorded(name) else (
        "not recorded yet")
    unit = spec.unit if spec.unit in ("", "%") else f" {spec.unit}"
    return f"{value:,.{spec.digits}f}{unit} ({spec.record}, {date})"


def is_recorded(name: str) -> bool:
    """Whether ``headline(name)`` comes from its record (False: the pending value)."""
    return (records_dir() / HEADLINES[name].record).exists()


def field_value(record: dict, field: str) -> float:
    """``record``'s value at the dotted path ``field`` (``"runs.0.tok_s"``)."""
    value = record
    for key in field.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value

"""Concept diagrams of the engine's flow, drawn by code so that they stay true (chapters 00,
06, 10, 11 and the "where we are" box at the top of chapters 01-13).

Each function returns a matplotlib Figure and draws the same picture every time. The names on
the boxes are read from the package (a method's ``__qualname__``, the server's request path from
``nanovllm/serve/serving.py``'s docstring, the async-scheduling timeline from the H200 profile
record), so renaming a method or adding a step to the server changes the picture, or breaks
tests/test_diagrams.py, instead of leaving a stale drawing. The kernel and memory diagrams
(chapters 02, 04, 05, 07, 09) are in ``kernel_diagrams.py``; both share ``box`` and ``arrow``.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

from nanovllm.viz.style import BOOK_COLORS, book_style

GREY = "0.85"
HIGHLIGHT = BOOK_COLORS[1]


def canvas(width: float, height: float, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A figure with one axis-free drawing area of ``width`` x ``height`` data units."""
    import matplotlib.pyplot as plt

    with book_style():
        fig, ax = plt.subplots(figsize=figsize)
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax: Any, x: float, y: float, w: float, h: float, text: str, color: str = GREY,
        fontsize: float = 9, alpha: float = 1.0, **kw: Any) -> None:
    """A rounded box with its lower-left corner at (x, y) and centred text."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="0.25", lw=0.9, alpha=alpha, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], text: str = "",
          color: str = "0.2", fontsize: float = 8, curve: float = 0.0) -> None:
    """An arrow from ``start`` to ``end``, labelled at its middle."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(
        arrowstyle="-|>", color=color, lw=1.2, shrinkA=2, shrinkB=2,
        connectionstyle=f"arc3,rad={curve}"))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2, text, ha="center",
                va="center", fontsize=fontsize, color=color,
                bbox=dict(facecolor="white", edgecolor="none", pad=1.0))


# -- one engine step (chapter 00) ------------------------------------------------------------


def engine_step_names() -> dict[str, str]:
    """The three calls of one ``LLMEngine.step`` and the pieces between them, by their names in
    the package (a rename breaks this, and the test, not the picture)."""
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.model_runner import ModelRunner
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.step import pack_step

    return {
        "step": LLMEngine.step.__qualname__,
        "schedule": Scheduler.schedule.__qualname__,
        "execute": ModelRunner.launch.__qualname__,
        "pack": pack_step.__name__,
        "update": Scheduler.update_from_output.__qualname__,
        "allocate": BlockManager.allocate.__qualname__,
    }


def engine_step_diagram() -> Any:
    """Chapter 00: one engine step, schedule -> execute -> update, and what flows between."""
    n = engine_step_names()
    fig, ax = canvas(13.4, 5.6, (10.0, 4.2))
    kw = dict(fontsize=8.5)
    box(ax, 0.1, 4.0, 2.7, 1.0, "requests\n(prompts,\nSamplingParams)", **kw)
    box(ax, 3.5, 4.0, 3.0, 1.0, f"1. schedule\n{n['schedule']}", BOOK_COLORS[5], alpha=0.6, **kw)
    box(ax, 7.4, 4.0, 3.0, 1.0, f"2. execute\n{n['execute']}", BOOK_COLORS[2], alpha=0.5, **kw)
    box(ax, 7.4, 0.5, 3.0, 1.0, f"3. update\n{n['update']}", BOOK_COLORS[1], alpha=0.6,
        fontsize=7.5)
    box(ax, 3.5, 2.2, 3.0, 1.0, f"block manager\n{n['allocate']}", GREY, **kw)
    box(ax, 11.1, 2.2, 2.2, 1.0, "KV cache\n(every layer's\nK and V)", GREY, **kw)
    box(ax, 11.1, 4.0, 2.2, 1.0, "model forward\n+ sampler", BOOK_COLORS[2], alpha=0.3, **kw)
    box(ax, 0.1, 0.5, 2.7, 1.0, "outputs\n(new tokens,\nfinished requests)", **kw)
    arrow(ax, (2.8, 4.5), (3.5, 4.5))
    ax.text(3.15, 5.1, "waiting", ha="center", fontsize=8)
    arrow(ax, (5.0, 4.0), (5.0, 3.2), "slots for\nnew tokens")
    arrow(ax, (6.5, 4.5), (7.4, 4.5))
    ax.text(6.95, 5.1, "SchedulerOutput", ha="center", fontsize=8)
    arrow(ax, (10.4, 4.5), (11.1, 4.5))
    arrow(ax, (12.2, 4.0), (12.2, 3.2), "write K, V\nat slot_mapping")
    arrow(ax, (8.9, 4.0), (8.9, 1.5), f"{n['pack']}: input_ids, positions,\nslot_mapping, "
          "block tables;\nback: sampled token ids")
    arrow(ax, (7.4, 0.85), (2.8, 0.85), "append tokens, stop checks")
    arrow(ax, (7.4, 1.3), (6.0, 2.2), "free finished")
    ax.set_title(f"One call of {n['step']}; the engine calls it again and again", fontsize=11)
    return fig


# -- the roadmap box at the top of chapters 01-13 --------------------------------------------

# (label, x, y, w, h, chapters that build or change it); the engine as chapter 00 draws it.
COMPONENTS: list[tuple[str, float, float, float, float, tuple[int, ...]]] = [
    ("HTTP server\n(OpenAI API)", 0.1, 2.3, 1.9, 0.9, (10, 15, 17)),
    ("async engine,\nengine loop", 2.3, 2.3, 1.9, 0.9, (6, 10, 11)),
    ("scheduler\n+ policies", 4.5, 2.3, 1.9, 0.9, (6, 13, 14)),
    ("block manager,\nprefix cache", 6.7, 2.3, 1.9, 0.9, (4, 13)),
    ("tensor-parallel\nworkers", 8.9, 2.3, 1.9, 0.9, (9, 17)),
    ("model runner,\nCUDA graphs", 0.1, 0.9, 1.9, 0.9, (4, 7, 11, 14)),
    ("model layers,\nRoPE, new models", 2.3, 0.9, 1.9, 0.9, (1, 12, 16)),
    ("quantized\nlinears", 4.5, 0.9, 1.9, 0.9, (8,)),
    ("attention\nkernels", 6.7, 0.9, 1.9, 0.9, (2, 5, 12)),
    ("KV cache", 8.9, 0.9, 1.9, 0.9, (3, 4, 8)),
    ("sampler", 0.1, -0.4, 1.9, 0.8, (1, 14, 15)),
]
ROADMAP_TITLES = {
    1: "the model and the sampler", 2: "attention", 3: "the KV cache",
    4: "the block manager and prefix caching", 5: "the paged attention kernel",
    6: "the scheduler", 7: "CUDA graphs", 8: "quantization", 9: "tensor parallelism",
    10: "serving", 11: "performance", 12: "long context and new models",
    13: "troubleshooting: the invariants of the bookkeeping", 14: "speculative decoding",
    15: "structured output", 16: "mixture of experts",
    17: "deployment: images, Kubernetes, Ray, routing, capacity",
}


def roadmap_components(chapter: int) -> list[str]:
    """The components (labels, one line) that ``chapter`` builds or changes."""
    return [label.replace("\n", " ") for label, *_, chapters in COMPONENTS if chapter in chapters]


def roadmap(chapter: int) -> Any:
    """The "where we are" box: the engine, this chapter's parts highlighted."""
    if chapter not in ROADMAP_TITLES:
        raise ValueError(f"no roadmap for chapter {chapter}; chapters {sorted(ROADMAP_TITLES)}")
    fig, ax = canvas(11, 3.6, (7.5, 2.5))
    ax.set_ylim(-0.5, 3.6)
    for label, x, y, w, h, chapters in COMPONENTS:
        here = chapter in chapters
        box(ax, x, y, w, h, label, HIGHLIGHT if here else "0.93", fontsize=7.5,
            alpha=1.0 if here else 0.9)
    ax.text(2.2, -0.05, "chapter 00 draws one step of this engine; "
            "highlighted: what this chapter builds", fontsize=7.5, color="0.35", va="center",
            ha="left")
    ax.set_title(f"Where we are: chapter {chapter:02d}, {ROADMAP_TITLES[chapter]}",
                 fontsize=10, loc="left")
    return fig


def show_roadmap(chapter: int) -> None:
    """Draw and show ``roadmap(chapter)`` once (the first code cell of chapters 01-13)."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    fig = roadmap(chapter)
    display(fig)
    plt.close(fig)


# -- the server's request path (chapter 10) --------------------------------------------------


def request_path_steps() -> list[tuple[str, list[int]]]:
    """The numbered steps of ``nanovllm/serve/serving.py``'s docstring: (what the step does,
    the HTTP statuses it answers with when it turns the request away)."""
    from nanovllm.serve import serving

    text = serving.__doc__ or ""
    steps = re.findall(r"^(\d)\. (.+?)(?=^\d\. |^\s*$)", text, flags=re.M | re.S)
    out = []
    for _, body in steps:
        body = " ".join(body.split())
        codes = [int(c) for c in re.findall(r"\((\d{3})\b", body)]
        words = re.sub(r"\s*\(\d{3}[^)]*\)", "", body).replace("``", "").split(" -- ")[0]
        out.append((words.rstrip(";.:, "), codes))
    return out


def request_path_diagram() -> Any:
    """Chapter 10: a request's way through the server to the engine and back."""
    steps = request_path_steps()
    fig, ax = canvas(12, len(steps) + 2.2, (9.0, 0.62 * (len(steps) + 2.2)))
    top = len(steps) + 1.2
    box(ax, 0.1, top - 0.45, 2.0, 0.8, "client\n(HTTP POST)")
    for i, (words, codes) in enumerate(steps):
        y = top - 1.0 - i
        box(ax, 2.8, y - 0.38, 5.0, 0.76, f"{i + 1}. " + textwrap.fill(words, 52), BOOK_COLORS[5],
            fontsize=7.5, alpha=0.35)
        if codes:
            arrow(ax, (7.8, y + 0.15), (9.0, y + 0.15), color=BOOK_COLORS[3])
            ax.text(9.1, y + 0.15, " / ".join(map(str, codes)), va="center", fontsize=8,
                    color=BOOK_COLORS[3])
        if i:
            arrow(ax, (5.3, y + 0.62), (5.3, y + 0.38))
    arrow(ax, (2.1, top), (2.8, top - 1.0), "request")
    engine_y = top - len(steps) - 0.5
    box(ax, 9.9, engine_y + 0.6, 2.0, 2.2,
        "AsyncEngine:\nengine thread\nsteps; tokens\nback through\nasyncio queues",
        BOOK_COLORS[2], fontsize=7.5, alpha=0.35)
    arrow(ax, (7.8, top - len(steps) + 0.8), (9.9, engine_y + 1.6), "submit", curve=0.1)
    arrow(ax, (9.9, engine_y + 1.0), (7.8, top - len(steps)), "tokens", curve=-0.2)
    arrow(ax, (2.8, top - len(steps)), (1.1, top - 0.45), "JSON or SSE", curve=-0.3)
    ax.text(9.1, top - 0.2, "turned away:\nHTTP status", fontsize=8, color=BOOK_COLORS[3])
    ax.set_title("A request's path through nanovllm serve (nanovllm/serve/serving.py)",
                 fontsize=10)
    return fig


# -- async scheduling (chapter 11) -----------------------------------------------------------


def async_phases(record: dict) -> dict[str, float]:
    """Per-step milliseconds of the synchronous loop, from a profile record
    (``figures/data/profile_h200.json``: the run with ``async_scheduling`` off): the CPU's
    schedule and launch (prepare included), its work on the tokens after they arrive, and the
    GPU's busy time."""
    run = next(r for r in record["runs"] if not r["async_scheduling"])
    cpu = run["cpu_ms_per_step"]
    return {
        "schedule": cpu["schedule"],
        "launch": cpu["launch"],
        "apply": cpu["apply tokens"] - cpu["wait for tokens"],
        "gpu": run["ms_per_step"] * run["gpu_busy_fraction"],
    }


def async_overlap_diagram(record: dict | None = None, steps: int = 3) -> Any:
    """Chapter 11: CPU and GPU lanes with async scheduling off and on, ``steps`` steps each.
    Bar lengths: the phases of the synchronous run of ``record`` (default the H200 profile),
    laid end to end, and the same work overlapped (a step then takes the longer of the CPU's
    and the GPU's part); the captions quote the step times both runs measured."""
    if record is None:
        from nanovllm.viz.records import load_record

        record = load_record("profile_h200.json")
    p = async_phases(record)
    measured = {r["async_scheduling"]: r["ms_per_step"] for r in record["runs"]}
    cpu_step = p["schedule"] + p["launch"] + p["apply"]
    sync_step = cpu_step + p["gpu"]
    async_step = max(cpu_step, p["gpu"])
    width = steps * sync_step
    fig, ax = canvas(width * 1.12, 5.2, (9.5, 3.4))
    lanes = {("off", "CPU"): 4.1, ("off", "GPU"): 3.3, ("on", "CPU"): 1.6, ("on", "GPU"): 0.8}
    colors = {"schedule": BOOK_COLORS[5], "launch": BOOK_COLORS[0], "apply": BOOK_COLORS[1]}
    x0 = 0.12 * width

    def bar(mode: str, lane: str, start: float, length: float, color: str, label: str) -> None:
        from matplotlib.patches import Rectangle

        y = lanes[(mode, lane)]
        ax.add_patch(Rectangle((x0 + start, y), length, 0.6, facecolor=color, edgecolor="white",
                               alpha=0.85))
        if length > 0.08 * sync_step:
            ax.text(x0 + start + length / 2, y + 0.3, label, ha="center", va="center",
                    fontsize=7, color="white")

    for k in range(steps):
        t = k * sync_step  # synchronous: CPU, then GPU, then CPU again
        bar("off", "CPU", t, p["schedule"], colors["schedule"], "")
        bar("off", "CPU", t + p["schedule"], p["launch"], colors["launch"], f"launch {k}")
        bar("off", "GPU", t + p["schedule"] + p["launch"], p["gpu"], BOOK_COLORS[2], f"step {k}")
        bar("off", "CPU", t + cpu_step - p["apply"] + p["gpu"], p["apply"], colors["apply"], "")
        t = k * async_step  # async: step k+1 is planned and launched while step k runs
        bar("on", "CPU", t, p["schedule"], colors["schedule"], "")
        bar("on", "CPU", t + p["schedule"], p["launch"], colors["launch"], f"launch {k}")
        bar("on", "CPU", t + p["schedule"] + p["launch"], p["apply"], colors["apply"], "")
        bar("on", "GPU", t + p["schedule"] + p["launch"], p["gpu"], BOOK_COLORS[2], f"step {k}")
    for (mode, lane), y in lanes.items():
        ax.text(x0 - 0.01 * width, y + 0.3, f"async {mode}: {lane}", ha="right", va="center",
                fontsize=8)
    ax.text(x0, 4.95, f"async off: {measured[False]:.1f} ms per step measured "
            "(the GPU waits while the CPU works)", fontsize=8)
    ax.text(x0, 2.45, f"async on: {measured[True]:.1f} ms per step measured "
            "(the CPU plans step n+1 while the GPU runs step n)", fontsize=8)
    batch = next(r for r in record["runs"] if not r["async_scheduling"])["batch"]
    ax.text(x0, -0.1, "light blue: schedule | blue: prepare + launch | orange: apply the tokens "
            "(async: those of the step before) | green: GPU\nbar lengths: the synchronous "
            f"run's phases, {record['device']}, batch {batch} (figures/data/profile_h200.json)",
            fontsize=7, color="0.35")
    return fig

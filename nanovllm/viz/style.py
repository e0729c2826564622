"""The book's figure style, shared by every chapter (00-11).

A chapter calls `use_book_style()` once (or plots inside `with book_style():`), draws, and shows
the figure with `figure(fig, "04_prefix_cache_hits", caption)` (`figures.py`), which numbers it
and calls `save_figure` here to write `figures/04_prefix_cache_hits.png`.
One style for the whole book: readable fonts, a light grid, and a fixed colour cycle, so a colour
means the same thing from figure to figure (e.g. "ours" is always the first colour).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Okabe-Ito: distinguishable with the common colour-vision deficiencies and in greyscale print.
# Yellow comes last because it is faint on white.
BOOK_COLORS = [
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#D55E00",
    "#CC79A7",
    "#56B4E9",
    "#000000",
    "#F0E442",
]


def book_rc() -> dict[str, Any]:
    """The rcParams of the book style (needs matplotlib, imported here and not at module load)."""
    from cycler import cycler  # ships with matplotlib

    return {
        "figure.dpi": 110,
        "savefig.dpi": 110,
        "figure.figsize": (6.4, 3.6),
        "savefig.bbox": "tight",
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "legend.fontsize": 10,
        "xtick.labelsize": 10,
        "ytick.labelsize": 10,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.prop_cycle": cycler(color=BOOK_COLORS),
        "lines.linewidth": 2.0,
        "legend.frameon": False,
    }


def use_book_style() -> None:
    """Switch the book style on for the rest of the session (a chapter's first plotting cell)."""
    import matplotlib

    matplotlib.rcParams.update(book_rc())


@contextlib.contextmanager
def book_style() -> Iterator[None]:
    """Plot in the book style inside a `with` block only; the previous style comes back after."""
    import matplotlib

    with matplotlib.rc_context(book_rc()):
        yield


def figures_dir(start: Path | None = None) -> Path:
    """The repository's `figures/` folder.

    Found by walking up from `start` (default: the current directory, `chapters/` when a notebook
    runs) to the first folder that holds both `figures/` and `nanovllm/`. Outside a checkout there
    is none, and this raises rather than write figures somewhere unexpected.
    """
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "figures").is_dir() and (folder / "nanovllm").is_dir():
            return folder / "figures"
    raise FileNotFoundError(
        f"no figures/ folder beside nanovllm/ in {here} or above it: the book's figures live in "
        "the repository, so run from inside a checkout (a chapter runs in chapters/)"
    )


def save_figure(fig: Any, name: str) -> Path:
    """Write `fig` to `figures/<name>.png` and return the path; the figure stays open for display.

    The PNG carries no matplotlib version stamp, so re-running a chapter with another matplotlib
    does not change a committed figure whose pixels are the same. With
    ``NANOVLLM_KEEP_FIGURES=1`` (set by ``make test``) nothing is written: checking the notebooks
    must not overwrite the committed figures with the test run's timings.
    """
    path = figures_dir() / f"{name.removesuffix('.png')}.png"
    if os.environ.get("NANOVLLM_KEEP_FIGURES") == "1":
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    return path

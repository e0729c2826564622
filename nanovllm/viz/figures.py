"""Numbered, captioned figures: ``figure(fig, "04_block_table", "Block tables ...")`` shows
the figure with "**Figure 4.1.** Block tables ..." under it, in the notebook and in the
rendered book alike (a Markdown output, which Jupyter and jupyter-book both render).

A figure's number is its place among the chapter's figures, in the order the chapter shows
them; the chapter is the label's two-digit prefix. The text beside a figure names it by that
number ("Figure 4.1 shows ..."); tests/test_diagrams.py reads every chapter's ``figure(...)``
calls in order (``figure_labels``) and checks each "Figure N.M" of its markdown against them,
so a figure inserted or removed above cannot leave a reference pointing at the wrong picture.
Every figure of every chapter goes through ``figure`` (tests/test_diagrams.py fails on a chapter
that calls ``save_figure`` itself), the concept diagrams (``diagrams.py``) and the data figures
alike.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nanovllm.viz.style import save_figure

_LABEL = re.compile(r"^(\d\d)_[a-z0-9_]+$")
# The figure(...) calls of a chapter's source, in order: the label is always a literal string.
_CALL = re.compile(r"^\s*figure\(\s*\w+\s*,\s*[\"'](\d\d_[a-z0-9_]+)[\"']", re.M)

_numbers: dict[str, dict[str, int]] = {}  # chapter "04" -> label -> its number in the chapter


def figure_number(label: str) -> str:
    """"4.2" for the second figure shown in chapter 04 (the label's prefix); a label shown
    again (a re-run cell) keeps its number."""
    match = _LABEL.match(label)
    if match is None:
        raise ValueError(f"figure label {label!r}: want NN_lowercase_words, NN the chapter")
    chapter = match.group(1)
    seen = _numbers.setdefault(chapter, {})
    number = seen.setdefault(label, len(seen) + 1)
    return f"{int(chapter)}.{number}"


def caption_text(label: str, caption: str) -> str:
    """The Markdown line shown under the figure: bold number, then the caption."""
    return f"**Figure {figure_number(label)}.** {caption.strip()}"


def figure(fig: Any, label: str, caption: str, save: bool = True) -> None:
    """Show ``fig`` with its number and caption under it, and (``save``) write it to
    ``figures/<label>.png`` like every figure of the book (``save_figure``).

    The figure is displayed once and closed, so the notebook's inline backend does not show it
    a second time at the end of the cell.
    """
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    text = caption_text(label, caption)
    if save:
        save_figure(fig, label)
    display(fig)
    plt.close(fig)
    display(Markdown(text))


def figure_labels(chapter_source: str) -> list[str]:
    """The labels of a chapter's ``figure(...)`` calls, in order: label i is Figure N.(i+1)."""
    return _CALL.findall(chapter_source)


def chapter_figure_numbers(path: Path) -> dict[str, str]:
    """Label -> "N.M" for the chapter source ``path`` (chapters/NN_name.py), as shown when run."""
    chapter = int(path.name[:2])
    return {label: f"{chapter}.{i}"
            for i, label in enumerate(figure_labels(path.read_text()), start=1)}

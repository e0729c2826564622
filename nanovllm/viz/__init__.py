"""Plotting helpers the chapters share; the engine itself never imports this package.

`style` holds the book's one figure style and `save_figure`, which writes a figure into the
repository's `figures/` folder. matplotlib is imported only when a helper runs, so
`import nanovllm.viz` works without it. `show_source` renders package code in a chapter.
`figure`, through which every chapter shows every figure, numbers and captions it ("Figure 4.1.
...") and saves it; the concept diagrams and the "where we are" box are in `diagrams` and
`kernel_diagrams`.
"""

from nanovllm.viz.figures import figure
from nanovllm.viz.source import show_source
from nanovllm.viz.style import BOOK_COLORS, book_style, figures_dir, save_figure, use_book_style

__all__ = [
    "BOOK_COLORS",
    "book_style",
    "figure",
    "figures_dir",
    "save_figure",
    "show_source",
    "use_book_style",
]

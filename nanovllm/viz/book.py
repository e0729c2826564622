"""The rendered book (``make book``): stage its sources and fill in the generated parts.

jupyter-book (v1) builds from one folder, so this module copies into a staging folder what the
book is made of: ``book/`` (config, table of contents, landing page, notation, glossary), the
executed notebooks ``chapters/NN_*.ipynb`` with their committed outputs (the book never runs
them; the staged copies lose the ``# NBVAL_*`` lines that steer the notebook tests, which a
reader has no use for, and their widget state and widget views, which would make the page load
require.js and a widget manager from a CDN to show nothing), and writes into the landing page the
two parts that must not be typed by hand: the chapter map (titles read from the notebooks) and
the runtime table (read from the notebooks' execution metadata: nbclient records when each cell
started and finished). GPU runtimes come from executed copies under
``figures/data/gpu_runs/NN_name.<device>.ipynb`` where a GPU run was recorded.

The rest is done while Sphinx builds (nanovllm/viz/book_sphinx.py, named in book/_config.yml):
links for the chapters' cross-references and glossary terms, figure captions as alt text,
author–year bibliography labels and a local MathJax. Each chapter's roadmap image, which has no
caption, is given its alt text here.

    python -m nanovllm.viz.book --stage build/book_src --build build/book [--root .]

run from the repository (or given its folder with ``--root``), writes the HTML to
build/book/_build/html. The engine never imports this; see the Makefile's ``book`` target and
tests/test_book.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MAP_MARK = "<!-- chapter-map -->"
# A comment line that tells nbval how to compare a cell (`# NBVAL_CHECK_OUTPUT`, ...).
NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_\w+[ \t]*(?:\n|$)", re.M)
RUNTIME_MARK = "<!-- runtime-table -->"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@dataclass
class ChapterInfo:
    stem: str  # e.g. "04_block_manager"
    number: str  # "04"
    title: str  # the notebook's first heading, without "Chapter NN —"
    cpu_seconds: float | None  # wall time of the committed execution
    gpu_seconds: dict[str, float]  # device name -> wall time of a recorded GPU run


def chapter_notebooks(chapters: Path) -> list[Path]:
    """Every chapter notebook, in order: ``NN_name.ipynb`` (new chapters appear by themselves)."""
    return sorted(p for p in chapters.glob("[0-9][0-9]_*.ipynb"))


def _stamp(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def execution_seconds(notebook: dict) -> float | None:
    """Wall time from the first cell's start to the last cell's reply, from the cell metadata
    (``metadata.execution``, written by nbclient when it runs a notebook). None without it."""
    starts, ends = [], []
    for cell in notebook.get("cells", []):
        timing = cell.get("metadata", {}).get("execution", {})
        start = timing.get("iopub.status.busy") or timing.get("iopub.execute_input")
        end = timing.get("shell.execute_reply") or timing.get("iopub.status.idle")
        if start and end:
            starts.append(_stamp(start))
            ends.append(_stamp(end))
    if not starts:
        return None
    return (max(ends) - min(starts)).total_seconds()


def notebook_title(notebook: dict) -> str:
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            match = re.search(r"^#\s+(.+)$", text, flags=re.M)
            if match:
                return re.sub(r"^Chapter\s+\d+\s*[—:-]\s*", "", match.group(1)).strip()
    return ""


def without_test_markers(notebook: dict) -> dict:
    """``notebook`` with the ``# NBVAL_*`` lines taken out of its code cells (in place; the
    outputs are untouched): the sources keep them for the tests, the rendered book drops them."""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell["source"]
            source = "".join(source) if isinstance(source, list) else source
            cell["source"] = NBVAL_LINE.sub("", source)
    return notebook


def without_widgets(notebook: dict) -> dict:
    """``notebook`` without ipywidgets state (``metadata.widgets``) and widget-view outputs (in
    place): static HTML cannot show a widget, and with either present the page would load
    require.js and a widget manager from a CDN."""
    notebook.get("metadata", {}).pop("widgets", None)
    for cell in notebook.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = [out for out in cell["outputs"]
                               if WIDGET_VIEW not in out.get("data", {})]
    return notebook


def with_roadmap_alt(notebook: dict, number: str, title: str) -> dict:
    """Alt text for the roadmap image of the chapter's first code cell
    (``show_roadmap(N)``), which has no caption to take it from: cell metadata that myst-nb
    gives the image (in place)."""
    for cell in notebook.get("cells", []):
        text = cell.get("source", "")
        if cell.get("cell_type") == "code" and "show_roadmap(" in "".join(text):
            options = cell.setdefault("metadata", {}).setdefault("mystnb", {})
            options.setdefault("image", {}).setdefault(
                "alt", f"Where we are: chapter {number}, {title}. The engine's components, with "
                       "the ones this chapter builds highlighted.")
    return notebook


def chapter_info(chapters: Path, gpu_runs: Path) -> list[ChapterInfo]:
    infos = []
    for path in chapter_notebooks(chapters):
        nb = json.loads(path.read_text())
        gpu = {}
        for run in sorted(gpu_runs.glob(f"{path.stem}.*.ipynb")) if gpu_runs.is_dir() else []:
            seconds = execution_seconds(json.loads(run.read_text()))
            if seconds is not None:
                gpu[run.suffixes[0].lstrip(".")] = seconds
        infos.append(ChapterInfo(path.stem, path.stem[:2], notebook_title(nb),
                                 execution_seconds(nb), gpu))
    return infos


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "not recorded"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def chapter_map(infos: list[ChapterInfo]) -> str:
    lines = ["| Chapter | Title |", "| --- | --- |"]
    lines += [f"| {i.number} | [{i.title}](chapters/{i.stem}.ipynb) |" for i in infos]
    return "\n".join(lines)


def runtime_table(infos: list[ChapterInfo]) -> str:
    devices = sorted({d for i in infos for d in i.gpu_seconds})
    head = "| Chapter | CPU (committed run) |" + "".join(f" GPU ({d}) |" for d in devices)
    lines = [head, "| --- | --- |" + " --- |" * len(devices)]
    for i in infos:
        gpu = "".join(f" {_fmt(i.gpu_seconds.get(d))} |" for d in devices)
        lines.append(f"| {i.number} {i.title} | {_fmt(i.cpu_seconds)} |{gpu}")
    def total(seconds: list[float | None]) -> str:
        timed = [t for t in seconds if t is not None]
        return f"{_fmt(sum(timed))} ({len(timed)} of {len(infos)} chapters)"

    gpu_totals = "".join(f" {total([i.gpu_seconds.get(d) for i in infos])} |" for d in devices)
    lines.append(f"| all chapters | {total([i.cpu_seconds for i in infos])} |{gpu_totals}")
    return "\n".join(lines)


def book_root(root: Path) -> Path:
    """``root``, if it holds the book's sources (``book/intro.md`` and ``chapters/``); else a
    clear error, rather than a half-built book."""
    if not ((root / "book" / "intro.md").is_file() and (root / "chapters").is_dir()):
        raise ValueError(f"{root.resolve()} holds no book/intro.md and chapters/: pass the "
                         "repository's folder (--root, default: the current folder)")
    return root


def stage(out: Path, root: Path) -> list[ChapterInfo]:
    """Copy the book's sources under ``root`` (the repository) into ``out`` (emptied first)
    and fill the landing page."""
    book_root(root)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(root / "book", out)
    (out / "chapters").mkdir()
    for path in chapter_notebooks(root / "chapters"):
        notebook = without_widgets(without_test_markers(json.loads(path.read_text())))
        with_roadmap_alt(notebook, path.stem[:2], notebook_title(notebook))
        (out / "chapters" / path.name).write_text(json.dumps(notebook, indent=1,
                                                             ensure_ascii=False) + "\n")
    infos = chapter_info(root / "chapters", root / "figures" / "data" / "gpu_runs")
    intro = out / "intro.md"
    text = intro.read_text()
    if MAP_MARK not in text or RUNTIME_MARK not in text:
        raise ValueError(f"{intro} must hold the lines {MAP_MARK} and {RUNTIME_MARK}")
    text = text.replace(MAP_MARK, chapter_map(infos)).replace(RUNTIME_MARK, runtime_table(infos))
    intro.write_text(text)
    return infos


def build(src: Path, out: Path) -> Path:
    """Render a staged book with jupyter-book (v1, execution off in book/_config.yml); returns
    the HTML folder. Raises when the build fails."""
    from jupyter_book.cli.main import build as jb_build  # the optional `book` extra

    jb_build.main([str(src), "--path-output", str(out), "-q"], standalone_mode=False)
    html = out / "_build" / "html"
    if not (html / "index.html").is_file():
        raise RuntimeError(f"jupyter-book wrote no {html / 'index.html'}")
    return html


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=Path, required=True, help="staging folder (emptied)")
    parser.add_argument("--build", type=Path, help="render the staged book into this folder")
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository, with book/ and chapters/ (default: here)")
    args = parser.parse_args(argv)
    try:
        infos = stage(args.stage, root=args.root)
    except ValueError as error:
        parser.error(str(error))
    print(f"staged {len(infos)} chapters in {args.stage}")
    print(runtime_table(infos))
    if args.build:
        print(f"book: {build(args.stage, args.build) / 'index.html'}")


if __name__ == "__main__":
    main()

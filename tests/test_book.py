"""The rendered book (``make book``, book/, nanovllm/viz/book.py): it builds from the committed
notebooks, every chapter page and every figure the notebooks show is in the HTML, the landing
page's chapter map and runtime table are generated, a new chapter appears without editing the
table of contents, and a real headless browser shows a chapter page (not a blank or error page).
"""

from __future__ import annotations

import base64
import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanovllm.viz import book

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = book.chapter_notebooks(ROOT / "chapters")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jupyter_book") is None,
    reason="jupyter-book is not installed (the `book` extra: pip install -e '.[book]', or make)",
)


def build(src_root: Path, out: Path) -> Path:
    """Stage ``src_root``'s book and chapters and render them; returns the HTML folder."""
    cmd = [sys.executable, "-m", "nanovllm.viz.book", "--root", str(src_root),
           "--stage", str(out / "src"), "--build", str(out / "book")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / "book" / "_build" / "html"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    start = time.perf_counter()
    html_dir = build(ROOT, tmp_path_factory.mktemp("book"))
    print(f"book built in {time.perf_counter() - start:.1f} s")
    return html_dir


def image_outputs(notebook: dict) -> list[bytes]:
    """The PNG figures a notebook's committed outputs show."""
    return [base64.b64decode(out["data"]["image/png"])
            for cell in notebook["cells"] if cell["cell_type"] == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def test_there_are_chapters() -> None:
    assert len(NOTEBOOKS) >= 10, NOTEBOOKS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_chapter_page_and_figure_is_in_the_book(site: Path, notebook: Path) -> None:
    page = site / "chapters" / f"{notebook.stem}.html"
    assert page.is_file(), f"no page for {notebook.name}"
    text = page.read_text()
    nb = json.loads(notebook.read_text())
    title = book.notebook_title(nb)
    assert title and title in html.unescape(re.sub(r"<[^>]+>", "", text)), title
    # Every figure the notebook shows is a file of the site, referenced from its page.
    sources = re.findall(r'<img[^>]+src="\.\./(_images/[^"]+\.png)"', text)
    shown = {(site / s).read_bytes() for s in sources if (site / s).is_file()}
    figures = image_outputs(nb)
    missing = [i for i, png in enumerate(figures) if png not in shown]
    assert not missing, f"{notebook.name}: figures {missing} of {len(figures)} not in the page"


def test_landing_page_reference_pages_and_search(site: Path) -> None:
    index = (site / "intro.html").read_text()
    for notebook in NOTEBOOKS:
        assert f"chapters/{notebook.stem}.html" in index, notebook.stem
    assert "Runtimes" in index and "CPU (committed run)" in index
    for page in ("notation.html", "glossary.html", "search.html", "searchindex.js"):
        assert (site / page).is_file(), page
    assert "prefix" in (site / "searchindex.js").read_text()


def test_runtime_table_is_read_from_the_execution_metadata() -> None:
    def cell(start: str, end: str) -> dict:
        return {"cell_type": "code", "metadata": {"execution": {
            "iopub.status.busy": start, "shell.execute_reply": end}}}

    nb = {"cells": [cell("2026-01-01T10:00:00Z", "2026-01-01T10:00:05Z"),
                    {"cell_type": "markdown", "metadata": {}, "source": "# Chapter 99 — Test"},
                    cell("2026-01-01T10:00:05Z", "2026-01-01T10:01:30.5Z")]}
    assert book.execution_seconds(nb) == pytest.approx(90.5)
    assert book.execution_seconds({"cells": [{"cell_type": "code", "metadata": {}}]}) is None
    assert book.notebook_title(nb) == "Test"
    # And the committed notebooks carry that metadata: each has a CPU runtime.
    infos = book.chapter_info(ROOT / "chapters", ROOT / "figures" / "data" / "gpu_runs")
    assert [i.stem for i in infos] == [p.stem for p in NOTEBOOKS]
    untimed = [i.stem for i in infos if i.cpu_seconds is None]
    assert not untimed, f"no execution metadata (run `make notebooks CH=..`): {untimed}"
    table = book.runtime_table(infos)
    for i in infos:
        assert f"| {i.number} {i.title} |" in table


def test_the_recorded_gpu_run_matches_its_executed_copies() -> None:
    """figures/data/book_gpu_h200.json (issue 16) counts what its committed copies hold: for each
    chapter, as many code cells run as the copy has, each with outputs timed by the run."""
    record = json.loads((ROOT / "figures" / "data" / "book_gpu_h200.json").read_text())
    assert record["device"] == "NVIDIA H200" and record["chapters"] == len(record["by_chapter"])
    assert record["checked_passed"] == sum(c["checked_passed"] for c in record["by_chapter"])
    runs = ROOT / "figures" / "data" / "gpu_runs"
    for chapter in record["by_chapter"]:
        stem = Path(chapter["notebook"]).stem
        copy = json.loads((runs / f"{stem}.h200.ipynb").read_text())
        code = [c for c in copy["cells"] if c["cell_type"] == "code"]
        assert chapter["cells_run"] == len(code), stem
        assert all("execution" in c["metadata"] for c in code), stem
        checked = [c for c in code if "NBVAL_CHECK_OUTPUT" in "".join(c["source"])]
        assert chapter["checked_cells"] == len(checked), stem
        # The book's landing page says every checked cell printed what the CPU run printed.
        assert not chapter["failed"] and chapter["checked_passed"] == len(checked), stem


def _chapters_at(commit: str) -> set[str] | None:
    """The chapter notebooks in the tree at ``commit``, or None where this clone lacks it."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", commit, "chapters/"], cwd=ROOT,
                             capture_output=True, text=True)
    if listing.returncode != 0:
        return None
    names = [Path(line).name for line in listing.stdout.split()]
    return {Path(n).stem for n in names if re.fullmatch(r"\d\d_\w+\.ipynb", n)}


def test_newer_gpu_book_runs_add_up() -> None:
    """A later GPU run of the book kept as a summary only (its executed copies stayed on the
    device): its totals are its chapters' sums, and it covers every chapter of the tree it ran
    (chapters written later are not claimed by it)."""
    for path in (ROOT / "figures" / "data").glob("book_gpu_h200_*.json"):
        record = json.loads(path.read_text())
        rows = record["by_chapter"]
        chapters = _chapters_at(record["git_commit"])
        if chapters is None:
            pytest.skip(f"this clone lacks commit {record['git_commit']} ({path.name})")
        assert {Path(c["notebook"]).stem for c in rows} == chapters, path.name
        assert record["chapters"] == len(rows), path.name
        for key in ("cells_run", "checked_cells", "checked_passed"):
            assert record[key] == sum(c[key] for c in rows), (path.name, key)
        assert record["failed_cells"] == sum(len(c["failed"]) for c in rows), path.name


def test_a_new_chapter_appears_without_editing_the_toc(tmp_path: Path) -> None:
    """The toc globs chapters/*: a chapter notebook dropped in is staged, mapped and rendered."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "book", root / "book")
    (root / "chapters").mkdir()
    for number, name in (("00", "first"), ("42", "answer")):
        nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "id": f"c{number}",
                         "source": f"# Chapter {number} — The {name} chapter\n\nText."}],
              "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                          "language": "python"}},
              "nbformat": 4, "nbformat_minor": 5}
        (root / "chapters" / f"{number}_{name}.ipynb").write_text(json.dumps(nb))
    site = build(root, tmp_path / "out")
    assert (site / "chapters" / "42_answer.html").is_file()
    assert "The answer chapter" in (site / "intro.html").read_text()


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(find_chromium() is None,
                    reason="no headless Chromium on this machine (install it with `make browser`)")
def test_a_browser_shows_a_chapter(site: Path, tmp_path: Path) -> None:
    from PIL import Image

    chromium = find_chromium()
    notebook = next(p for p in NOTEBOOKS if p.stem.startswith("04_"))
    url = (site / "chapters" / f"{notebook.stem}.html").as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    shot = tmp_path / "page.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", url],
                   capture_output=True, timeout=120, check=True)
    dom = subprocess.run([chromium, *flags, "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    title = html.unescape(re.search(r"<title>([^<]*)</title>", dom).group(1))
    assert book.notebook_title(json.loads(notebook.read_text())) in title, title
    assert "<h1>" in dom and "Chapter 04" in dom

    image = Image.open(shot).convert("L")
    assert image.size == (1280, 900)
    levels = image.histogram()  # pixel count per grey level 0..255
    ink = sum(levels[:128]) / sum(levels)  # dark pixels: text, headings
    assert 0.01 < ink < 0.5, f"{ink:.1%} dark pixels: a blank or broken page?"
    assert sum(n > 0 for n in levels) > 20, "too few grey levels for rendered text"

"""The book agrees with itself and with the package (issue 29), beside tests/test_book_truth.py:

- **Shown code is today's code.** Every ``show_source(...)`` output stored in a committed
  notebook equals what ``nanovllm.viz.source.elided_source`` gives for the same objects today,
  so a change to a function a chapter shows fails here until the chapter is re-executed. The
  comparison calls the function; it never trusts a stored copy of the expected text.
- **The rendered book hides the test markers.** ``nanovllm.viz.book.stage`` drops the
  ``# NBVAL_*`` lines from the staged notebooks; the sources keep them.
- **Cells are what they look like.** No markdown heading hides in a code cell as a comment,
  an nbval marker starts its cell (one placed lower belongs to a second cell merged into the
  first), and no chapter cites its sections in a numbering it no longer uses ("in 0.4" after
  chapter 00's sections became 1., 2., ...).
- **INSTRUCTORS.md counts the course as it is**: the assignment count, the points, each row
  of the assignment table and each week of the schedule, against the regions in the package.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from pathlib import Path

import pytest

from nanovllm.course.regions import find_regions
from nanovllm.viz.source import elided_source

jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


def text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


# ------------------------------------------------------------------------- shown source code

def import_namespace(code_cells: list[str]) -> dict:
    """The names a notebook imports at the top level of its cells (enough to name what it
    shows: ``show_source(BlockManager.allocate)``)."""
    namespace: dict = {}
    for source in code_cells:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    exec(compile(ast.Module([node], []), "<import>", "exec"), namespace)
    return namespace


def shown_source_problems(notebook: dict, where: str) -> tuple[list[str], int]:
    """(problems, how many outputs were compared) for one executed notebook."""
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    namespace = import_namespace([text(c["source"]) for c in cells])
    problems, compared = [], 0
    for cell in cells:
        source = text(cell["source"])
        if "show_source(" not in source:
            continue
        calls = sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                        and getattr(n.func, "id", None) == "show_source"),
                       key=lambda n: (n.lineno, n.col_offset))
        shown = [text(out["data"]["text/markdown"]) for out in cell.get("outputs", [])
                 if text(out.get("data", {}).get("text/markdown", "")).startswith("```python")]
        if len(calls) != len(shown):
            problems.append(f"{where}: a cell calls show_source {len(calls)} times but shows "
                            f"{len(shown)} listings: re-execute it")
            continue
        for call, stored in zip(calls, shown):
            expression = ast.unparse(call)
            try:
                objects = [eval(compile(ast.Expression(arg), "<show_source>", "eval"), namespace)
                           for arg in call.args]
            except Exception as error:  # noqa: BLE001 - named in the failure
                problems.append(f"{where}: cannot resolve {expression} from the notebook's "
                                f"imports ({type(error).__name__}: {error})")
                continue
            compared += 1
            if stored != "```python\n" + "\n".join(map(elided_source, objects)) + "```":
                problems.append(f"{where}: {expression} shows code that changed since the "
                                "notebook ran: re-execute the chapter")
    return problems, compared


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_shown_source_is_todays_code(path: Path) -> None:
    problems, _ = shown_source_problems(json.loads(path.read_text()), path.name)
    assert not problems, "\n".join(problems)


def test_the_check_sees_every_listing_and_fails_on_a_stale_one() -> None:
    compared = sum(shown_source_problems(json.loads(p.read_text()), p.name)[1]
                   for p in NOTEBOOKS)
    assert compared >= 50, f"only {compared} show_source outputs compared: is the scan broken?"
    stale = {"cells": [{
        "cell_type": "code",
        "source": "from nanovllm.viz.source import elided_source\nshow_source(elided_source)",
        "outputs": [{"data": {"text/markdown": "```python\ndef elided_source(obj):\n"
                                               "    return 'as it was'\n```"}}]}]}
    problems, compared = shown_source_problems(stale, "planted")
    assert compared == 1 and len(problems) == 1 and "changed since" in problems[0], problems


# ------------------------------------------------------------------------ the rendered book

def test_the_staged_book_hides_nbval_markers(tmp_path: Path) -> None:
    from nanovllm.viz import book

    book.stage(tmp_path / "book", root=ROOT)
    marked = 0
    for path in NOTEBOOKS:
        source_cells = json.loads(path.read_text())["cells"]
        staged_cells = json.loads((tmp_path / "book" / "chapters" / path.name).read_text())["cells"]
        assert len(staged_cells) == len(source_cells), path.name
        for original, staged in zip(source_cells, staged_cells):
            assert staged.get("outputs") == original.get("outputs"), path.name
            if original["cell_type"] != "code":  # prose may name a marker
                assert staged["source"] == original["source"], path.name
                continue
            marked += "NBVAL_" in text(original["source"])
            assert "NBVAL_" not in text(staged["source"]), (path.name, text(staged["source"]))
            kept = [line for line in text(original["source"]).splitlines()
                    if "NBVAL_" not in line]
            assert text(staged["source"]).splitlines() == kept, path.name
    assert marked > 100, "the sources lost their nbval markers: the notebook tests need them"


# --------------------------------------------------------------------------- cell structure

_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.?\s", re.M)


def structure_problems(chapter: str, cells: list[tuple[str, str]]) -> list[str]:
    """``cells``: (cell type, source) of chapter ``chapter``'s py:percent source."""
    problems = []
    numbers = {m.group(1) for kind, source in cells if kind == "markdown"
               for m in _HEADING.finditer(source)}
    for kind, source in cells:
        lines = source.splitlines()
        if kind == "code":
            for k, line in enumerate(lines):
                if re.match(r"#\s*#{1,4} \S", line):
                    problems.append(f"chapter {chapter}: a heading inside a code cell: {line!r}")
                if re.match(r"#\s*NBVAL_", line) and any(
                        x.strip() and not x.lstrip().startswith("#") for x in lines[:k]):
                    problems.append(f"chapter {chapter}: {line.strip()} below code: two cells "
                                    f"merged? ({lines[0][:60]!r})")
        else:
            prose = re.sub(r"`[^`]*`|\$[^$]*\$", " ", source)
            for m in re.finditer(rf"\b(?:in|of|from|see|and|to) ({int(chapter)}\.\d+)\b(?![\d%])",
                                 prose):
                if m.group(1) not in numbers:
                    problems.append(f"chapter {chapter}: {m.group(0)!r} cites a section in an "
                                    "old numbering: write §N")
    return problems


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name[:2])
def test_cells_are_what_they_look_like(path: Path) -> None:
    cells = [(c.cell_type, c.source) for c in jupytext.read(path).cells]
    problems = structure_problems(path.name[:2], cells)
    assert not problems, "\n".join(problems)


def test_planted_structure_errors_fail() -> None:
    planted = [("markdown", "## 4. Ask it\nthe questions of 0.4, and of §4"),
               ("code", 'print("x")\n#\n# ## 2. Capture and replay'),
               ("code", "def f():\n    pass\n\n\n# NBVAL_CHECK_OUTPUT\nf()")]
    problems = structure_problems("00", planted)
    assert len(problems) == 3, "\n".join(problems)


# ------------------------------------------------------------------------- INSTRUCTORS.md

def test_instructors_counts_the_course_as_it_is() -> None:
    guide = (ROOT / "chapters" / "INSTRUCTORS.md").read_text()
    points = {r.id: r.points for r in find_regions(ROOT / "nanovllm")}
    total = sum(points.values())
    assert f"**{len(points)} assignments, {total} points**" in guide
    rows = dict(re.findall(r"^\| `(\d\d\.\w+)` \| (\d+) \|", guide, re.M))
    assert {k: int(v) for k, v in rows.items()} == points, "the assignment table is stale"
    # each row names first the function whose region it is (issue 43: a row named a caller)
    functions = {r.id: r.function for r in find_regions(ROOT / "nanovllm")}
    named = dict(re.findall(r"^\| `(\d\d\.\w+)` \| \d+ \| `([^`]+)`", guide, re.M))
    assert named == functions, {i: (n, functions[i]) for i, n in named.items() if n != functions[i]}
    weeks = re.findall(r"^\| \d+ \| [^|]+\| ([^|]+)\| (\d+) \|$", guide, re.M)
    assert weeks, "the weekly schedule is missing"
    for ids, week_points in weeks:
        listed = re.findall(r"`(\d\d\.\w+)`", ids)
        assert sum(points[i] for i in listed) == int(week_points), (ids, week_points)
    assert sorted(i for ids, _ in weeks for i in re.findall(r"`(\d\d\.\w+)`", ids)) == \
        sorted(points), "every assignment is in exactly one week"
    for stated in re.findall(r"\b0 / (\d+)\b", guide):
        assert int(stated) == total, f"INSTRUCTORS.md says 0 / {stated}; the course has {total}"

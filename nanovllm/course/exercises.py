"""Notebook exercises: practice inside a chapter, checked by the cell after it.

An exercise is a code cell tagged ``exercise`` that defines a function (or two); its worked solution
sits between ``# BEGIN SOLUTION`` and ``# END SOLUTION``. The next code cell, tagged
``check``, tests it. The exercise's id is ``<chapter>.<function name>`` (e.g.
``01.rms_norm``): stable when exercises are added or reordered. The student edition replaces
each solution by ``raise NotImplementedError("exercise 01.rms_norm")``
(:func:`strip_solutions`); ``tests/test_exercises.py`` runs every pair with ``nanovllm``
unimportable, and checks that each check fails on the stripped exercise.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
DEF = re.compile(r"^def (?P<name>\w+)\(")


@dataclass(frozen=True)
class Exercise:
    id: str  # "01.rms_norm"
    source: str  # the exercise cell, with its solution
    check: str  # the check cell

    @property
    def stripped(self) -> str:
        return strip_solutions(self.source, self.id[:2])


def function_name(source: str) -> str:
    """The name of the (first) function an exercise cell defines: the exercise's name."""
    names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    if not names:
        raise ValueError("an exercise cell must define the function(s) to write")
    return names[0]


def strip_solutions(source: str, chapter: str) -> str:
    """``source`` (a cell, or a whole py:percent chapter) with each ``# BEGIN SOLUTION`` ..
    ``# END SOLUTION`` block, markers included, replaced by a ``raise NotImplementedError``
    naming the exercise: ``<chapter>.<the function the block is in>``."""
    out, inside, function = [], False, "exercise"
    for line in source.splitlines(keepends=True):
        begin = BEGIN.match(line)
        if DEF.match(line):
            function = DEF.match(line)["name"]
        if begin and not inside:
            inside = True
            message = f"exercise {chapter}.{function}"
            out.append(f'{begin["indent"]}raise NotImplementedError("{message}")\n')
        elif END.match(line) and inside:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"chapter {chapter}: BEGIN SOLUTION without END SOLUTION")
    return "".join(out)


def chapter_exercises(path: Path) -> list[Exercise]:
    """The exercise/check pairs of one chapter's py:percent source."""
    import jupytext

    cells = jupytext.read(path).cells
    chapter = path.stem[:2]
    found = []
    for i, cell in enumerate(cells):
        if "exercise" not in cell.metadata.get("tags", []):
            continue
        check = next((c for c in cells[i + 1 :] if c.cell_type == "code"), None)
        if check is None or "check" not in check.metadata.get("tags", []):
            raise ValueError(f"{path.name}: an exercise cell must be followed by its check cell")
        found.append(Exercise(f"{chapter}.{function_name(cell.source)}", cell.source, check.source))
    return found


def strip_notebook(nb, chapter: str) -> None:
    """Strip the solutions of a notebook's (nbformat) exercise cells, in place."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
            cell.source = strip_solutions(cell.source, chapter)

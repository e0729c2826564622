"""Notebook exercises: practice inside a chapter, checked by the cell after it.

An exercise is a code cell tagged ``exercise`` that defines a function (or two) whose body is
``raise NotImplementedError("exercise 01.rms_norm")``; the next code cell, tagged ``check``
(and ``raises-exception``: in the executed chapter it meets the stub), tests it. The exercise's
id is ``<chapter>.<function name>``: stable when exercises are added or reordered. The worked
solutions never ship: they live in instructor-only notebooks, ``chapters/solutions/NN_solutions.py``
(py:percent), one cell per exercise, tagged ``solution``: the chapter's cell with its solution
between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` where the chapter has the stub
(:func:`strip_solutions` of the one must be the other). ``tests/test_exercises.py`` runs every
solution against its check with ``nanovllm`` unimportable, and each check against its stub; in a
student edition (no solutions folder) it runs the student's cells against their checks.
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
    source: str  # the exercise cell with its worked solution (from chapters/solutions/)
    check: str  # the check cell
    stripped: str  # the exercise cell as the chapter has it: the prompt and the stub


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


def solution_files(chapters: Path) -> list[Path]:
    """The instructor-only solution notebooks, one per chapter with exercises."""
    return sorted((chapters / "solutions").glob("[0-9][0-9]_solutions.py"))


def _cells(path: Path, tag: str) -> list:
    import jupytext

    cells = jupytext.read(path).cells
    return [(i, c, cells) for i, c in enumerate(cells) if tag in c.metadata.get("tags", [])]


def chapter_exercises(path: Path) -> list[Exercise]:
    """The exercises of one chapter's py:percent source, each with its check and, from
    ``chapters/solutions/NN_solutions.py``, its worked solution."""
    chapter = path.stem[:2]
    solutions_path = path.parent / "solutions" / f"{chapter}_solutions.py"
    solutions = (
        {function_name(c.source): c.source for _, c, _ in _cells(solutions_path, "solution")}
        if solutions_path.exists()
        else {}
    )
    found = []
    for i, cell, cells in _cells(path, "exercise"):
        check = next((c for c in cells[i + 1 :] if c.cell_type == "code"), None)
        if check is None or "check" not in check.metadata.get("tags", []):
            raise ValueError(f"{path.name}: an exercise cell must be followed by its check cell")
        name = function_name(cell.source)
        if not solutions_path.exists():  # a student edition: the chapter's cell is the answer
            found.append(Exercise(f"{chapter}.{name}", cell.source, check.source, cell.source))
            continue
        if "# BEGIN SOLUTION" in cell.source:
            raise ValueError(f"{path.name}: {name}'s solution belongs in {solutions_path}")
        if name not in solutions:
            raise ValueError(f"{solutions_path}: no solution cell for {chapter}.{name}")
        solution = solutions.pop(name)
        if strip_solutions(solution, chapter).strip() != cell.source.strip():
            raise ValueError(f"{chapter}.{name}: the chapter's cell is not the solution stripped")
        found.append(Exercise(f"{chapter}.{name}", solution, check.source, cell.source))
    if solutions:
        raise ValueError(f"{solutions_path}: solutions without an exercise: {sorted(solutions)}")
    return found


def strip_notebook(nb, chapter: str) -> None:
    """Strip the solutions of a notebook's (nbformat) exercise cells, in place."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
            cell.source = strip_solutions(cell.source, chapter)

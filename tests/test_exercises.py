"""Run every chapter's exercises against their checks, one pair at a time.

Each exercise is two cells of a chapter's ``.py`` source: one tagged ``exercise`` (the
function the reader writes; the shipped solution sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``) and the ``check`` cell after it. Both are self-contained, so graders can
run a student's chapter file alone: ``pytest -m ex04 tests/test_exercises.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def _exercise_pairs() -> list:
    try:
        import jupytext
    except ImportError:  # e.g. a GPU machine set up for `pytest -m gpu` only
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="needs jupytext"))]
    params = []
    for source in sorted(CHAPTERS.glob("[0-9][0-9]_*.py")):
        cells = jupytext.read(source).cells
        chapter = source.stem[:2]
        for i, cell in enumerate(cells):
            if "exercise" not in cell.metadata.get("tags", []):
                continue
            check = next((c for c in cells[i + 1 :] if c.cell_type == "code"), None)
            assert check is not None and "check" in check.metadata.get("tags", []), (
                f"{source.name}: an exercise cell must be followed by its check cell"
            )
            params.append(
                pytest.param(
                    cell.source,
                    check.source,
                    id=f"{source.stem}-{len(params)}",
                    marks=getattr(pytest.mark, f"ex{chapter}"),
                )
            )
    return params


@pytest.mark.parametrize("exercise, check", _exercise_pairs())
def test_exercise(exercise: str, check: str) -> None:
    namespace: dict = {"__name__": "__exercise__"}
    exec(compile(exercise, "<exercise>", "exec"), namespace)
    exec(compile(check, "<check>", "exec"), namespace)

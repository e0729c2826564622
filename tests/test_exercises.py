"""Every chapter's notebook exercises against their checks (nanovllm/course/exercises.py).

Each pair runs with ``nanovllm`` unimportable: an exercise cannot pass by calling the
package's own function, and a check cannot compare against the package (in the course the
student writes it, so that would be circular); checks use frozen values, properties or a
reference written differently. Each check must also fail on the student edition's stub, so
no check passes without a solution. Ids are stable: ``01.rms_norm``; graders can run one
chapter with ``pytest -m ex04 tests/test_exercises.py``.
"""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def _exercises() -> list:
    try:
        import jupytext  # noqa: F401
    except ImportError:  # e.g. a GPU machine set up for `pytest -m gpu` only
        return [pytest.param(None, marks=pytest.mark.skip(reason="needs jupytext"))]
    from nanovllm.course.exercises import chapter_exercises

    params = []
    for source in sorted(CHAPTERS.glob("[0-9][0-9]_*.py")):
        for exercise in chapter_exercises(source):
            mark = getattr(pytest.mark, f"ex{exercise.id[:2]}")
            params.append(pytest.param(exercise, id=exercise.id, marks=mark))
    return params


@pytest.fixture
def without_nanovllm(monkeypatch):
    """`import nanovllm` (and any submodule) raises ImportError while the cells run."""
    for name in [n for n in sys.modules if n == "nanovllm" or n.startswith("nanovllm.")]:
        monkeypatch.setitem(sys.modules, name, None)
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        if name == "nanovllm" or name.startswith("nanovllm."):
            raise ImportError(f"exercises and checks must not import {name}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)


def _run(exercise_source: str, check: str) -> None:
    namespace: dict = {"__name__": "__exercise__"}
    exec(compile(exercise_source, "<exercise>", "exec"), namespace)
    exec(compile(check, "<check>", "exec"), namespace)


@pytest.mark.parametrize("exercise", _exercises())
def test_exercise_passes_its_check(exercise, without_nanovllm) -> None:
    _run(exercise.source, exercise.check)


@pytest.mark.parametrize("exercise", _exercises())
def test_check_fails_on_the_student_stub(exercise, without_nanovllm) -> None:
    if exercise.source == exercise.stripped:
        pytest.skip("a student edition: the chapter's cell is the student's answer")
    with pytest.raises(NotImplementedError, match=f"exercise {exercise.id[:2]}\\."):
        _run(exercise.stripped, exercise.check)

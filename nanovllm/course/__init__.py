"""The course mechanism: assignment regions in the package, student editions, grading.

* :mod:`nanovllm.course.regions` finds, validates and cuts ``# >>> assignment CC.name`` regions;
* :mod:`nanovllm.course.student` builds a student edition (``make student``);
* :mod:`nanovllm.course.grade` grades a student's package with the instructor's tests
  (``make grade``), through the pytest plugin :mod:`nanovllm.course.pytest_plugin`;
* :mod:`nanovllm.course.audit` checks that graded tests carry every id they reach;
* :mod:`nanovllm.course.exercises` reads the chapters' notebook exercises and strips their
  solutions for the student edition.
"""

from __future__ import annotations

from pathlib import Path


def assignment_table(chapter: str) -> str:
    """A chapter's assignments, one line each (id, points, function, file), for its notebook."""
    from nanovllm.course.regions import find_regions

    package = Path(__file__).resolve().parents[1]
    rows = [r for r in find_regions(package) if r.chapter == chapter]
    lines = [
        f"{r.id:22s} {r.points:2d} points  {r.function:28s} "
        f"{r.file.relative_to(package.parent).as_posix()}"
        for r in rows
    ]
    lines.append(f"{'total':22s} {sum(r.points for r in rows):2d} points")
    return "\n".join(lines)

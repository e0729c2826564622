"""The course mechanism: assignment regions in the package, student editions, grading.

* :mod:`nanovllm.course.regions` finds, validates and cuts ``# >>> assignment CC.name`` regions;
* :mod:`nanovllm.course.student` builds a student edition (``make student``);
* :mod:`nanovllm.course.check` runs an edition's public tests per assignment (``make check``);
* :mod:`nanovllm.course.grade` grades a student's regions with the instructor's tests
  (``make grade``): :mod:`~nanovllm.course.submission` reads and splices the regions,
  :mod:`~nanovllm.course.static_check` flags the ones that reach past their function,
  :mod:`~nanovllm.course.sandbox` runs pytest with the plugin
  :mod:`~nanovllm.course.pytest_plugin` where nothing leads to the reference;
* :mod:`nanovllm.course.answer_key` finds the reference code and the worked solutions in any
  text, so that no edition and no book ships them;
* :mod:`nanovllm.course.analysis` asks each chapter's predict-then-measure questions, measures
  them with the student's code and scores them beside the points (the questions:
  :mod:`~nanovllm.course.analysis_questions`, :mod:`~nanovllm.course.analysis_questions_late`,
  :mod:`~nanovllm.course.analysis_questions_advanced`);
* :mod:`nanovllm.course.audit` checks that graded tests carry every id they reach;
* :mod:`nanovllm.course.exercises` pairs the chapters' notebook exercises with their checks and
  their instructor-only solutions.
"""

from __future__ import annotations

from pathlib import Path


def assignment_table(chapter: str) -> str:
    """A chapter's assignments, one line each (id, points, stub or filled, function, file),
    for its notebook: read from the package this runs on (in an edition, the student's)."""
    from nanovllm.course.regions import find_regions, is_stub, region_body

    package = Path(__file__).resolve().parents[1]
    rows = [r for r in find_regions(package) if r.chapter == chapter]
    lines = []
    for r in rows:
        status = "stub" if is_stub(region_body(r.file.read_text(), r)) else "filled"
        lines.append(
            f"{r.id:22s} {r.points:2d} points  {status:6s}  {r.function:28s} "
            f"{r.file.relative_to(package.parent).as_posix()}"
        )
    lines.append(f"{'total':22s} {sum(r.points for r in rows):2d} points")
    return "\n".join(lines)

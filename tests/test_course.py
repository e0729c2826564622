"""CI proofs of the course mechanism (nanovllm/course): every region still parses once cut,
the chapter-04 student edition scores zero with every stub reached, and the reference scores
full marks (also with one region cut: exactly that assignment loses its points).

Grading runs the fast subset of chapter 04's tests (block-manager unit tests and one
engine-level test on a tiny model); `make grade` runs them all, test_prefix_caching's too.
"""

from __future__ import annotations

import ast

import pytest

from nanovllm.course import grade, student
from nanovllm.course.regions import cut_files, find_regions, select

FAST = [
    "tests/test_block_manager.py",
    "tests/test_scheduler.py::test_preemption_and_prefix_cache_metrics",
]
CHAPTER04 = {"04.cached_prefix": 6, "04.allocate": 8, "04.free": 6}


def _grade(root=None):
    return grade.grade(root, FAST, timeout=120, chapters=["04"])


def _rows(result):
    return {r["assignment"]: r for r in result["assignments"]}


def _stubs_hit(result, assignment):
    return [
        t["nodeid"]
        for t in result["chapters"]["04"]["tests"]
        if t["outcome"] == "failed" and assignment in t["assignments"] and assignment in t["stubs"]
    ]


def test_every_region_parses_when_cut():
    regions = find_regions(grade.REPO / "nanovllm")
    assert {r.id: r.points for r in regions if r.chapter == "04"} == CHAPTER04
    for text in cut_files(regions, grade.REPO).values():  # all at once; cut_files also checks
        ast.parse(text)
        assert "NotImplementedError" in text


def test_student_edition_scores_zero_and_reaches_every_stub(tmp_path):
    cut = student.build(tmp_path / "edition", chapters=["04"])
    assert sorted(r.id for r in cut) == sorted(CHAPTER04)
    result = _grade(tmp_path / "edition")
    assert result["chapters"]["04"]["nanovllm"].startswith(str(tmp_path / "edition"))
    assert (result["total"], result["max"]) == (0, sum(CHAPTER04.values()))
    for assignment in CHAPTER04:
        assert _stubs_hit(result, assignment), f"no test reaches the stub of {assignment}"
    # the edition keeps the handouts and its notebooks are valid (not executed: stubs raise)
    text = (tmp_path / "edition/nanovllm/engine/block_manager.py").read_text()
    assert "Handout (chapter 04 §3" in text and "# >>> assignment" not in text
    assert list((tmp_path / "edition/chapters").glob("04_*.ipynb"))


@pytest.mark.parametrize("assignment", sorted(CHAPTER04))
def test_one_region_cut_costs_exactly_its_points(tmp_path, assignment):
    """Swap-in, seen from the other side: chapter 04's tests all need allocate (and most the
    other two), so putting one region back alone cannot turn its tests green. Instead every
    region but one is put back: exactly the tests marked with that assignment fail (on its
    own stub for at least one), every other test passes, and that assignment scores 0. So
    each test is marked with exactly the regions it depends on (no stub goes ungraded, no
    mark is spurious); putting all regions back is the reference (full marks, test below)."""
    student.build(tmp_path / "edition", ids=[assignment])
    result = _grade(tmp_path / "edition")
    rows = _rows(result)
    assert rows[assignment]["earned"] == 0 and rows[assignment]["total"] >= 2
    assert _stubs_hit(result, assignment)
    for test in result["chapters"]["04"]["tests"]:
        expected = "failed" if assignment in test["assignments"] else "passed"
        assert test["outcome"] == expected, test


def test_the_reference_scores_full_marks():
    result = _grade()
    assert result["chapters"]["04"]["nanovllm"].startswith(str(grade.REPO / "nanovllm"))
    assert result["total"] == result["max"] == sum(CHAPTER04.values())
    assert all(r["total"] >= 2 for r in result["assignments"])
    assert select(find_regions(grade.REPO / "nanovllm"), chapters=["04"])

"""CI proofs of the course mechanism (nanovllm/course), on the student's own path and the same
on every run (no sampling): every region still parses once cut; every assignment has at least
three public own tests (marked with its id alone) that run on a CPU; in the whole-course edition
each of them fails on its own stub; two editions that cut every other region (so that each
region is cut in one and the reference in the other) lose exactly the cut regions' points and
keep every other point through the grader; and a week's edition (`make student CHAPTERS=04
THROUGH=1`) with chapter 04 written gets 30 / 30 from `make grade`, `make check` naming the
later stubs at once.

`python -m nanovllm.course.audit --repo .` checks the marks of the whole-engine tests (every
test carries all the ids its code reaches); it takes longer and is run by hand. The tricks a
student could try on the grader are tests/test_course_tricks.py; the answer key's absence from
editions and the book is tests/test_course_answer_key.py.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanovllm.course import grade, student
from nanovllm.course.grade import graded_marks, own_tests
from nanovllm.course.regions import (
    cut_files,
    find_regions,
    region_body,
    regions_in_file,
    splice_text,
)
from nanovllm.course.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[1]

ASSIGNMENTS = {
    "01.rmsnorm": 5, "01.rope": 6, "01.filter_logits": 6, "01.sampler": 8,
    "02.causal_attention": 6, "02.paged_attention": 5,
    "03.store_kv": 4, "03.decode_attention": 6,
    "04.cached_prefix": 6, "04.allocate": 8, "04.free": 6, "04.prepare": 10,
    "05.decode_kernel": 12, "05.combine_splits": 7,
    "06.admit": 11, "06.preempt": 8, "06.fair_order": 6,
    "07.graphs": 8,
    "08.channel_scales": 4, "08.token_scales": 4,
    "09.column_shard": 3, "09.row_shard": 3, "09.vocab_embed": 4,
    "10.token_bucket": 4,
    "11.placeholders": 8,
    "13.check_refcounts": 4,
    "12.sliding_window": 4, "12.phi3_fused_weights": 5,
    "14.rejection_sample": 8, "14.ngram_propose": 6,
    "15.apply_mask": 6, "15.dfa_mask": 5,
    "16.route": 4, "16.align": 5,
    "17.route": 6,
}  # fmt: skip


def fill(edition: Path, ids: set[str]) -> None:
    """Write the reference's code between the markers of ``ids`` in ``edition``: what a
    student's correct answer is."""
    reference = {r.id: region_body(r.file.read_text(), r) for r in find_regions(REPO / "nanovllm")}
    for path in (edition / "nanovllm").rglob("*.py"):
        if mine := [r for r in regions_in_file(path) if r.id in ids]:
            path.write_text(splice_text(path.read_text(), {r: reference[r.id] for r in mine}))


def test_every_region_parses_when_cut():
    regions = find_regions(REPO / "nanovllm")
    assert {r.id: r.points for r in regions} == ASSIGNMENTS
    for text in cut_files(regions, REPO).values():  # all at once; cut_files also checks
        ast.parse(text)
        assert "NotImplementedError" in text


@pytest.fixture(scope="module")
def whole_course(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("course") / "edition"
    cut = student.build(out, REPO)
    assert sorted(r.id for r in cut) == sorted(ASSIGNMENTS)
    return out


def test_every_own_test_of_the_whole_course_edition_fails_on_its_own_stub(whole_course, tmp_path):
    """Each assignment has at least three public own tests, graded on this machine (a GPU test
    would leave a CPU grade's denominator), and each one reaches its assignment's stub: a
    region no test reaches would be an ungraded assignment."""
    sandbox = Sandbox(tmp_path / "private", REPO)
    listed = sandbox.run(whole_course, ["tests"], 600, extra=("--collect-only",),
                         marks=graded_marks())  # fmt: skip
    assert listed["status"] == "ok", listed
    expected = {t["nodeid"]: t["assignments"] for t in listed["tests"]}
    own = {a: own_tests(expected, a) for a in ASSIGNMENTS}
    assert {a: len(n) for a, n in own.items() if len(n) < 3} == {}
    report = sandbox.run(whole_course, sorted(n for ns in own.values() for n in ns), 600)
    assert report["status"] == "ok", report
    for test in report["tests"]:
        (assignment,) = test["assignments"]
        assert test["outcome"] == "failed" and test["stubs"][:1] == [assignment], test


def test_the_whole_course_edition_keeps_handouts_and_ships_no_solutions(whole_course):
    text = (whole_course / "nanovllm/engine/block_manager.py").read_text()
    assert "Handout (chapter 04 §3" in text
    stub = '        raise NotImplementedError("assignment 04.free'
    assert f"# >>> assignment 04.free (6 points)\n{stub}" in text  # the markers stay
    notebooks = list((whole_course / "chapters").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks and all("# BEGIN SOLUTION" not in p.read_text() for p in notebooks)
    sources = list((whole_course / "chapters").glob("[0-9][0-9]_*.py"))
    assert sources and all("# BEGIN SOLUTION" not in p.read_text() for p in sources)
    notebook = (whole_course / "chapters/01_model.ipynb").read_text()
    assert 'NotImplementedError(\\"exercise 01.' in notebook
    assert not (whole_course / "chapters/solutions").exists()


@pytest.mark.notebook_stream  # ~2 min each: balances make test's two streams
@pytest.mark.parametrize("half", [0, 1])
def test_cutting_every_other_region_costs_exactly_their_points(tmp_path, half):
    """An edition with every other region cut (the rest keep the reference's code, as a
    student's correct answers would): each cut region scores 0 without a run, every other one
    earns its full points from its own tests. With the other half, each region is proved both
    ways, so one unfinished assignment never costs another its points."""
    ordered = sorted(ASSIGNMENTS)
    cut = {a for i, a in enumerate(ordered) if i % 2 == half}
    student.build(tmp_path / "edition", REPO, ids=sorted(cut))
    result = grade.grade(tmp_path / "edition", REPO)
    rows = {r["assignment"]: r for r in result["assignments"]}
    assert sorted(rows) == ordered and result["max"] == sum(ASSIGNMENTS.values())
    for assignment, row in rows.items():
        if assignment in cut:
            assert (row["submission"], row["earned"]) == ("stub", 0), row
            assert row["first_failure"] == f"not written yet: {assignment}", row
        else:
            assert row["submission"] == "filled" and not row["reasons"], row
            assert row["passed"] == row["total"] >= 3 and row["earned"] == row["points"], row
    assert result["total"] == sum(p for a, p in ASSIGNMENTS.items() if a not in cut)


def make(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``make`` as a student types it, with this environment's Python (no venv to build)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NANOVLLM_COURSE"))}
    return subprocess.run(["make", *args, f"PY={sys.executable}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.notebook_stream
def test_a_week_4_edition_with_chapter_04_written_gets_full_marks(tmp_path):
    """The student's path with the README's commands: `make student CHAPTERS=04 THROUGH=1`,
    chapter 04 written, then `make check` (the later chapters' stubs named at once, chapter 04's
    own tests green, in well under two minutes) and `make grade` (30 / 30: the later stubs cost
    chapter 04 nothing)."""
    edition = tmp_path / "week4"
    built = make("student", "CHAPTERS=04", "THROUGH=1", f"STUDENT_OUT={edition}", cwd=REPO,
                 timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    week = {a for a in ASSIGNMENTS if a[:2] == "04"}
    fill(edition, week)
    start = time.monotonic()
    checked = make("check", cwd=edition, timeout=600)
    assert time.monotonic() - start < 120, checked.stdout
    later = sorted(a for a in ASSIGNMENTS if a[:2] > "04")
    for assignment in later:
        assert f"not written yet: {assignment}" in checked.stdout, checked.stdout
    for assignment in week:
        assert any(line.startswith(assignment) and "filled" in line
                   for line in checked.stdout.splitlines()), checked.stdout  # fmt: skip
    assert f"{len(week)} of {len(week) + len(later)} assignments pass" in checked.stdout
    graded = make("grade", f"STUDENT={edition}", "CHAPTERS=04", f"GRADE_JSON={tmp_path}/g.json",
                  cwd=REPO, timeout=600)  # fmt: skip
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert "TOTAL: 30 / 30 points" in graded.stdout, graded.stdout


def test_chapter_04_notebook_runs_on_a_filled_student_package(tmp_path, monkeypatch):
    """The week's edition: cut chapter 04, then fill it in (here: the reference regions put
    back, as a student's correct answer would be) and run the chapter's notebook on that
    package. Every cell runs, except the practice exercises' checks, which still meet the
    stripped exercise stubs (the student's other homework)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    edition = tmp_path / "edition"
    cut = student.build(edition, REPO, chapters=["04"])
    for path in {r.file for r in cut}:  # the student's answers: the reference regions
        relative = path.relative_to(REPO)
        assert "NotImplementedError" in (edition / relative).read_text()
        (edition / relative).write_text(path.read_text())
    nb = nbformat.read(edition / "chapters/04_block_manager.ipynb", as_version=4)
    probe = "import nanovllm\nprint(nanovllm.__file__)"
    nb.cells.insert(0, nbformat.v4.new_code_cell(probe))
    monkeypatch.setenv("PYTHONPATH", str(edition))
    for name, value in {"PYTHONHASHSEED": "0", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(edition / "chapters")}},
    )
    client.execute()
    assert nb.cells[0].outputs[0]["text"].startswith(str(edition / "nanovllm"))
    errors = [
        (cell.metadata.get("tags", []), out.get("ename"), out.get("evalue", ""))
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    checks = [e for e in errors if "check" in e[0]]
    assert errors == checks, f"cells other than exercise checks failed: {errors}"
    assert checks and all(
        name == "NotImplementedError" and value.startswith("exercise 04.")
        for _, name, value in checks
    ), checks

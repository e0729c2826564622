"""CI proofs of the course mechanism (nanovllm/course): every region still parses once cut;
the whole-course student edition scores zero with every stub reached; the reference scores
full marks; and, for a few assignments sampled per run, cutting that one region costs exactly
its points (exactly the tests marked with it fail, on its stub).

Grading here runs a fast subset of each chapter's graded tests (FAST); `make grade` runs them
all. `python -m nanovllm.course.audit --repo .` checks the other direction of the marks (every
test carries all the ids its code reaches); it takes longer and is run by hand. The tricks a
student could try on the grader are tests/test_course_tricks.py; the answer key's absence from
editions and the book is tests/test_course_answer_key.py.
The sample: NANOVLLM_COURSE_SAMPLE=all (or a comma-separated list of ids) overrides it; by
default three assignments chosen by the date, so a rerun on the same day repeats them.
"""

from __future__ import annotations

import ast
import datetime
import os
import random
from pathlib import Path

import pytest

from nanovllm.course import grade, student
from nanovllm.course.regions import cut_files, find_regions

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
DECODE = "tests/kernels/test_decode_kernels.py::"
FAST = [
    "tests/test_models.py::test_logits_match_transformers",
    "tests/test_rotary.py",
    "tests/test_sampler.py",
    "tests/test_torch_attention.py",
    "tests/test_block_manager.py",
    "tests/test_pack_step.py",
    f"{DECODE}test_decode_zero_length_rows_give_zeros",
    f"{DECODE}test_store_then_decode_end_to_end",
    "tests/kernels/test_decode_kernel_assignment.py",
    "tests/kernels/test_combine_splits_assignment.py",
    f"{DECODE}test_decode_matches_reference_fp32_all_splits[group1-mha]",
    "tests/test_policies.py",
    "tests/test_scheduler_steps.py",
    "tests/test_scheduler_output.py",
    "tests/test_scheduler.py::test_preemption_and_prefix_cache_metrics",
    "tests/test_cuda_graphs.py",
    "tests/test_quant_assignments.py",
    "tests/test_tp_assignments.py",
    "tests/test_serve_assignments.py",
    "tests/test_invariants.py",
    "tests/test_models_new.py::test_sliding_window_mask_unit",
    "tests/test_models_new.py::test_logits_match_transformers",
    "tests/test_phi3.py",
    "tests/test_spec_decode_sampler.py",
    "tests/test_structured_output_masks.py",
    "tests/test_moe_layers.py",
    "tests/test_moe_models.py",
    "tests/test_deploy_router.py",
]


def _grade(root=None, chapters=None):
    return grade.grade(root, REPO, FAST, timeout=300, chapters=chapters)


def _tests(result):
    return [t for report in result["chapters"].values() for t in report["tests"]]


def _stubs_hit(result, assignment):
    return [
        t["nodeid"]
        for t in _tests(result)
        if t["outcome"] == "failed" and assignment in t["assignments"] and assignment in t["stubs"]
    ]


def _sample() -> list[str]:
    wanted = os.environ.get("NANOVLLM_COURSE_SAMPLE", "")
    if wanted == "all":
        return sorted(ASSIGNMENTS)
    if wanted:
        return wanted.split(",")
    rng = random.Random(datetime.date.today().toordinal())
    return sorted(rng.sample(sorted(ASSIGNMENTS), 3))


def test_every_region_parses_when_cut():
    regions = find_regions(REPO / "nanovllm")
    assert {r.id: r.points for r in regions} == ASSIGNMENTS
    for text in cut_files(regions, REPO).values():  # all at once; cut_files also checks
        ast.parse(text)
        assert "NotImplementedError" in text


@pytest.mark.notebook_stream  # ~5 min: balances make test's two streams
def test_student_edition_scores_zero_and_reaches_every_stub(tmp_path):
    cut = student.build(tmp_path / "edition", REPO)
    assert sorted(r.id for r in cut) == sorted(ASSIGNMENTS)
    result = _grade(tmp_path / "edition")
    for report in result["chapters"].values():
        assert report["status"] == "ok" and not report["anomalies"], report
        assert not report["nanovllm"].startswith(str(REPO))  # a spliced copy, elsewhere
    assert {r["submission"] for r in result["assignments"]} == {"stub"}
    assert (result["total"], result["max"]) == (0, sum(ASSIGNMENTS.values()))
    for assignment in ASSIGNMENTS:
        assert _stubs_hit(result, assignment), f"no test reaches the stub of {assignment}"
    # the edition keeps the handouts; its notebooks are valid (not executed: stubs raise)
    text = (tmp_path / "edition/nanovllm/engine/block_manager.py").read_text()
    assert "Handout (chapter 04 §3" in text
    stub = '        raise NotImplementedError("assignment 04.free'
    assert f"# >>> assignment 04.free (6 points)\n{stub}" in text  # the markers stay
    notebooks = list((tmp_path / "edition/chapters").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks and all("# BEGIN SOLUTION" not in p.read_text() for p in notebooks)
    sources = list((tmp_path / "edition/chapters").glob("[0-9][0-9]_*.py"))
    assert sources and all("# BEGIN SOLUTION" not in p.read_text() for p in sources)
    notebook = (tmp_path / "edition/chapters/01_model.ipynb").read_text()
    assert 'NotImplementedError(\\"exercise 01.' in notebook
    assert not (tmp_path / "edition/chapters/solutions").exists()


@pytest.mark.notebook_stream  # ~1 min each: balances make test's two streams
@pytest.mark.parametrize("assignment", _sample())
def test_one_region_cut_costs_exactly_its_points(tmp_path, assignment):
    """Swap-in, seen from the other side: most graded tests need several regions, so putting
    one region back alone cannot turn its tests green. Instead every region but one is put
    back: exactly the tests marked with that assignment fail (on its own stub for at least
    one), every other test passes, and that assignment scores 0. So no mark is spurious and
    no stub goes ungraded; all regions back is the reference (full marks, test below)."""
    student.build(tmp_path / "edition", REPO, ids=[assignment])
    result = _grade(tmp_path / "edition", chapters=[assignment[:2]])
    rows = {r["assignment"]: r for r in result["assignments"]}
    assert rows[assignment]["earned"] == 0 and rows[assignment]["total"] >= 2
    assert _stubs_hit(result, assignment)
    for test in _tests(result):
        expected = "failed" if assignment in test["assignments"] else "passed"
        assert test["outcome"] == expected, test


@pytest.mark.notebook_stream  # balances make test's two streams
def test_the_reference_scores_full_marks():
    """The reference earns every point of the chapters of the day's sampled assignments
    (``_sample``; the whole course, ~12 min on 2 cores, with NANOVLLM_COURSE_SAMPLE=all).
    Each assignment's tests also run on the reference in the unit tests; this checks the
    grader's sandbox and accounting on it."""
    chapters = sorted({a[:2] for a in _sample()})
    result = _grade(chapters=chapters)
    assert sorted(result["chapters"]) == chapters
    for report in result["chapters"].values():
        assert report["status"] == "ok" and not report["anomalies"], report
        assert not report["nanovllm"].startswith(str(REPO))
    expected = sum(points for a, points in ASSIGNMENTS.items() if a[:2] in chapters)
    assert result["total"] == result["max"] == expected
    assert all(r["total"] >= 2 for r in result["assignments"]), result["assignments"]


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

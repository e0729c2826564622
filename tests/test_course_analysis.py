"""The analysis questions (nanovllm/course/analysis.py): every chapter asks two or three, each
measure is deterministic, CPU-only and quick, the chapters print the questions and never a
measured value, the student's measure command fills the answers file, and the grader scores
a question from its own measurement in the sandbox (a stub's failure names the assignment)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from nanovllm.course import analysis
from nanovllm.course.regions import cut_files, find_regions, select
from nanovllm.course.sandbox import Sandbox

QUESTIONS = analysis.all_questions()
REPO = Path(__file__).resolve().parents[1]
CHAPTERS = [f"{c:02d}" for c in range(1, 18)]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every question measured once with this repository's (reference) code, with times."""
    out = {}
    for chapter in CHAPTERS:
        start = time.perf_counter()
        out |= analysis.measure_chapter(chapter)
        out[chapter] = {"seconds": time.perf_counter() - start}
    return out


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_two_or_three_questions(chapter):
    questions = analysis.questions(chapter)
    assert 2 <= len(questions) <= 3, [q.id for q in questions]
    for i, q in enumerate(questions, 1):
        assert q.id == f"{chapter}.q{i}" and q.chapter == chapter
        assert len(q.text) > 40 and q.text.endswith("?"), q.id
        assert q.unit and q.tolerance >= 0 and callable(q.measure), q.id


def test_every_measure_is_deterministic_quick_and_finite(measured):
    again = {}
    for chapter in CHAPTERS:
        again |= analysis.measure_chapter(chapter)
        assert measured[chapter]["seconds"] < 15 * len(analysis.questions(chapter)), chapter
    for qid in QUESTIONS:
        assert "value" in measured[qid], (qid, measured[qid])
        assert measured[qid] == again[qid], qid


def test_ask_prints_the_questions_and_never_measures(monkeypatch, capsys):
    def refuse():
        raise AssertionError("ask() must not measure")

    for qid, q in QUESTIONS.items():
        monkeypatch.setitem(QUESTIONS, qid, dataclasses.replace(q, measure=refuse))
    for chapter in CHAPTERS:
        analysis.ask(chapter)
        printed = capsys.readouterr().out
        texts = " ".join(q.text for q in analysis.questions(chapter))
        for q in analysis.questions(chapter):
            assert q.id in printed
        # every number printed is one the questions state (or the chapter's own): no answer
        allowed = set(NUMBER.findall(texts)) | {chapter, str(int(chapter))}
        allowed |= {n for q in analysis.questions(chapter) for n in NUMBER.findall(q.id)}
        assert set(NUMBER.findall(printed)) <= allowed, chapter


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_asks_its_questions_before_the_summary(chapter):
    source = next((REPO / "chapters").glob(f"{chapter}_*.py")).read_text()
    asked, summary = source.find(f'analysis.ask("{chapter}")'), source.find("# ## Summary")
    assert 0 < source.find("# ## Analysis questions") < asked < summary, chapter


def answers_for(chapter: str, measured: dict) -> dict:
    return {q.id: {"prediction": 1, "reasoning": "because", "measured": measured[q.id]["value"]}
            for q in analysis.questions(chapter)}  # fmt: skip


def test_scoring_correct_wrong_and_missing_answers(measured):
    chapter, right = "06", answers_for("06", measured)
    mine = {q.id: measured[q.id] for q in analysis.questions("06")}
    assert [r["earned"] for r in analysis.score_chapter(chapter, right, mine)] == [1, 1, 1]
    wrong = json.loads(json.dumps(right))
    wrong["06.q1"]["measured"] += 5
    del wrong["06.q2"]["prediction"]
    wrong["06.q3"]["reasoning"] = "  "
    rows = analysis.score_chapter(chapter, wrong, mine)
    assert [r["earned"] for r in rows] == [0, 0, 0]
    v = measured["06.q1"]["value"]
    said = f"measurement differs: student says {v + 5:g}, grader measured {v:g}"
    assert rows[0]["reason"] == said
    assert rows[1]["reason"].startswith("no prediction recorded")
    assert rows[2]["reason"] == "no reasoning recorded"
    # the tolerance is the recording's rounding: 08.q1 in dB to 0.05
    sqnr = {"08.q1": {**answers_for("08", measured)["08.q1"]}}
    sqnr["08.q1"]["measured"] = round(measured["08.q1"]["value"], 2)
    rows = analysis.score_chapter("08", sqnr, {"08.q1": measured["08.q1"]})
    assert rows[0]["earned"] == 1 and rows[1]["reason"] == "no answer recorded"
    assert "not valid JSON" in analysis.score_chapter("08", "analysis/08.json is not valid JSON: x",
                                                      {})[0]["reason"]


def test_measure_command_refuses_a_question_without_prediction(tmp_path, measured, capsys):
    assert analysis.measure_file("10", tmp_path) == 1  # no file yet: a blank one is written
    path = tmp_path / "analysis" / "10.json"
    blank = json.loads(path.read_text())
    assert set(blank) == {"10.q1", "10.q2"} and blank["10.q1"]["measured"] is None
    blank["10.q1"].update(prediction=30, reasoning="the debt first")
    path.write_text(json.dumps(blank))
    assert analysis.measure_file("10", tmp_path) == 1  # 10.q2 has no prediction
    filled = json.loads(path.read_text())
    assert filled["10.q1"]["measured"] == measured["10.q1"]["value"]
    assert filled["10.q2"]["measured"] is None
    assert "10.q2: no prediction recorded yet: predict first" in capsys.readouterr().out


def test_write_templates_gives_every_chapter_a_blank(tmp_path):
    analysis.write_templates(tmp_path)
    for chapter in CHAPTERS:
        blank = json.loads((tmp_path / "analysis" / f"{chapter}.json").read_text())
        assert list(blank) == [q.id for q in analysis.questions(chapter)]


def test_the_grader_measures_in_the_sandbox_and_names_a_stub(tmp_path, measured):
    """Chapter 04 graded twice through the sandbox: on the reference the recorded numbers
    score full; on a tree whose chapter-04 regions are stubs every measurement fails, naming
    the stub it met."""
    student = tmp_path / "student"
    (student / "analysis").mkdir(parents=True)
    (student / "analysis" / "04.json").write_text(json.dumps(answers_for("04", measured)))
    reference, stubbed = tmp_path / "reference", tmp_path / "stubbed"
    for tree in (reference, stubbed):
        shutil.copytree(REPO / "nanovllm", tree / "nanovllm",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    cut_files(select(find_regions(REPO / "nanovllm"), ["04"]), REPO, stubbed)
    sandbox = Sandbox(tmp_path / "private", REPO)
    full = analysis.grade_analysis(sandbox, reference, student, ["04"], 120)
    assert (full["total"], full["max"]) == (3, 3), full
    failed = analysis.grade_analysis(sandbox, stubbed, student, ["04"], 120)
    reasons = [r["reason"] for r in failed["questions"]]
    assert failed["total"] == 0, failed
    assert reasons[0].startswith("measurement failed: NotImplementedError from assignment 04.")
    assert reasons[2] == ("measurement failed: NotImplementedError from assignment 04.prepare "
                          "(a stub)")  # fmt: skip
    assert "ANALYSIS: 0 / 3 questions" in analysis.table(failed)

"""Analysis questions: predict a number, then measure it with your own code (every chapter's
last section before its summary; CS336's writeup deliverables are the model).

``python -m nanovllm.course.analysis NN`` prints chapter NN's questions (``make analysis
CH=NN``). The student writes a prediction and its reasoning for each in ``analysis/NN.json``
(the edition ships a template)::

    {"06.q1": {"prediction": 12, "reasoning": "64 + 64 tokens, then ...", "measured": null}}

then ``python -m nanovllm.course.analysis NN --measure`` (``make analysis CH=NN MEASURE=1``)
runs the measurements with the edition's code and fills in ``measured``; it refuses to
measure a question with no prediction recorded yet. The grader (:func:`grade_analysis`,
called by :mod:`nanovllm.course.grade`) measures again in the sandbox, on the spliced tree,
and gives a question 1 point when a prediction and a non-empty reasoning are recorded and the
recorded ``measured`` matches its own measurement within the question's tolerance. How close
the prediction came is not graded: it is for the writeup and the discussion. Analysis points
are reported beside the assignment points, never inside them.
The questions themselves live in :mod:`nanovllm.course.analysis_questions`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path

FOLDER = "analysis"  # in the edition's root: one NN.json per chapter
MAX_ANSWER_BYTES = 1 << 20
STUB = re.compile(r"assignment (\d\d\.\w+)")


def all_questions() -> dict:
    """Every question, by id, in chapter order (every module of the registry loaded)."""
    from nanovllm.course import (
        analysis_questions_advanced,  # noqa: F401  (registers 14-17, after 07-13)
        analysis_questions_late,  # noqa: F401  (registers 07-13)
    )
    from nanovllm.course.analysis_questions import QUESTIONS

    return QUESTIONS


def questions(chapter: str):
    """Chapter ``chapter``'s questions, in order."""
    chapter = f"{int(chapter):02d}"
    return [q for q in all_questions().values() if q.chapter == chapter]


def ask(chapter: str) -> None:
    """Print the chapter's questions (never a measured value: predict before you measure)."""
    chapter = f"{int(chapter):02d}"
    for q in questions(chapter):
        print(f"{q.id}  ({q.unit})")
        print(textwrap.fill(q.text, 92, initial_indent="    ", subsequent_indent="    "))
    print(f"Predict first: write a prediction and your reasoning for each in {FOLDER}/"
          f"{chapter}.json;\nthen measure with your code: make analysis CH={chapter} MEASURE=1 "
          f"(python -m nanovllm.course.analysis {chapter} --measure).")  # fmt: skip


def template(chapter: str) -> dict:
    return {q.id: {"prediction": None, "reasoning": "", "measured": None}
            for q in questions(chapter)}  # fmt: skip


def write_templates(root: Path) -> None:
    """``root``/analysis/NN.json for every chapter with questions (an edition's blanks)."""
    folder = Path(root) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for chapter in sorted({q.chapter for q in all_questions().values()}):
        (folder / f"{chapter}.json").write_text(json.dumps(template(chapter), indent=1) + "\n")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measure_chapter(chapter: str) -> dict[str, dict]:
    """{question id: {"value": number} or {"error": text}}, measured with the package this
    process imported. Triton kernels run under the interpreter (CPU tensors, any machine)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    results = {}
    for q in questions(chapter):
        try:
            value = float(q.measure())
            results[q.id] = {"value": value} if math.isfinite(value) else {"error": "not finite"}
        except Exception as e:  # a stub, or a region that fails: that question only
            results[q.id] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return results


def read_answers(path: Path) -> dict | str:
    """The student's answers file as a dict, or why it cannot be read."""
    if not path.is_file():
        return f"no {FOLDER}/{path.name}"
    if path.stat().st_size > MAX_ANSWER_BYTES:
        return f"{FOLDER}/{path.name} is larger than {MAX_ANSWER_BYTES} bytes"
    try:
        answers = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{FOLDER}/{path.name} is not valid JSON: {e}"
    return answers if isinstance(answers, dict) else f"{FOLDER}/{path.name} is not an object"


def _missing(entry) -> str | None:
    """Why an answer entry cannot score (prediction and reasoning first), or None."""
    if not isinstance(entry, dict):
        return "no answer recorded"
    if not _number(entry.get("prediction")):
        return "no prediction recorded (a number)"
    reasoning = entry.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning.strip():
        return "no reasoning recorded"
    if not _number(entry.get("measured")):
        return "no measurement recorded (run the chapter's measure command)"
    return None


def _failure(error: str) -> str:
    stub = STUB.search(error) if error.startswith("NotImplementedError") else None
    if stub:
        return f"measurement failed: NotImplementedError from assignment {stub[1]} (a stub)"
    return f"measurement failed: {error.splitlines()[0][:200] if error else 'no result'}"


def score_chapter(chapter: str, answers: dict | str, measured: dict[str, dict]) -> list[dict]:
    """One row per question: ``earned`` 1 or 0, with the reason when 0."""
    rows = []
    for q in questions(chapter):
        entry = answers.get(q.id) if isinstance(answers, dict) else None
        row = {"question": q.id, "earned": 0, "reason": None,
               "prediction": entry.get("prediction") if isinstance(entry, dict) else None,
               "student_measured": entry.get("measured") if isinstance(entry, dict) else None,
               "grader_measured": measured.get(q.id, {}).get("value")}  # fmt: skip
        if isinstance(answers, str):
            row["reason"] = answers
        elif reason := _missing(entry):
            row["reason"] = reason
        elif "value" not in measured.get(q.id, {}):
            row["reason"] = _failure(measured.get(q.id, {}).get("error", ""))
        elif abs(entry["measured"] - row["grader_measured"]) > q.tolerance + 1e-12:
            row["reason"] = (f"measurement differs: student says {entry['measured']:g}, "
                             f"grader measured {row['grader_measured']:g}")  # fmt: skip
        else:
            row["earned"] = 1
        rows.append(row)
    return rows


def grade_analysis(sandbox, tree: Path, student: Path, chapters: list[str], timeout: float):
    """Score ``student``'s analysis/NN.json of ``chapters`` against measurements made in
    ``sandbox`` on ``tree`` (the spliced tree: the student's regions, the instructor's rest).
    One process per chapter; a chapter without answers is not measured."""
    rows = []
    for chapter in chapters:
        answers = read_answers(Path(student) / FOLDER / f"{chapter}.json")
        measured: dict[str, dict] = {}
        if isinstance(answers, dict) and answers and questions(chapter):
            out = sandbox.outbox / f"analysis{chapter}.json"
            out.unlink(missing_ok=True)
            run = sandbox.run_module(tree, "nanovllm.course.analysis",
                                     [chapter, "--sandboxed", str(out), "--root", str(tree)],
                                     timeout, f"analysis{chapter}")  # fmt: skip
            if out.is_file():
                measured = json.loads(out.read_text())
            else:
                error = f"{run['status']}: {run['output'][-300:]}"
                measured = {q.id: {"error": error} for q in questions(chapter)}
        rows += score_chapter(chapter, answers, measured)
    return {"questions": rows, "total": sum(r["earned"] for r in rows), "max": len(rows)}


def table(result: dict) -> str:
    lines = ["analysis questions (beside the assignment points; predictions are not graded)"]
    unanswered = sorted({r["question"][:2] for r in result["questions"]
                         if (r["reason"] or "").startswith(f"no {FOLDER}/")})  # fmt: skip
    for r in result["questions"]:
        if r["question"][:2] not in unanswered:
            lines.append(f"{r['question']:8s} {r['earned']} / 1  {r['reason'] or ''}".rstrip())
    if unanswered:
        lines.append(f"no {FOLDER}/NN.json for chapters {', '.join(unanswered)}")
    lines.append(f"ANALYSIS: {result['total']} / {result['max']} questions")
    return "\n".join(lines)


def _package_below(root: Path) -> bool:
    import nanovllm

    return Path(nanovllm.__file__).resolve().is_relative_to(Path(root).resolve())


def measure_file(chapter: str, root: Path) -> int:
    """Fill ``measured`` into ``root``/analysis/NN.json for every question with a prediction."""
    path = Path(root) / FOLDER / f"{chapter}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(template(chapter), indent=1) + "\n")
        print(f"wrote a blank {path}: record your predictions there, then measure again")
        return 1
    answers = read_answers(path)
    if isinstance(answers, str):
        print(answers)
        return 1
    results, refused = measure_chapter(chapter), 0
    for q in questions(chapter):
        entry = answers.setdefault(q.id, template(chapter)[q.id])
        if not isinstance(entry, dict) or not _number(entry.get("prediction")):
            print(f"{q.id}: no prediction recorded yet: predict first, then measure")
            refused += 1
            continue
        if "error" in results[q.id]:
            print(f"{q.id}: {_failure(results[q.id]['error'])}")
            continue
        entry["measured"] = results[q.id]["value"]
        note = "" if str(entry.get("reasoning", "")).strip() else "  (add your reasoning)"
        print(f"{q.id}: predicted {entry['prediction']:g}, measured {entry['measured']:g}{note}")
    path.write_text(json.dumps(answers, indent=1) + "\n")
    return 1 if refused else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapter", help="the chapter, e.g. 06")
    parser.add_argument("--measure", action="store_true", help="measure, fill analysis/NN.json")
    parser.add_argument("--root", type=Path, default=Path("."), help="the edition's folder")
    parser.add_argument("--sandboxed", type=Path, help=argparse.SUPPRESS)  # the grader's run
    args = parser.parse_args(argv)
    chapter = f"{int(args.chapter):02d}"
    if not questions(chapter):
        sys.exit(f"chapter {chapter} has no analysis questions")
    if (args.measure or args.sandboxed) and not _package_below(args.root):
        import nanovllm

        sys.exit(f"nanovllm here is {nanovllm.__file__}, not the one below {args.root}: "
                 "run this from your edition's folder")  # fmt: skip
    if args.sandboxed:
        args.sandboxed.write_text(json.dumps(measure_chapter(chapter)))
    elif args.measure:
        sys.exit(measure_file(chapter, args.root))
    else:
        ask(chapter)


if __name__ == "__main__":
    main()

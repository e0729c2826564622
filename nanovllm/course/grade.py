"""Grade a student's regions with the instructor's tests:
``python -m nanovllm.course.grade --repo REPO [--student PATH] [--json OUT] [--chapters ..]``.

A submission is the code between the student's assignment markers and nothing else
(:mod:`nanovllm.course.submission`): each region's body is read from the student's files,
checked (:mod:`nanovllm.course.static_check`) and spliced into a clean copy of the instructor's
package; the instructor's tests are copied in after the splice. First a run on the all-stub
tree, with no student code in it, counts the graded tests (the trusted count); then one pytest
process per chapter runs on a fresh copy of the spliced tree in the sandbox
(:mod:`nanovllm.course.sandbox`), and its report is checked against that count (a test missing
from the report is a failure; too few or unknown tests, or times that add up to more than the
run took, are flagged). Partial credit: points x passed / tests marked with the assignment. A
region that is missing, malformed or flagged scores 0, the reason beside it; a chapter whose
process crashes or runs past ``--timeout`` scores 0, and grading goes on. Without ``--student``
the repository grades its own regions (it must score full marks). The analysis questions
(:mod:`nanovllm.course.analysis`) are measured again in the sandbox on the spliced tree and
scored beside the points, not inside them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from nanovllm.course import analysis
from nanovllm.course.regions import Region, find_regions
from nanovllm.course.sandbox import Sandbox
from nanovllm.course.submission import Submitted, read_submission, splice_package

TREE_FILES = ("pyproject.toml",)
ANALYSIS_TIMEOUT = 300  # seconds per chapter's measurements (each question takes seconds)
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")


def prepare_tree(repo: Path, out: Path, submitted: dict[str, Submitted]) -> Path:
    """``out``: the instructor's package with ``submitted`` spliced in, then the instructor's
    tests (every one, private ones included) and build files."""
    splice_package(repo, out, submitted)
    shutil.copytree(repo / "tests", out / "tests", ignore=IGNORE)
    for name in TREE_FILES:
        shutil.copy2(repo / name, out / name)
    return out


def relative_tests(repo: Path, tests: list[str] | None) -> list[str]:
    """Test paths / node ids relative to the repository (so they name the tree's copies)."""
    out = []
    for test in tests or ["tests"]:
        path, sep, node = test.partition("::")
        if Path(path).is_absolute():
            path = Path(path).resolve().relative_to(repo).as_posix()
        out.append(path + sep + node)
    return out


def trusted_count(sandbox: Sandbox, repo: Path, regions, tests, timeout, workdir) -> dict:
    """{node id: assignment ids} of the graded tests, collected on the all-stub tree."""
    stubs = {r.id: Submitted(r, "stub") for r in regions}
    tree = prepare_tree(repo, workdir / "collect", stubs)
    report = sandbox.run(tree, tests, timeout, extra=("--collect-only",))
    if report["status"] != "ok":
        raise RuntimeError(f"collecting the graded tests failed: {report}")
    return {t["nodeid"]: t["assignments"] for t in report["tests"]}


def anomalies(report: dict, expected: set[str]) -> list[str]:
    """What makes a chapter's report suspect, beside its score."""
    if report["status"] != "ok":
        return []
    found, reported = [], {t["nodeid"] for t in report["tests"]}
    if missing := expected - reported:
        found.append(f"{len(expected)} graded tests counted, {len(missing)} not in the report")
    if unknown := reported - expected:
        found.append(f"{len(unknown)} reported tests were never counted: {sorted(unknown)[:3]}")
    times = [t.get("duration") for t in report["tests"] if t["outcome"] != "not run"]
    if any(not isinstance(d, (int, float)) or d < 0 for d in times):
        found.append("a test reported no time or a negative one")
    elif sum(times) > report["wall_s"] + 1:
        found.append(f"tests took {sum(times):.1f} s in a run of {report['wall_s']:.1f} s")
    return found


def score(regions: list[Region], submitted, expected: dict, reports: dict) -> list[dict]:
    rows = []
    for r in regions:
        report, sub = reports[r.chapter], submitted[r.id]
        outcomes = {t["nodeid"]: t for t in report["tests"]}
        mine = [n for n, ids in expected.items() if r.id in ids]
        tests = [outcomes.get(n, {"nodeid": n, "outcome": "not reported"}) for n in mine]
        passed = sum(t["outcome"] == "passed" for t in tests) if report["status"] == "ok" else 0
        earned = r.points * passed / len(mine) if mine and sub.accepted else 0.0
        failure = next((t for t in tests if t["outcome"] != "passed"), None)
        rows.append(
            {
                "assignment": r.id,
                "passed": passed,
                "total": len(mine),
                "points": r.points,
                "earned": round(earned, 2),
                "submission": sub.status,
                "reasons": sub.reasons + report.get("anomalies", []),
                "status": report["status"],
                "first_failure": failure
                and f"{failure['nodeid']}: {failure.get('exception') or failure['outcome']}",
            }
        )
    return rows


def grade(
    student: Path | None,
    repo: Path,
    tests: list[str] | None = None,
    timeout: float = 1200,
    chapters: list[str] | None = None,
) -> dict:
    """Grade ``student``'s regions (``repo``'s own when None) with ``repo``'s tests."""
    repo = Path(repo).resolve()
    student = Path(student or repo).resolve()
    regions = find_regions(repo / "nanovllm")  # ids and points: the instructor's
    tests = relative_tests(repo, tests)
    wanted = sorted({r.chapter for r in regions})
    if chapters:
        wanted = [c for c in wanted if c in {f"{int(x):02d}" for x in chapters}]
    graded = [r for r in regions if r.chapter in wanted]
    submitted = read_submission(student, repo, regions)
    reports = {}
    with tempfile.TemporaryDirectory(prefix="nanovllm-grade-") as tmp:
        workdir = Path(tmp)
        sandbox = Sandbox(workdir / "private", repo)
        expected = trusted_count(sandbox, repo, regions, tests, timeout, workdir)
        spliced = prepare_tree(repo, workdir / "spliced", submitted)
        for chapter in wanted:
            tree = workdir / f"run{chapter}"
            shutil.copytree(spliced, tree)
            report = sandbox.run(tree, tests, timeout, chapter)
            mine = {n for n, ids in expected.items() if any(a[:2] == chapter for a in ids)}
            report["anomalies"] = anomalies(report, mine)
            reports[chapter] = report
            shutil.rmtree(tree, ignore_errors=True)
        # The analysis questions: measured again here, on a fresh copy of the spliced tree.
        shutil.copytree(spliced, workdir / "analysis")
        answers = analysis.grade_analysis(
            sandbox, workdir / "analysis", student, wanted, min(timeout, ANALYSIS_TIMEOUT)
        )
    rows = score(graded, submitted, expected, reports)
    return {
        "student": str(student),
        "assignments": rows,
        "total": round(sum(r["earned"] for r in rows), 2),
        "max": sum(r["points"] for r in rows),
        "analysis": answers,
        "chapters": reports,
    }


def table(result: dict) -> str:
    """The grade as text: one line per assignment, its first failure or reasons under it."""
    lines = [f"{'assignment':24s} {'tests':>9s} {'points':>13s}  submission / run"]
    for r in result["assignments"]:
        lines.append(
            f"{r['assignment']:24s} {r['passed']:>4d}/{r['total']:<4d} "
            f"{r['earned']:>6g} / {r['points']:<4d}  {r['submission']} / {r['status']}"
        )
        for reason in r["reasons"]:
            lines.append(f"    FLAGGED: {reason}")
        if r["first_failure"] and r["earned"] < r["points"]:
            lines.append(f"    first failure: {r['first_failure'].splitlines()[0][:200]}")
    lines.append(f"TOTAL: {result['total']:g} / {result['max']} points")
    if "analysis" in result:
        lines.append(analysis.table(result["analysis"]))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="the instructor's repository")
    parser.add_argument("--student", type=Path, help="the student's folder (default: --repo)")
    parser.add_argument("--json", type=Path, help="write the result there")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per chapter process")
    parser.add_argument("--chapters", nargs="*", help="grade only these chapters")
    parser.add_argument("--tests", nargs="*", help="test paths / node ids (default: tests)")
    args = parser.parse_args(argv)
    result = grade(args.student, args.repo, args.tests, args.timeout, args.chapters)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Grade a student's regions with the instructor's tests:
``python -m nanovllm.course.grade --repo REPO [--student PATH] [--json OUT] [--chapters ..]``.

A submission is the code between the student's assignment markers and nothing else
(:mod:`nanovllm.course.submission`): each region's body is read from the student's files,
checked (:mod:`nanovllm.course.static_check`) and spliced into a clean copy of the instructor's
package; the instructor's tests are copied in after the splice.

**Each assignment is graded by its own tests**: the tests marked with its id alone
(``@pytest.mark.assignment("04.free")``), aimed at its function and reaching no other region.
They run in a tree where that region is the student's and *every other region is its stub*, so
one unfinished assignment never costs another its points, and no other region's reference is
there to be read. First a run on the all-stub tree, with no student code in it, counts the graded
tests (the trusted count; without a GPU, tests marked ``gpu`` are left out of it, so they leave
the denominator); then one pytest process per assignment runs its own tests on a fresh tree in
the sandbox (:mod:`nanovllm.course.sandbox`), and its report is checked against the count (a
test missing from the report is a failure, a skipped one is no pass; too few or unknown tests,
or times that add up to more than the run took, are flagged). Points: points x passed / own
tests. A region that is still its stub scores 0 without a run; one that is missing, malformed
or flagged scores 0 (it runs as its stub), the reason beside it; a run that
crashes or passes ``--timeout`` scores its assignment 0 (the report names the test that was
running), and grading goes on.

With ``--engine``, the whole-engine tests that reach a chapter (marked with several ids) also
run, once per chapter, on a tree where that chapter's regions are the student's and every other
region is the reference; they are reported beside the points, not in them. Without
``--student`` the repository grades its own regions (it must score full marks). The analysis
questions (:mod:`nanovllm.course.analysis`) are measured again in the sandbox on the spliced
tree and scored beside the points, not inside them.
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


def graded_marks() -> str:
    """The tests a grade counts on this machine: without a GPU, none marked ``gpu``."""
    import torch

    return "assignment" if torch.cuda.is_available() else "assignment and not gpu"


def trusted_count(sandbox: Sandbox, repo: Path, regions, tests, timeout, workdir) -> dict:
    """{node id: assignment ids} of the graded tests, collected on the all-stub tree."""
    stubs = {r.id: Submitted(r, "stub") for r in regions}
    tree = prepare_tree(repo, workdir / "collect", stubs)
    report = sandbox.run(tree, tests, timeout, extra=("--collect-only",), marks=graded_marks())
    shutil.rmtree(tree, ignore_errors=True)
    if report["status"] != "ok":
        raise RuntimeError(f"collecting the graded tests failed: {report}")
    return {t["nodeid"]: t["assignments"] for t in report["tests"]}


def own_tests(expected: dict[str, list[str]], assignment: str) -> list[str]:
    """The node ids that grade ``assignment`` alone: marked with its id and no other."""
    return [n for n, ids in expected.items() if ids == [assignment]]


def engine_tests(expected: dict[str, list[str]], chapter: str) -> list[str]:
    """The node ids marked with several ids, one of them ``chapter``'s (whole-engine tests)."""
    return [n for n, ids in expected.items() if len(ids) > 1 and any(a[:2] == chapter for a in ids)]


def anomalies(report: dict, expected: set[str]) -> list[str]:
    """What makes a run's report suspect, beside its score."""
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


def _outcomes(report: dict, nodeids: list[str]) -> list[dict]:
    found = {t["nodeid"]: t for t in report["tests"]} if report["status"] == "ok" else {}
    return [found.get(n, {"nodeid": n, "outcome": "not reported"}) for n in nodeids]


def failure_line(test: dict) -> str:
    """A failing test in one line: its name and the first line of what it raised."""
    message = (test.get("exception") or test["outcome"]).strip().splitlines()
    return f"{test['nodeid']}: {message[0][:200] if message else test['outcome']}"


def score(region: Region, sub: Submitted, nodeids: list[str], report: dict) -> dict:
    """One assignment's row: its own tests' outcomes in ``report`` make its points."""
    tests = _outcomes(report, nodeids)
    passed = sum(t["outcome"] == "passed" for t in tests)
    earned = region.points * passed / len(nodeids) if nodeids and sub.accepted else 0.0
    failure = next((t for t in tests if t["outcome"] != "passed"), None)
    reasons = sub.reasons + report.get("anomalies", [])
    if not nodeids:
        reasons = [*reasons, "no own tests of this assignment were collected"]
    return {
        "assignment": region.id,
        "passed": passed,
        "total": len(nodeids),
        "points": region.points,
        "earned": round(earned, 2),
        "submission": sub.status,
        "reasons": reasons,
        "status": report["status"],
        "wall_s": round(report.get("wall_s", 0.0), 1),
        "tests": [{k: t.get(k) for k in ("nodeid", "outcome", "stubs")} for t in tests],
        "first_failure": failure and (
            failure_line(failure) if report["status"] == "ok" else report["status"]
        ),
    }


def _run(sandbox, repo, workdir, name, bodies, nodeids, timeout, chapter) -> dict:
    """``nodeids`` on a fresh tree with ``bodies`` spliced in; the report with its anomalies."""
    if not nodeids:
        return {"status": "ok", "tests": [], "wall_s": 0.0, "anomalies": []}
    tree = prepare_tree(repo, workdir / name, bodies)
    report = sandbox.run(tree, nodeids, timeout, chapter)
    report["anomalies"] = anomalies(report, set(nodeids))
    shutil.rmtree(tree, ignore_errors=True)
    return report


def grade(
    student: Path | None,
    repo: Path,
    tests: list[str] | None = None,
    timeout: float = 600,
    chapters: list[str] | None = None,
    engine: bool = False,
) -> dict:
    """Grade ``student``'s regions (``repo``'s own when None) with ``repo``'s tests."""
    repo = Path(repo).resolve()
    student = Path(student or repo).resolve()
    regions = find_regions(repo / "nanovllm")  # ids and points: the instructor's
    tests = relative_tests(repo, tests)
    wanted = sorted({r.chapter for r in regions})
    if chapters:
        wanted = [c for c in wanted if c in {f"{int(x):02d}" for x in chapters}]
    graded = sorted((r for r in regions if r.chapter in wanted), key=lambda r: r.chapter)
    submitted = read_submission(student, repo, regions)
    stubs = {r.id: Submitted(r, "stub") for r in regions}
    rows, engine_reports = [], {}
    with tempfile.TemporaryDirectory(prefix="nanovllm-grade-") as tmp:
        workdir = Path(tmp)
        sandbox = Sandbox(workdir / "private", repo)
        expected = trusted_count(sandbox, repo, regions, tests, timeout, workdir)
        for region in graded:
            mine, sub = own_tests(expected, region.id), submitted[region.id]
            if sub.status == "stub":  # nothing of the student's to run: 0 at once
                report = {"status": f"not written yet: {region.id}", "tests": [], "wall_s": 0.0}
            else:
                bodies = {**stubs, region.id: sub}
                report = _run(sandbox, repo, workdir, "run", bodies, mine, timeout, region.chapter)
            rows.append(score(region, sub, mine, report))
        if engine:
            reference = read_submission(repo, repo, regions)
            for chapter in wanted:
                bodies = {i: submitted[i] if i[:2] == chapter else reference[i] for i in reference}
                nodeids = engine_tests(expected, chapter)
                engine_reports[chapter] = _run(
                    sandbox, repo, workdir, "engine", bodies, nodeids, timeout, chapter
                )
            for row in rows:
                report = engine_reports[row["assignment"][:2]]
                nodeids = [n for n in engine_tests(expected, row["assignment"][:2])
                           if row["assignment"] in expected[n]]  # fmt: skip
                outcomes = _outcomes(report, nodeids)
                row["engine"] = {
                    "passed": sum(t["outcome"] == "passed" for t in outcomes),
                    "total": len(nodeids),
                    "status": report["status"],
                    "first_failure": next(
                        (failure_line(t) for t in outcomes if t["outcome"] != "passed"), None
                    ),
                }
        # The analysis questions: measured on the student's regions (the instructor's rest).
        spliced = prepare_tree(repo, workdir / "analysis", submitted)
        answers = analysis.grade_analysis(
            sandbox, spliced, student, wanted, min(timeout, ANALYSIS_TIMEOUT)
        )
        isolation = sandbox.isolation
    return {
        "student": str(student),
        "isolation": isolation,
        "assignments": rows,
        "total": round(sum(r["earned"] for r in rows), 2),
        "max": sum(r["points"] for r in rows),
        "analysis": answers,
        "engine": engine_reports,
    }


def table(result: dict) -> str:
    """The grade as text: one line per assignment, its first failure or reasons under it."""
    lines = [f"isolation: {result['isolation']}"]
    lines.append(f"{'assignment':24s} {'own tests':>9s} {'points':>13s}  submission / run")
    for r in result["assignments"]:
        lines.append(
            f"{r['assignment']:24s} {r['passed']:>4d}/{r['total']:<4d} "
            f"{r['earned']:>6g} / {r['points']:<4d}  {r['submission']} / {r['status']}"
        )
        for reason in r["reasons"]:
            lines.append(f"    FLAGGED: {reason}")
        if r["first_failure"] and r["earned"] < r["points"]:
            lines.append(f"    first failure: {r['first_failure']}")
        if "engine" in r:
            e = r["engine"]
            lines.append(f"    engine tests (the rest from the reference, not scored): "
                         f"{e['passed']}/{e['total']}"
                         + (f"; first failure: {e['first_failure']}" if e["first_failure"]
                            else ""))  # fmt: skip
    lines.append(f"TOTAL: {result['total']:g} / {result['max']} points")
    if "analysis" in result:
        lines.append(analysis.table(result["analysis"]))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="the instructor's repository")
    parser.add_argument("--student", type=Path, help="the student's folder (default: --repo)")
    parser.add_argument("--json", type=Path, help="write the result there")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--chapters", nargs="*", help="grade only these chapters")
    parser.add_argument("--tests", nargs="*", help="test paths / node ids (default: tests)")
    parser.add_argument("--engine", action="store_true",
                        help="also run the whole-engine tests of each chapter (not scored)")
    args = parser.parse_args(argv)
    result = grade(args.student, args.repo, args.tests, args.timeout, args.chapters, args.engine)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

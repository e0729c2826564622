"""Check the tests' assignment marks: ``python -m nanovllm.course.audit [--tests ...]``.

A graded test must carry every assignment its code reaches; otherwise, in a whole-course
edition, it fails on a stub it does not declare and costs another assignment its points. For
each distinct set S of ids that marked tests carry, this builds an edition in which every
region *outside* S is cut and runs the tests marked exactly S there: all must pass, each one
of them then reaching only stubs it declares. (The other direction, that no mark is spurious,
is what tests/test_course.py checks by cutting one region at a time.) The reference run and
one run per set take a few minutes on CPU; the exit status is 1 when a mark is missing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from nanovllm.course import grade, student
from nanovllm.course.regions import find_regions


def marked_tests(tests: list[str], workdir: Path, timeout: float) -> dict[tuple, list[str]]:
    """Marked tests of ``tests`` grouped by their (sorted) assignment ids."""
    report = grade.run_chapter(None, grade.REPO, tests, timeout, workdir, ("--collect-only",))
    if report["status"] != "ok":
        raise RuntimeError(f"collecting the marked tests failed: {report}")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for test in report["tests"]:
        groups[tuple(sorted(test["assignments"]))].append(test["nodeid"])
    return dict(groups)


def audit(tests: list[str] | None = None, timeout: float = 1200) -> list[dict]:
    """One row per id set: the tests run where only that set is filled in, and the failures."""
    tests = [str(grade.REPO / t) for t in (tests or ["tests"])]
    everything = {r.id for r in find_regions(grade.REPO / "nanovllm")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanovllm-audit-") as tmp:
        workdir = Path(tmp)
        shutil.copy(grade.PLUGIN, workdir / f"{grade.PLUGIN_MODULE}.py")
        for ids, nodeids in sorted(marked_tests(tests, workdir, timeout).items()):
            unknown = set(ids) - everything
            edition = workdir / "edition"
            student.build(edition, ids=sorted(everything - set(ids)))
            run_dir = workdir / "run"
            run_dir.mkdir(exist_ok=True)
            shutil.copy(grade.PLUGIN, run_dir / f"{grade.PLUGIN_MODULE}.py")
            nodes = [str(grade.REPO / n) for n in nodeids]
            report = grade.run_chapter(None, edition, nodes, timeout, run_dir)
            failed = [t for t in report["tests"] if t["outcome"] != "passed"]
            rows.append(
                {
                    "ids": ids,
                    "tests": len(nodeids),
                    "status": report["status"] if not unknown else f"unknown ids {unknown}",
                    "failed": [
                        {"nodeid": t["nodeid"], "stubs": t["stubs"], "outcome": t["outcome"]}
                        for t in failed
                    ],
                }
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="*", help="test paths / node ids (default: tests)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    args = parser.parse_args(argv)
    rows = audit(args.tests, args.timeout)
    bad = 0
    for row in rows:
        ok = row["status"] == "ok" and not row["failed"]
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {row['tests']:4d} tests  {' '.join(row['ids'])}")
        if row["status"] != "ok":
            print(f"       {row['status']}")
        for t in row["failed"]:
            print(f"       {t['outcome']}: {t['nodeid']}  stubs reached: {t['stubs'] or '-'}")
    print(f"{len(rows) - bad} of {len(rows)} id sets are complete")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

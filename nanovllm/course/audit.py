"""Check the tests' assignment marks: ``python -m nanovllm.course.audit --repo . [--tests ..]``.

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
from pathlib import Path

from nanovllm.course.grade import prepare_tree, relative_tests, trusted_count
from nanovllm.course.regions import find_regions
from nanovllm.course.sandbox import Sandbox
from nanovllm.course.submission import Submitted, read_submission


def audit(repo: Path, tests: list[str] | None = None, timeout: float = 1200) -> list[dict]:
    """One row per id set: the tests run where only that set is filled in, and the failures."""
    repo = Path(repo).resolve()
    tests = relative_tests(repo, tests)
    regions = find_regions(repo / "nanovllm")
    reference = read_submission(repo, repo, regions)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanovllm-audit-") as tmp:
        workdir = Path(tmp)
        sandbox = Sandbox(workdir / "private", repo)
        groups: dict[tuple, list[str]] = {}
        for nodeid, ids in trusted_count(sandbox, repo, regions, tests, timeout, workdir).items():
            groups.setdefault(tuple(sorted(ids)), []).append(nodeid)
        for ids, nodeids in sorted(groups.items()):
            unknown = set(ids) - set(reference)
            filled = {
                i: sub if i in ids else Submitted(sub.region, "stub")
                for i, sub in reference.items()
            }
            tree = prepare_tree(repo, workdir / "tree", filled)
            report = sandbox.run(tree, nodeids, timeout)
            shutil.rmtree(tree)
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
    parser.add_argument("--repo", type=Path, required=True, help="the instructor's repository")
    parser.add_argument("--tests", nargs="*", help="test paths / node ids (default: tests)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    args = parser.parse_args(argv)
    rows = audit(args.repo, args.tests, args.timeout)
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

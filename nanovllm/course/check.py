"""A student's own check, inside an edition: ``make check [CHAPTERS="04"]``, i.e.
``python -m nanovllm.course.check --root . [--chapters 04]``.

For each assignment of the chosen chapters (by default the ones this edition cut:
``course.json``, written by :mod:`nanovllm.course.student`; else every chapter with
assignments): a region that is still the stub is reported at once as "not written yet";
the filled ones run their public **own tests** (the tests marked with their id alone, the ones
that decide its points; the instructor grades with these and private ones,
:mod:`nanovllm.course.grade`), all in one sandboxed pytest process, and each row shows the tests
that pass and the first failure: the failing test's name and the first line of what it raised
(an assertion's message, or the stub of another assignment it met). A run past ``--timeout``
names the test that was running.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from nanovllm.course.grade import failure_line, graded_marks, own_tests
from nanovllm.course.regions import find_regions, is_stub, region_body
from nanovllm.course.sandbox import Sandbox

EDITION_FILE = "course.json"


def edition_chapters(root: Path) -> list[str]:
    """The chapters whose regions this edition cut (all chapters when it does not say)."""
    listing = root / EDITION_FILE
    if listing.exists():
        return sorted({a["id"][:2] for a in json.loads(listing.read_text())["assignments"]})
    return sorted({r.chapter for r in find_regions(root / "nanovllm")})


def check(
    root: Path, chapters: list[str] | None = None, timeout: float = 600, say=lambda line: None
) -> list[dict]:
    """One row per assignment of ``chapters``; ``say`` hears each stub as soon as it is found
    and each stage of the run."""
    root = Path(root).resolve()
    chapters = [f"{int(c):02d}" for c in chapters] if chapters else edition_chapters(root)
    regions = sorted(
        (r for r in find_regions(root / "nanovllm") if r.chapter in chapters),
        key=lambda r: r.chapter,
    )
    stubbed = {r.id for r in regions if is_stub(region_body(r.file.read_text(), r))}
    for region in regions:
        if region.id in stubbed:
            say(f"not written yet: {region.id} ({region.function}, {region.file.name})")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nanovllm-check-") as tmp:
        sandbox = Sandbox(Path(tmp) / "private", root)
        filled = [r for r in regions if r.id not in stubbed]
        expected, report = {}, {"status": "ok", "tests": []}
        if filled:
            say(f"collecting the public tests of {len(filled)} written assignment(s) ...")
            listed = sandbox.run(root, ["tests"], timeout, extra=("--collect-only",),
                                 marks=graded_marks())  # fmt: skip
            expected = {t["nodeid"]: t["assignments"] for t in listed["tests"]}
            nodeids = [n for r in filled for n in own_tests(expected, r.id)]
            say(f"running {len(nodeids)} own tests ...")
            if nodeids:
                report = sandbox.run(root, nodeids, timeout)
        outcomes = {t["nodeid"]: t for t in report["tests"]}
        for region in regions:
            mine = own_tests(expected, region.id)
            tests = [outcomes.get(n, {"nodeid": n, "outcome": "not run"}) for n in mine]
            failed = [t for t in tests if t["outcome"] != "passed"]
            row = {"assignment": region.id, "points": region.points, "passed": 0,
                   "total": len(mine), "run": report["status"]}  # fmt: skip
            if region.id in stubbed:
                row.update(status="stub", run="-", first_failure=f"not written yet: {region.id}")
            elif report["status"] != "ok":
                row.update(status="filled", first_failure=report["status"])
            else:
                row.update(
                    status="filled",
                    passed=len(tests) - len(failed),
                    first_failure=failure_line(failed[0]) if failed else
                    "" if mine else "no public own tests found",
                )  # fmt: skip
            rows[region.id] = row
    return [rows[r.id] for r in regions]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the edition's folder")
    parser.add_argument("--chapters", nargs="*", help="only these chapters")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the tests")
    args = parser.parse_args(argv)
    rows = check(args.root, args.chapters, args.timeout, say=lambda line: print(line, flush=True))
    print(f"{'assignment':22s} {'points':>6s}  {'region':6s}  own tests  first failure")
    for r in rows:
        tests = f"{r['passed']:>4d}/{r['total']:<4d}" if r["status"] == "filled" else "   -     "
        print(f"{r['assignment']:22s} {r['points']:>6d}  {r['status']:6s}  {tests:9s}  "
              f"{r['first_failure']}")  # fmt: skip
    done = sum(r["passed"] == r["total"] > 0 and r["status"] == "filled" for r in rows)
    print(f"{done} of {len(rows)} assignments pass their public own tests "
          "(the grade also counts private ones)")  # fmt: skip
    sys.exit(0 if done == len(rows) else 1)


if __name__ == "__main__":
    main()

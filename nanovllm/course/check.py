"""A student's own check, inside an edition: ``make check [CHAPTERS="04"]``, i.e.
``python -m nanovllm.course.check --root . [--chapters 04]``.

Runs the edition's public tests of each assignment (the tests marked
``@pytest.mark.assignment(...)`` that ship with it; the instructor grades with these and
private ones) and prints, per assignment: its points, whether its region is still the stub,
the public tests that pass, and the first failure in one readable line: the exception a
failing test met first (not a cleanup error raised while handling it), or the other
assignment whose stub it reached. By default the chapters this edition cut (``course.json``,
written by :mod:`nanovllm.course.student`), else every chapter with assignments.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from nanovllm.course.regions import find_regions, is_stub, region_body
from nanovllm.course.sandbox import Sandbox

EDITION_FILE = "course.json"


def edition_chapters(root: Path) -> list[str]:
    """The chapters whose regions this edition cut (all chapters when it does not say)."""
    listing = root / EDITION_FILE
    if listing.exists():
        return sorted({a["id"][:2] for a in json.loads(listing.read_text())["assignments"]})
    return sorted({r.chapter for r in find_regions(root / "nanovllm")})


def first_failure(test: dict, assignment: str) -> str:
    other = [s for s in test["stubs"] if s != assignment]
    if test["stubs"] and test["stubs"][0] != assignment:
        return f"needs {other[0]} first (still the stub)"
    message = (test.get("exception") or test["outcome"]).strip().splitlines()
    return f"{test['nodeid']}: {message[0][:160] if message else test['outcome']}"


def check(root: Path, chapters: list[str] | None = None, timeout: float = 1800) -> list[dict]:
    root = Path(root).resolve()
    chapters = [f"{int(c):02d}" for c in chapters] if chapters else edition_chapters(root)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanovllm-check-") as tmp:
        sandbox = Sandbox(Path(tmp), root)
        for chapter in chapters:
            report = sandbox.run(root, ["tests"], timeout, chapter)
            for region in [r for r in find_regions(root / "nanovllm") if r.chapter == chapter]:
                tests = [t for t in report["tests"] if region.id in t["assignments"]]
                failed = [t for t in tests if t["outcome"] != "passed"]
                rows.append(
                    {
                        "assignment": region.id,
                        "points": region.points,
                        "status": "stub" if is_stub(region_body(region.file.read_text(), region))
                        else "filled",
                        "passed": len(tests) - len(failed),
                        "total": len(tests),
                        "run": report["status"],
                        "first_failure": first_failure(failed[0], region.id) if failed
                        else report.get("output", "")[-300:] if report["status"] != "ok"
                        else "",
                    }
                )  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the edition's folder")
    parser.add_argument("--chapters", nargs="*", help="only these chapters")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per chapter")
    args = parser.parse_args(argv)
    rows = check(args.root, args.chapters, args.timeout)
    print(f"{'assignment':22s} {'points':>6s}  {'region':6s}  public tests  first failure")
    for r in rows:
        tests = f"{r['passed']:>4d}/{r['total']:<4d}" if r["run"] == "ok" else r["run"]
        print(f"{r['assignment']:22s} {r['points']:>6d}  {r['status']:6s}  {tests:12s}  "
              f"{r['first_failure']}")  # fmt: skip
    done = sum(r["passed"] == r["total"] > 0 and r["run"] == "ok" for r in rows)
    print(f"{done} of {len(rows)} assignments pass their public tests "
          "(the grade also counts private tests)")  # fmt: skip
    sys.exit(0 if done == len(rows) else 1)


if __name__ == "__main__":
    main()

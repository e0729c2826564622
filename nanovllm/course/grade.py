"""Grade a student's package with the instructor's tests:
``python -m nanovllm.course.grade [--student PATH] [--json OUT] [--timeout 1200]``.

For each chapter with assignments, one pytest process runs this repository's tests (which the
student cannot edit) marked ``@pytest.mark.assignment(...)`` with an id of that chapter, with
the student's root first on ``PYTHONPATH`` so that ``import nanovllm`` is the student's copy
(the plugin checks it). Partial credit: points x passed / tests marked with the assignment. A
chapter whose process crashes or runs past ``--timeout`` scores 0; grading goes on.
Without ``--student`` this repository grades itself (it must score full marks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nanovllm.course.regions import Region, find_regions

REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).with_name("pytest_plugin.py")
PLUGIN_MODULE = "_nanovllm_course_plugin"


def run_chapter(
    chapter: str | None,
    student: Path,
    tests: list[str],
    timeout: float,
    workdir: Path,
    extra: tuple[str, ...] = (),
) -> dict:
    """One pytest process for ``chapter`` (None: every marked test); returns the plugin's
    report plus ``status``. ``extra``: more pytest arguments (e.g. ``--collect-only``)."""
    report_path = workdir / f"chapter{chapter or 'all'}.json"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(student), str(workdir)]),
        NANOVLLM_COURSE_REPORT=str(report_path),
        NANOVLLM_COURSE_STUDENT=str(student),
        PYTHONHASHSEED="0",
        TQDM_DISABLE="1",
        HF_HUB_OFFLINE="1",
    )
    env.pop("NANOVLLM_COURSE_CHAPTER", None)
    if chapter:
        env["NANOVLLM_COURSE_CHAPTER"] = chapter
    env.pop("PYTHONSAFEPATH", None)
    # -P: no current directory on sys.path (it would put the instructor's package first).
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        *tests,
        "-m",
        "assignment",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN_MODULE,
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        *extra,
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:g} s", "tests": []}
    if proc.returncode not in (0, 1, 5) or not report_path.exists():  # 5: no tests ran
        tail = (proc.stdout + proc.stderr)[-2000:]
        return {"status": f"crashed (exit {proc.returncode})", "tests": [], "output": tail}
    report = json.loads(report_path.read_text())
    report["status"] = "ok"
    return report


def score(regions: list[Region], reports: dict[str, dict]) -> list[dict]:
    rows = []
    for r in regions:
        report = reports[r.chapter]
        mine = [t for t in report["tests"] if r.id in t["assignments"]]
        passed = sum(t["outcome"] == "passed" for t in mine) if report["status"] == "ok" else 0
        earned = r.points * passed / len(mine) if mine else 0.0
        rows.append(
            {
                "assignment": r.id,
                "passed": passed,
                "total": len(mine),
                "points": r.points,
                "earned": round(earned, 2),
                "status": report["status"],
            }
        )
    return rows


def grade(
    student: Path | None = None,
    tests: list[str] | None = None,
    timeout: float = 1200,
    chapters: list[str] | None = None,
) -> dict:
    """Grade ``student`` (this repository when None) and return the JSON-able result."""
    student = Path(student or REPO).resolve()
    # The assignments (ids, points) come from the instructor's reference, not the student's copy.
    regions = find_regions(REPO / "nanovllm")
    wanted = sorted({r.chapter for r in regions})
    if chapters:
        wanted = [c for c in wanted if c in {f"{int(x):02d}" for x in chapters}]
        regions = [r for r in regions if r.chapter in wanted]
    tests = [str(REPO / t) if not Path(t).is_absolute() else t for t in (tests or ["tests"])]
    reports = {}
    with tempfile.TemporaryDirectory(prefix="nanovllm-grade-") as tmp:
        workdir = Path(tmp)
        shutil.copy(PLUGIN, workdir / f"{PLUGIN_MODULE}.py")
        for chapter in wanted:
            reports[chapter] = run_chapter(chapter, student, tests, timeout, workdir)
    rows = score(regions, reports)
    return {
        "student": str(student),
        "assignments": rows,
        "total": round(sum(r["earned"] for r in rows), 2),
        "max": sum(r["points"] for r in rows),
        "chapters": reports,
    }


def table(result: dict) -> str:
    lines = [f"{'assignment':24s} {'tests':>9s} {'points':>13s}  status"]
    for r in result["assignments"]:
        lines.append(
            f"{r['assignment']:24s} {r['passed']:>4d}/{r['total']:<4d} "
            f"{r['earned']:>6g} / {r['points']:<4d}  {r['status']}"
        )
    lines.append(f"TOTAL: {result['total']:g} / {result['max']} points")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--student", type=Path, help="root of the student's copy (default: this repo)"
    )
    parser.add_argument("--json", type=Path, help="write the result there")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per chapter process")
    parser.add_argument("--chapters", nargs="*", help="grade only these chapters")
    parser.add_argument(
        "--tests", nargs="*", help="instructor test paths / node ids (default: tests)"
    )
    args = parser.parse_args(argv)
    result = grade(args.student, args.tests, args.timeout, args.chapters)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

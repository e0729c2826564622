"""A pytest plugin for the grader: records each test's outcome, its assignment ids and, for a
failure, the exception text; writes them as JSON at the end of the session.

Self-contained on purpose (it imports nothing from nanovllm): the grader copies it out of the
instructor's repository and loads it with ``-p``, so the student's package cannot replace it.
Configured by environment variables:

* ``NANOVLLM_COURSE_REPORT``: where to write the JSON report (required to write one);
* ``NANOVLLM_COURSE_CHAPTER``: keep only tests marked with an assignment of this chapter;
* ``NANOVLLM_COURSE_STUDENT``: the student's root; the session stops at once unless
  ``import nanovllm`` resolves below it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

STUB = re.compile(r"NotImplementedError: assignment (\d\d\.\w+)")
_results: dict[str, dict] = {}
_package: dict[str, str | None] = {"nanovllm": None}


def assignment_ids(item: pytest.Item) -> list[str]:
    ids: list[str] = []
    for mark in item.iter_markers("assignment"):
        ids.extend(a for a in mark.args if a not in ids)
    return ids


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "assignment(*ids): the assignments this test grades")


def pytest_sessionstart(session: pytest.Session) -> None:
    import nanovllm

    _package["nanovllm"] = str(Path(nanovllm.__file__).resolve())
    student = os.environ.get("NANOVLLM_COURSE_STUDENT")
    if student and not Path(_package["nanovllm"]).is_relative_to(Path(student).resolve()):
        _write(session)
        pytest.exit(f"nanovllm resolves to {_package['nanovllm']}, not below {student}", 3)


@pytest.hookimpl(trylast=True)  # after `-m assignment` has deselected the rest
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chapter = os.environ.get("NANOVLLM_COURSE_CHAPTER")
    if chapter:
        keep = [i for i in items if any(a.startswith(chapter + ".") for a in assignment_ids(i))]
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    for item in items:  # a test that never reports (e.g. --collect-only) stays "not run"
        if assignment_ids(item):
            _results[item.nodeid] = {
                "nodeid": item.nodeid,
                "assignments": assignment_ids(item),
                "outcome": "not run",
                "exception": None,
                "stubs": [],
            }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    entry = _results.setdefault(
        item.nodeid,
        {
            "nodeid": item.nodeid,
            "assignments": assignment_ids(item),
            "outcome": "not run",
            "exception": None,
            "stubs": [],
        },
    )
    if entry["outcome"] == "not run":
        entry["outcome"] = "passed"
    if report.failed:
        entry["outcome"] = "failed" if entry["outcome"] != "error" else "error"
        if report.when != "call":
            entry["outcome"] = "error"
        if entry["exception"] is None and call.excinfo is not None:
            entry["exception"] = call.excinfo.exconly()[:2000]
        text = report.longreprtext
        for stub in STUB.findall(text):
            if stub not in entry["stubs"]:
                entry["stubs"].append(stub)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def _write(session: pytest.Session) -> None:
    path = os.environ.get("NANOVLLM_COURSE_REPORT")
    if not path:
        return
    report = {
        "nanovllm": _package["nanovllm"],
        "exitstatus": int(getattr(session, "exitstatus", 0)),
        "tests": list(_results.values()),
    }
    Path(path).write_text(json.dumps(report, indent=2))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(session)

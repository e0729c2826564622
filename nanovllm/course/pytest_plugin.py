"""A pytest plugin for the grader: records each test's outcome, its assignment ids and, for a
failure, the exception text; writes them as JSON at the end of the session.

Self-contained on purpose (it imports nothing from nanovllm): the grader copies it into a
private folder and loads it from that file before pytest starts (:mod:`nanovllm.course.sandbox`),
so nothing the student submits can replace it. Each test's ``duration`` (all phases) lets the
grader flag impossible times.
Configured by environment variables:

* ``NANOVLLM_COURSE_REPORT``: where to write the JSON report (required to write one);
* ``NANOVLLM_COURSE_PROGRESS``: where to write the node id of the test now running;
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


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """The test now running, for the grader to name after a timeout."""
    path = os.environ.get("NANOVLLM_COURSE_PROGRESS")
    if path:
        Path(path).write_text(nodeid)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception it was raised while handling, earliest first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain[::-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test passes only when its call phase ran and passed (a setup that never reaches the
    test, or a skipped call, is no pass); the first failing phase keeps its exception."""
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
    entry.setdefault("duration", 0.0)
    entry["duration"] += report.duration
    if report.when == "call" and report.passed and entry["outcome"] == "not run":
        entry["outcome"] = "passed"
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        if entry["exception"] is None and call.excinfo is not None:
            chain = _chain(call.excinfo.value)
            first = chain[0]
            entry["exception"] = f"{type(first).__name__}: {first}"[:2000]
            for error in chain:
                for stub in STUB.findall(f"{type(error).__name__}: {error}"):
                    if stub not in entry["stubs"]:
                        entry["stubs"].append(stub)
        for stub in STUB.findall(report.longreprtext):
            if stub not in entry["stubs"]:
                entry["stubs"].append(stub)
    elif report.skipped and entry["outcome"] in ("not run", "passed"):
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

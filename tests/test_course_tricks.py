"""The tricks that forged grades (issue 28), each as a submission that must score 0 or be
flagged by the grader (nanovllm/course/grade.py), plus a few more.

All on chapter 10's one assignment (``10.token_bucket``, 4 points, three pure-Python tests: the
fastest chapter to grade). Tricks outside the region never reach the graded tree (it is the
untouched edition's, byte for byte); tricks inside it are flagged before anything runs. Three
sandboxed runs prove the rest: an honest solution scores 4/4, every trick at once scores 0, and
a probe test inside the grading process finds nothing that leads to the reference.
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest

from nanovllm.course import grade, student
from nanovllm.course.regions import find_regions, region_body
from nanovllm.course.sandbox import Sandbox
from nanovllm.course.submission import Submitted, read_submission, splice_package

REPO = Path(__file__).resolve().parents[1]
ID, FILE = "10.token_bucket", "nanovllm/serve/admission.py"
TESTS = ["tests/test_serve_assignments.py"]
STUB = 'raise NotImplementedError("assignment 10.token_bucket'

# Outside the region: {path in the student's folder: code appended to it (or the whole file)}.
OUTSIDE = {
    "exec the reference via the working directory": {
        FILE: "import os as _os\n"
        'exec(open(_os.getcwd() + "/nanovllm/serve/admission.py").read(), globals())\n'
    },
    "exec the reference via the editable install's metadata": {
        FILE: "import importlib.metadata as _md, json as _json\n"
        '_url = _json.loads(_md.distribution("nanovllm").read_text("direct_url.json"))["url"]\n'
        'exec(open(_url[len("file://"):] + "/nanovllm/serve/admission.py").read(), globals())\n'
    },
    "wrap the grader plugin's writer from nanovllm/__init__.py": {
        "nanovllm/__init__.py": "import sys as _sys\n"
        '_plugin = _sys.modules.get("_nanovllm_course_plugin")\n'
        "if _plugin is not None:\n"
        "    _write = _plugin._write\n"
        "    def _forged(session):\n"
        "        for _t in _plugin._results.values():\n"
        '            _t["outcome"] = "passed"\n'
        "        _write(session)\n"
        "    _plugin._write = _forged\n"
    },
    "no-op Function.runtest when _pytest is loaded": {
        "nanovllm/__init__.py": "import sys as _sys\n"
        'if "_pytest" in _sys.modules:\n'
        "    import _pytest.python\n"
        "    _pytest.python.Function.runtest = lambda self: None\n"
    },
    "a _nanovllm_course_plugin.py in the student's root": {
        "_nanovllm_course_plugin.py": "import json, os\n"
        "def pytest_sessionfinish(session, exitstatus):\n"
        '    open(os.environ["NANOVLLM_COURSE_REPORT"], "w").write(json.dumps({"tests": []}))\n'
    },
    "a pytest/ package in the student's root": {
        "pytest/__init__.py": "",
        "pytest/__main__.py": "import json, os\n"
        'open(os.environ["NANOVLLM_COURSE_REPORT"], "w").write(json.dumps({"tests": []}))\n',
    },
}
# Inside the region: the code a student puts between the markers, and what the grader says.
INSIDE = {
    "exec the reference via the working directory": (
        'exec(open(os.getcwd() + "/nanovllm/serve/admission.py").read(), globals())',
        "`exec`",
    ),
    "read the editable install's direct_url.json": (
        "import importlib.metadata\n"
        'url = importlib.metadata.distribution("nanovllm").read_text("direct_url.json")',
        "imports `importlib.metadata`",
    ),
    "no-op Function.runtest": (
        "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None",
        "imports `_pytest.python`",
    ),
    "patch the plugin through sys.modules": (
        'sys.modules["_nanovllm_course_plugin"]._write = print',
        "`sys`",
    ),
    "read the instructor's files through __file__": (
        'text = (Path(__file__).parents[2] / "nanovllm/serve/admission.py").read_text()',
        "`__file__`",
    ),
    "write outside the tree": ('open("/tmp/forged.json", "w").write("{}")', "`open`"),
    "patch a module the tests use": ("time.monotonic = lambda: 0.0", "module-level `time`"),
    "reach builtins by name": ('f = getattr(__builtins__, "op" + "en")', "`getattr`"),
    "reach a function's globals": ("g = self.clock.__globals__", "`__globals__`"),
    # Built from strings, where a check of names sees nothing (issue 42): a function's
    # globals, builtins by a built name, the path from numpy's file to the checkout.
    "a function's globals by attrgetter": (
        'g = operator.attrgetter("__globals__")(self._refill)', "`attrgetter`"
    ),
    "builtins by a built name": (
        'b = operator.attrgetter("_" * 2 + "globals" + "_" * 2)(self._refill)["__builtins__"]',
        "`attrgetter`",
    ),
    "a dunder in a string": ('p = "{0.__file__}".format(numpy)', "a string holds `__`"),
    "escape the function": (
        "pass\n<dedent>def wait_time(self, amount):\n    return 0.0",
        "left of the region's markers",
    ),
    "open a string that swallows the code after the region": ('doc = """', "not whole"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tricks")


@pytest.fixture(scope="module")
def edition(workdir) -> Path:
    """What the student starts from: an edition with 10.token_bucket cut."""
    out = workdir / "edition"
    student.build(out, REPO, ids=[ID])
    return out


@pytest.fixture(scope="module")
def regions():
    return find_regions(REPO / "nanovllm")


@pytest.fixture(scope="module")
def untouched_tree(workdir, edition, regions) -> Path:
    """The graded tree of the edition handed in untouched (10.token_bucket: the stub)."""
    out = workdir / "untouched-tree"
    splice_package(REPO, out, read_submission(edition, REPO, regions))
    return out


def submit(edition: Path, out: Path, appended=None, region_code: str | None = None) -> Path:
    """A copy of the edition with code appended to files (or files added) and, when given,
    ``region_code`` between the markers of 10.token_bucket."""
    shutil.copytree(edition, out, ignore=shutil.ignore_patterns("chapters", "figures"))
    for relative, code in (appended or {}).items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + code)
    if region_code is not None:
        lines = (out / FILE).read_text().splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if STUB in line)
        code = "".join(  # "<dedent>": a line at the method's own indentation, not the body's
            " " * 4 + line[len("<dedent>") :] if line.startswith("<dedent>") else " " * 8 + line
            for line in (region_code + "\n").splitlines(keepends=True)
        )
        lines[at] = code
        (out / FILE).write_text("".join(lines))
    return out


def reference_code() -> str:
    region = next(r for r in find_regions(REPO / FILE) if r.id == ID)
    body = region_body(region.file.read_text(), region)
    return "".join(line[8:] for line in body.splitlines(keepends=True)).rstrip("\n")


def same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    if cmp.left_only or cmp.right_only or mismatch or errors:
        return False
    return all(same_tree(a / d, b / d) for d in cmp.common_dirs)


@pytest.mark.parametrize("trick", sorted(OUTSIDE))
def test_a_trick_outside_the_region_never_reaches_the_graded_tree(
    trick, edition, workdir, regions, untouched_tree
):
    folder = submit(edition, workdir / f"outside-{sorted(OUTSIDE).index(trick)}", OUTSIDE[trick])
    submitted = read_submission(folder, REPO, regions)
    assert submitted[ID].status == "stub"
    graded = workdir / f"graded-{sorted(OUTSIDE).index(trick)}"
    splice_package(REPO, graded, submitted)
    assert same_tree(graded, untouched_tree), "the graded tree is the untouched edition's"


@pytest.mark.parametrize("trick", sorted(INSIDE))
def test_a_trick_inside_the_region_is_flagged_or_rejected(trick, edition, workdir, regions):
    code, reason = INSIDE[trick]
    folder = submit(edition, workdir / f"inside-{sorted(INSIDE).index(trick)}", region_code=code)
    sub = read_submission(folder, REPO, regions)[ID]
    assert sub.status in ("flagged", "malformed") and not sub.accepted
    assert any(reason in r for r in sub.reasons), sub.reasons


def test_a_region_without_its_markers_is_missing(edition, workdir, regions):
    folder = submit(edition, workdir / "no-markers")
    text = (folder / FILE).read_text()
    (folder / FILE).write_text(
        "".join(line for line in text.splitlines(True) if "assignment 10.token_bucket" not in line
                or STUB in line)
    )  # fmt: skip
    sub = read_submission(folder, REPO, regions)[ID]
    assert sub.status == "missing" and "markers" in sub.reasons[0]


def test_an_honest_solution_scores_full_marks(edition, workdir):
    folder = submit(edition, workdir / "honest", region_code=reference_code())
    result = grade.grade(folder, REPO, TESTS, timeout=300, chapters=["10"])
    (row,) = result["assignments"]
    assert row["submission"] == "filled" and not row["reasons"], row
    assert (row["passed"], row["total"], result["total"]) == (3, 3, 4), grade.table(result)


def test_every_trick_at_once_scores_zero(edition, workdir):
    appended: dict[str, str] = {}
    for files in OUTSIDE.values():
        for path, code in files.items():
            appended[path] = appended.get(path, "") + code
    code = INSIDE["exec the reference via the working directory"][0]
    folder = submit(edition, workdir / "all-tricks", appended, region_code=code)
    result = grade.grade(folder, REPO, TESTS, timeout=300, chapters=["10"])
    (row,) = result["assignments"]
    assert row["status"] == "ok", row
    assert not [r for r in row["reasons"] if "counted" in r or " took " in r], row  # no anomaly
    assert result["total"] == 0 and row["submission"] == "flagged", grade.table(result)
    assert all(ID in t["stubs"] for t in row["tests"]), "every test met the stub"
    assert "FLAGGED" in grade.table(result) and "`exec`" in grade.table(result)


PROBE = """
import importlib.metadata, os, sys
from pathlib import Path

import pytest

REPO = {repo!r}


@pytest.mark.assignment("10.token_bucket")
def test_nothing_leads_to_the_reference():
    tree = Path.cwd()
    assert not tree.is_relative_to(REPO)
    # the working directory holds the graded copy, whose region is the stub
    assert {stub!r} in (tree / "nanovllm/serve/admission.py").read_text()
    # no distribution named nanovllm: no direct_url.json naming the checkout
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("nanovllm")
    urls = [d.read_text("direct_url.json") or "" for d in importlib.metadata.distributions()]
    assert not [u for u in urls if REPO in u or "nanovllm" in u]
    # no editable finder, no path entry or environment variable naming the checkout
    assert not [f for f in sys.meta_path if "editable" in repr(f) + type(f).__module__]
    assert not [p for p in sys.path if REPO in p], sys.path
    assert not [k for k, v in os.environ.items() if REPO in v]
    assert "PYTHONPATH" not in os.environ and "VIRTUAL_ENV" not in os.environ
    # the package is the tree's; the plugin and pytest come from outside it
    import _pytest
    import nanovllm

    assert Path(nanovllm.__file__).is_relative_to(tree)
    for module in (sys.modules["_nanovllm_course_plugin"], pytest, _pytest):
        assert not Path(module.__file__).is_relative_to(tree), module
    # In the OS sandbox the checkout does not exist: no path leads there, however it is built
    # (here: from numpy's real file up, the walk of issue 42's string-built escape).
    if {sandboxed!r}:
        import numpy

        assert not (Path(REPO) / "nanovllm").exists() and not (Path(REPO) / "tests").exists()
        for parent in Path(os.path.realpath(numpy.__file__)).parents:
            held = parent / "nanovllm/serve/admission.py"
            assert not held.exists() or {stub!r} in held.read_text(), held
"""


def test_the_grading_process_finds_nothing_that_leads_to_the_reference(workdir, regions):
    sandbox = Sandbox(workdir / "private", REPO)
    stubs = {r.id: Submitted(r, "stub") for r in regions}
    tree = grade.prepare_tree(REPO, workdir / "probe-tree", stubs)
    probe = PROBE.format(repo=str(REPO), stub=STUB, sandboxed=sandbox.os_sandboxed)
    (tree / "tests/test_probe.py").write_text(probe)
    report = sandbox.run(tree, ["tests/test_probe.py"], timeout=300)
    assert report["status"] == "ok", report
    (test,) = report["tests"]
    assert test["outcome"] == "passed", test["exception"]


def test_a_report_that_does_not_match_the_count_is_flagged():
    expected = {"t::a", "t::b", "t::c"}
    tests = [{"nodeid": "t::a", "outcome": "passed", "duration": 0.5},
             {"nodeid": "t::x", "outcome": "passed", "duration": 9.0}]  # fmt: skip
    found = grade.anomalies({"status": "ok", "tests": tests, "wall_s": 2.0}, expected)
    assert any("2 not in the report" in f for f in found)
    assert any("never counted" in f for f in found)
    assert any("9.5 s in a run of 2.0 s" in f for f in found)
    tests[0]["duration"] = -1
    assert any("negative" in f for f in grade.anomalies({"status": "ok", "tests": tests,
                                                          "wall_s": 2.0}, expected))  # fmt: skip


DAEMON = """
import subprocess, sys, time

import pytest


@pytest.mark.assignment("10.token_bucket")
def test_leaves_a_daemon():
    # a process in a session of its own: a process-group kill does not reach it
    code = "import os, time; open({marker!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    {then}
"""


@pytest.mark.parametrize("ending", ["returns", "hangs"])
def test_nothing_a_graded_run_starts_outlives_it(workdir, regions, ending):
    """A finished run and a run killed at its time limit leave no process behind, not even one
    that left the run's process group (a Ray worker, a server): the OS sandbox's process
    namespace ends with the run."""
    import time

    sandbox = Sandbox(workdir / f"private-daemon-{ending}", REPO)
    if not sandbox.os_sandboxed:
        pytest.skip(f"no OS sandbox here: {sandbox.isolation}")
    stubs = {r.id: Submitted(r, "stub") for r in regions}
    tree = grade.prepare_tree(REPO, workdir / f"daemon-{ending}", stubs)
    marker = tree / "daemon.pid"
    then = "time.sleep(600)" if ending == "hangs" else "pass"
    (tree / "tests/test_daemon.py").write_text(DAEMON.format(marker=str(marker), then=then))
    report = sandbox.run(tree, ["tests/test_daemon.py"], timeout=20 if ending == "hangs" else 120)
    if ending == "hangs":
        assert report["status"].startswith("timeout"), report
        assert "test_leaves_a_daemon" in report["running"]
    else:
        assert report["status"] == "ok", report
    # the pid is the sandbox's own; look for the process by its command line instead
    time.sleep(1)
    alive = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).find(str(marker)) >= 0]
    assert marker.exists() and not alive, alive


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

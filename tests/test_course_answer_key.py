"""The answer key never ships (nanovllm/course/answer_key.py): no edition, no committed chapter
output and no staged book holds a line of an assignment region's code or of an exercise's worked
solution; ``show_source`` shows regions as their stubs; the exercises' solutions live only in
chapters/solutions/; an edition can cut a chapter and every later one; each assignment keeps
public tests in the edition, and the edition carries its assignment list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.course import assignment_table, student
from nanovllm.course.answer_key import key_lines, leaks, region_lines, solution_lines
from nanovllm.course.check import check
from nanovllm.course.regions import find_regions, region_body
from nanovllm.course.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[1]
TEXT = {".py", ".ipynb", ".md", ".json", ".cfg", ".toml", ".txt", ".yml", ".yaml", ".html"}


def scan(root: Path, key: set[str]) -> dict[str, list[str]]:
    """{file: the key lines it holds} for every text file under ``root``."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in TEXT:
            if hits := leaks(path.read_text(errors="replace"), key):
                found[path.relative_to(root).as_posix()] = hits[:3]
    return found


@pytest.fixture(scope="module")
def key() -> set[str]:
    lines = key_lines(REPO)
    assert len(region_lines(REPO)) > 50 and len(solution_lines(REPO)) > 50  # a key to find
    return lines


@pytest.fixture(scope="module")
def whole_course(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("editions") / "whole"
    student.build(out, REPO)
    return out


def test_the_whole_course_edition_ships_no_answer(whole_course, key):
    assert scan(whole_course, key) == {}
    assert not (whole_course / "chapters/solutions").exists()
    assert not (whole_course / "chapters/INSTRUCTORS.md").exists()
    # the GPU-run copies keep their measurements, not their code listings
    runs = sorted((whole_course / "figures/data/gpu_runs").glob("*.ipynb"))
    assert runs and all(json.loads(p.read_text())["cells"] for p in runs)


def test_a_week_edition_through_later_chapters_ships_no_later_answer(tmp_path):
    cut = student.build(tmp_path / "week4", REPO, chapters=["04"], through=True)
    assert {r.chapter for r in cut} == {r.chapter for r in find_regions(REPO / "nanovllm")
                                         if r.chapter >= "04"}  # fmt: skip
    later = {r.id for r in cut}
    assert scan(tmp_path / "week4", region_lines(REPO, later) | solution_lines(REPO)) == {}
    listing = json.loads((tmp_path / "week4/course.json").read_text())
    assert sorted(a["id"] for a in listing["assignments"]) == sorted(later)


def test_committed_chapters_and_the_staged_book_hold_no_answer(tmp_path, key):
    from nanovllm.viz import book

    book.stage(tmp_path / "book", root=REPO)
    assert scan(tmp_path / "book", key) == {}
    chapters = {p.name: leaks(p.read_text(), key) for p in (REPO / "chapters").glob("[0-9]*")}
    assert {name: hits for name, hits in chapters.items() if hits} == {}


MODULE = '''
def first(x):
    """One."""
    # >>> assignment 01.first (1 points)
    value_of_the_first_region = x * 1234567 + 7654321
    return value_of_the_first_region
    # <<< assignment 01.first


def second(x):
    """Two."""
    # >>> assignment 01.second (1 points)
    value_of_the_second_region = x * 2345678 + 8765432
    return value_of_the_second_region
    # <<< assignment 01.second


def third(x):
    """Three."""
    # >>> assignment 01.third (1 points)
    value_of_the_third_region = x * 3456789 + 9876543
    return value_of_the_third_region
    # <<< assignment 01.third
'''


def test_the_key_holds_every_region_of_a_file_with_several(tmp_path):
    """Cutting a file's regions one by one with line numbers taken before the first cut left
    the later regions in the public text, and their key empty (issue 42)."""
    for folder in ("nanovllm", "tests", "chapters"):
        (tmp_path / folder).mkdir()
    (tmp_path / "nanovllm/module.py").write_text(MODULE)
    key = region_lines(tmp_path)
    for name in ("first", "second", "third"):
        assert f"value_of_the_{name}_region = x * " in " ".join(key), (name, key)
    assert len(key) == 6  # two lines of each region


def test_every_region_of_the_package_has_lines_in_the_key(key):
    for region in find_regions(REPO / "nanovllm"):
        body = {line.strip() for line in region_body(region.file.read_text(), region).splitlines()}
        assert body & key, f"{region.id}: none of its lines is in the key"


def test_a_copy_planted_in_a_shipped_file_is_found(whole_course, key, tmp_path):
    """The scan that proves the editions clean finds a region's line wherever it is planted:
    in a copied figure record, in a notebook's output (JSON-escaped)."""
    import shutil

    edition = tmp_path / "planted"
    shutil.copytree(whole_course / "figures", edition / "figures")
    region = next(r for r in find_regions(REPO / "nanovllm") if r.id == "08.token_scales")
    line = next(s for s in region_body(region.file.read_text(), region).splitlines()
                if s.strip() in key).strip()  # fmt: skip
    assert scan(edition, key) == {}
    record = edition / "figures/data/planted.json"
    record.write_text(json.dumps({"outputs": [{"text": f"print({line!r})\n{line}"}]}))
    assert line in scan(edition, key)["figures/data/planted.json"]


def test_show_source_shows_each_region_as_its_stub(key):
    from nanovllm.viz.source import elided_source

    for region in find_regions(REPO / "nanovllm"):
        module = region.file.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
        obj = __import__(module, fromlist=["_"])
        for part in region.function.split("."):
            obj = getattr(obj, part)
        shown = elided_source(obj)
        assert region.stub().strip() in shown, region.id
        assert region.summary in shown  # the handout docstring stays
        assert "# >>> assignment" not in shown and "# <<< assignment" not in shown, region.id
        assert not leaks(shown, key), region.id


def test_every_assignment_keeps_public_tests_and_the_edition_lists_them(whole_course, tmp_path):
    private = student.private_tests(REPO)
    shipped = {p.relative_to(whole_course / "tests").as_posix()
               for p in (whole_course / "tests").rglob("test_*.py")}  # fmt: skip
    assert shipped and not shipped & private
    sandbox = Sandbox(tmp_path / "private", REPO)
    report = sandbox.run(whole_course, ["tests"], timeout=600, extra=("--collect-only",))
    assert report["status"] == "ok", report
    public = {a for t in report["tests"] for a in t["assignments"]}
    assert public == {r.id for r in find_regions(REPO / "nanovllm")}
    # the chapter's table, run on the edition's own package: ids, points, stub
    probe = "from nanovllm.course import assignment_table; print(assignment_table('04'))"
    env = {**os.environ, "PYTHONPATH": str(whole_course)}
    table = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert re.search(r"04\.allocate +8 points +stub", table), table
    assert re.search(r"total +30 points", table), table
    assert "filled" in assignment_table("04") and "stub" not in assignment_table("04")


def test_make_check_names_a_stub_at_once_and_a_failing_test_with_its_message(
    whole_course, tmp_path
):
    said = []
    (row,) = check(whole_course, ["10"], timeout=600, say=said.append)
    assert (row["assignment"], row["status"], row["passed"]) == ("10.token_bucket", "stub", 0)
    assert row["first_failure"] == "not written yet: 10.token_bucket"
    assert said[0].startswith("not written yet: 10.token_bucket")
    # a wrong answer (it forgets the capacity): the failing test and its assertion, in one line
    import shutil

    edition = tmp_path / "wrong"
    shutil.copytree(whole_course, edition, ignore=shutil.ignore_patterns("chapters", "figures"))
    path = edition / "nanovllm/serve/admission.py"
    text = path.read_text()
    stub = next(line for line in text.splitlines() if "assignment 10.token_bucket:" in line)
    wrong = ("now = self.clock()\n        self.level += (now - self.updated) * self.rate\n"
             "        self.updated = now")  # fmt: skip
    path.write_text(text.replace(stub.strip(), wrong))
    (row,) = check(edition, ["10"], timeout=600)
    assert row["status"] == "filled" and row["run"] == "ok" and 0 < row["passed"] < row["total"]
    assert row["first_failure"].startswith("tests/test_serve_assignments.py::"), row
    assert "AssertionError: assert" in row["first_failure"], row


def test_the_first_stub_met_is_reported_not_a_cleanup_error():
    """In the whole-course edition `generate` meets 04.cached_prefix, and its cleanup then
    meets 04.free: the report names the first (nanovllm/course/pytest_plugin.py)."""
    from nanovllm.course.pytest_plugin import _chain

    try:
        try:
            raise NotImplementedError("assignment 04.cached_prefix: the first stub met")
        except NotImplementedError:
            raise NotImplementedError("assignment 04.free: raised while cleaning up") from None
    except NotImplementedError as error:
        chain = _chain(error)
    assert [str(e).split(":")[0] for e in chain] == [
        "assignment 04.cached_prefix", "assignment 04.free"
    ]  # fmt: skip

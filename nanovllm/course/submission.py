"""A submission is the code between the student's assignment markers, and nothing else.

The grader (:mod:`nanovllm.course.grade`) reads each region's body out of the student's files
(:func:`read_submission`), checks it on its own (whole statements, nothing indented above its
markers, :mod:`nanovllm.course.static_check`), and splices the accepted bodies into a clean copy
of the instructor's package (:func:`splice_package`): every line outside the regions, and every
file without one, is the instructor's. A region that is missing, malformed or flagged is graded
as its stub, with the reason beside its score.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from nanovllm.course.regions import (
    CLOSE,
    OPEN,
    Region,
    RegionError,
    is_stub,
    regions_in_file,
    splice_text,
)
from nanovllm.course.static_check import check_region, module_names


@dataclass
class Submitted:
    """One region as submitted. ``status``: filled, stub, missing, malformed or flagged."""

    region: Region
    status: str
    body: str | None = None  # dedented code, when the region was found and parses
    reasons: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.status in ("filled", "stub")


def _between_markers(text: str, region_id: str) -> tuple[str, list[str]] | str:
    """(indent, body lines) of the region ``region_id`` in a student's file, or why not."""
    lines = text.splitlines()
    opens = [i for i, line in enumerate(lines) if (m := OPEN.match(line)) and m["id"] == region_id]
    closes = [
        i for i, line in enumerate(lines) if (m := CLOSE.match(line)) and m["id"] == region_id
    ]
    if not opens and not closes:
        return "its markers are missing"
    if len(opens) != 1 or len(closes) != 1 or closes[0] < opens[0]:
        return "its markers are not one opening line followed by one closing line"
    indent = OPEN.match(lines[opens[0]])["indent"]
    if CLOSE.match(lines[closes[0]])["indent"] != indent:
        return "its two markers are indented differently"
    body = lines[opens[0] + 1 : closes[0]]
    if any(OPEN.match(line) or CLOSE.match(line) for line in body):
        return "another region's marker sits inside it"
    return indent, body


def read_region(text: str, region: Region, modules: set[str]) -> Submitted:
    """The student's version of ``region`` from ``text`` (the student's copy of its file)."""
    found = _between_markers(text, region.id)
    if isinstance(found, str):
        return Submitted(region, "missing" if "missing" in found else "malformed", None, [found])
    indent, lines = found
    if any(line.strip() and not line.startswith(indent) for line in lines):
        return Submitted(region, "malformed", None, ["a line sits left of the region's markers"])
    body = "".join(line[len(indent) :] + "\n" for line in lines)
    if not body.strip() or all(ln.strip().startswith("#") for ln in lines if ln.strip()):
        return Submitted(region, "malformed", None, ["the region holds no code"])
    try:
        ast.parse(body)
    except SyntaxError as e:
        why = f"not whole statements: {e.msg} (line {e.lineno})"
        return Submitted(region, "malformed", None, [why])
    if is_stub(body):
        return Submitted(region, "stub", body)
    flags = check_region(body, modules)
    return Submitted(region, "flagged" if flags else "filled", body, flags)


def read_submission(student: Path, repo: Path, regions: list[Region]) -> dict[str, Submitted]:
    """Every region of the instructor's ``regions`` (found under ``repo``) as ``student`` has
    it, keyed by id."""
    out = {}
    for region in regions:
        relative = region.file.resolve().relative_to(repo.resolve())
        path = student / relative
        if not path.is_file():
            out[region.id] = Submitted(region, "missing", None, [f"no file {relative}"])
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            out[region.id] = Submitted(region, "malformed", None, [f"{relative} unreadable: {e}"])
            continue
        out[region.id] = read_region(text, region, module_names(region.file.read_text()))
    return out


def _indented(body: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else "\n" for line in body.splitlines(True))


def _spliced(region_file: Path, text: str, bodies: dict[Region, str]) -> str:
    """The file with ``bodies`` spliced in, or RegionError when the result does not keep the
    reference's regions in the reference's functions."""
    new = splice_text(text, bodies)
    try:
        found = regions_in_file(region_file, new)
    except (RegionError, SyntaxError) as e:
        raise RegionError(str(e)) from e
    expected = {r.id: r.function for r in bodies}
    if {r.id: r.function for r in found if r.id in expected} != expected:
        raise RegionError("the spliced region left its function")
    return new


def splice_package(repo: Path, out: Path, submitted: dict[str, Submitted]) -> None:
    """Copy ``repo``/nanovllm to ``out``/nanovllm with each region's code replaced: the
    student's when accepted, the stub otherwise (a body the splice rejects is marked
    malformed in ``submitted``)."""
    shutil.copytree(
        repo / "nanovllm", out / "nanovllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    by_file: dict[Path, list[Submitted]] = {}
    for sub in submitted.values():
        by_file.setdefault(sub.region.file, []).append(sub)
    for path, subs in by_file.items():
        text = path.read_text()

        def code(sub: Submitted) -> str:
            if sub.status == "filled":
                return _indented(sub.body, sub.region.indent)
            return sub.region.stub()

        try:
            new = _spliced(path, text, {s.region: code(s) for s in subs})
        except RegionError:  # find the culprits one at a time; the rest go in
            for sub in subs:
                if sub.status != "filled":
                    continue
                others = {s.region: s.region.stub() for s in subs if s is not sub}
                try:
                    _spliced(path, text, {**others, sub.region: code(sub)})
                except RegionError as e:
                    sub.status, sub.reasons = "malformed", [f"does not splice: {e}"]
            new = _spliced(path, text, {s.region: code(s) for s in subs})
        relative = path.resolve().relative_to(repo.resolve())
        (out / relative).write_text(new)

"""The answer key never ships: what it is, and how to find it in a file or scrub it from one.

The answer key is the code of every assignment region (its marker lines aside: an edition
keeps them around the stub) and the worked solutions of the notebook exercises (kept in
``chapters/solutions/``, instructor only). :func:`key_lines` lists its non-trivial lines;
:func:`leaks` finds them in any text; :func:`scrub_notebook` drops the outputs of an executed
notebook that print them (the GPU-run copies under ``figures/data/gpu_runs/``).
tests/test_course_answer_key.py scans every edition and the staged book with these.
"""

from __future__ import annotations

import re
from pathlib import Path

from nanovllm.course.exercises import BEGIN, END, solution_files
from nanovllm.course.regions import find_regions, region_body, splice_text

MIN_CHARS = 25  # shorter lines (`return out`, `self.level = level`) are not a giveaway
# A solution marker as a line of code (in a .py, or in a notebook's JSON), not a mention of it.
MARKER = re.compile(r'(^|\\n|")[ \t]*# (BEGIN|END) SOLUTION[ \t]*(\\n|$)', re.MULTILINE)


def _lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if len(s := line.strip()) >= MIN_CHARS}


def public_text(repo: Path) -> str:
    """What every edition ships anyway: the package outside its regions, the tests, the
    chapters' own code (a chapter builds a component small before showing the package's)."""
    texts = []
    for path in (repo / "nanovllm").rglob("*.py"):
        text = path.read_text()
        if "# >>> assignment" in text:  # every region of the file cut at once: the line
            text = splice_text(text, {r: "" for r in find_regions(path)})  # numbers hold
        texts.append(text)
    for path in [*(repo / "tests").rglob("*.py"), *(repo / "chapters").glob("[0-9][0-9]_*.py")]:
        texts.append(path.read_text())
    return "\n".join(texts)


def region_lines(repo: Path, ids: set[str] | None = None) -> set[str]:
    """Non-trivial lines of the regions' code (of ``ids``, or all) that nothing public holds."""
    secret: set[str] = set()
    for region in find_regions(repo / "nanovllm"):
        if ids is None or region.id in ids:
            body = region_body(region.file.read_text(), region)
            secret |= {s for s in _lines(body) if not s.startswith("#")}
    public = public_text(repo)
    return {line for line in secret if line not in public}


def solution_lines(repo: Path) -> set[str]:
    """Non-trivial lines of the exercises' worked solutions (chapters/solutions/) that
    nothing public holds."""
    lines: set[str] = set()
    for path in solution_files(repo / "chapters"):
        inside = False
        for line in path.read_text().splitlines():
            if BEGIN.match(line):
                inside = True
            elif END.match(line):
                inside = False
            elif inside and len(line.strip()) >= MIN_CHARS and not line.strip().startswith("#"):
                lines.add(line.strip())
    public = public_text(repo)
    return {line for line in lines if line not in public}


def key_lines(repo: Path) -> set[str]:
    return region_lines(repo) | solution_lines(repo)


def leaks(text: str, key: set[str]) -> list[str]:
    """The lines of ``key`` (and solution markers) that ``text`` holds. A notebook's JSON
    escapes quotes and backslashes, so each line is looked for both ways."""
    found = [m.group(0).strip('\\n" \t') for m in MARKER.finditer(text)]
    for line in sorted(key):
        escaped = line.replace("\\", "\\\\").replace('"', '\\"')
        if line in text or escaped in text:
            found.append(line)
    return found


def scrub_notebook(nb, key: set[str]) -> int:
    """Drop, in place, every output of an nbformat notebook that prints a line of ``key``;
    returns how many were dropped."""
    dropped = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        keep = []
        for output in cell.get("outputs", []):
            data = output.get("data", {}).values()
            text = "".join([output.get("text", ""), *output.get("traceback", [])])
            text += "".join(v for v in data if isinstance(v, str))
            if leaks(text, key):
                dropped += 1
            else:
                keep.append(output)
        cell.outputs = keep
    return dropped

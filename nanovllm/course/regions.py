"""Assignment regions: reference code between two marker comments inside one function.

```python
def allocate(self, seq, num_new_tokens, cached=()):
    \"\"\"The handout: what to write, the shapes, the chapter section, a hint.\"\"\"
    # >>> assignment 04.allocate (8 points)
    ...reference code...
    # <<< assignment 04.allocate
```

Cutting a region replaces the code between its markers with ``raise NotImplementedError(
"assignment 04.allocate: <first line of the docstring>")`` at the indentation of the opening
marker; the markers stay, so that the student writes between them and the grader finds the
student's code there (:mod:`nanovllm.course.submission`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

OPEN = re.compile(
    r"^(?P<indent>[ \t]*)# >>> assignment (?P<id>\S+) \((?P<points>[^)]*) points?\)\s*$"
)
CLOSE = re.compile(r"^(?P<indent>[ \t]*)# <<< assignment (?P<id>\S+)\s*$")
ANY_MARKER = re.compile(r"^\s*# (>>>|<<<) assignment\b")
ID = re.compile(r"^(?P<chapter>\d\d)\.[A-Za-z_][A-Za-z0-9_]*$")


class RegionError(ValueError):
    """A malformed or inconsistent assignment region."""


@dataclass(frozen=True)
class Region:
    id: str  # "04.allocate"
    points: int
    file: Path
    start: int  # 1-based line of the opening marker
    end: int  # 1-based line of the closing marker
    indent: str
    function: str  # qualified name of the enclosing function
    summary: str  # first line of the function's docstring

    @property
    def chapter(self) -> str:
        return self.id[:2]

    def stub(self) -> str:
        message = (
            f"assignment {self.id}: {self.summary}" if self.summary else f"assignment {self.id}"
        )
        return f"{self.indent}raise NotImplementedError({message!r})\n"


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its qualified name (innermost last for nested ones)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((name, child))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def regions_in_file(path: Path, text: str | None = None) -> list[Region]:
    """The regions of one file (its ``text`` when given), validated (raises RegionError)."""
    text = path.read_text() if text is None else text
    if "# >>> assignment" not in text and "# <<< assignment" not in text:
        return []
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    functions = _functions(tree)
    # Only real comments count (a marker quoted in a docstring is no marker).
    comment_lines = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    }
    regions, open_ = [], None
    for number, line in enumerate(lines, start=1):
        if number not in comment_lines or not ANY_MARKER.match(line):
            continue
        where = f"{path}:{number}"
        if m := OPEN.match(line):
            if open_ is not None:
                raise RegionError(f"{where}: region {m['id']} opens inside {open_[0]['id']}")
            open_ = (m, number)
        elif m := CLOSE.match(line):
            if open_ is None:
                raise RegionError(f"{where}: closing marker of {m['id']} without an opening one")
            start_match, start = open_
            if m["id"] != start_match["id"]:
                raise RegionError(f"{where}: closes {m['id']}, but {start_match['id']} is open")
            if m["indent"] != start_match["indent"]:
                raise RegionError(f"{where}: the markers of {m['id']} are indented differently")
            regions.append(_region(path, start_match, start, number, lines, functions))
            open_ = None
        else:
            raise RegionError(f"{where}: malformed assignment marker: {line.strip()!r}")
    if open_ is not None:
        raise RegionError(f"{path}:{open_[1]}: region {open_[0]['id']} is never closed")
    return regions


def _region(path, m, start, end, lines, functions) -> Region:
    where = f"{path}:{start}"
    if not ID.match(m["id"]):
        raise RegionError(f"{where}: id {m['id']!r} is not CC.name (two-digit chapter)")
    try:
        points = int(m["points"])
    except ValueError:
        raise RegionError(f"{where}: points {m['points']!r} are not an integer") from None
    if points <= 0:
        raise RegionError(f"{where}: {m['id']} must be worth more than 0 points")
    body = [
        n
        for n in range(start + 1, end)
        if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    ]
    if not body:
        raise RegionError(f"{where}: region {m['id']} holds no code")
    # Innermost function whose body holds both markers: the region must lie inside it, and
    # it must hold whole statements of that body (checked by parsing the cut file).
    enclosing = [
        (name, fn)
        for name, fn in functions
        if fn.body[0].lineno <= start and body[-1] <= fn.end_lineno
    ]
    if not enclosing:
        raise RegionError(f"{where}: region {m['id']} is not inside a function")
    name, fn = max(enclosing, key=lambda nf: nf[1].lineno)
    for node in ast.walk(fn):  # a nested def/class may not straddle a marker
        if node is not fn and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            if (
                node.lineno < start <= node.end_lineno < end
                or start < node.lineno <= end < node.end_lineno
            ):
                raise RegionError(f"{where}: region {m['id']} straddles {node.name}")
    doc = ast.get_docstring(fn) or ""
    summary = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    return Region(m["id"], points, path, start, end, m["indent"], name, summary)


def find_regions(root: Path | str) -> list[Region]:
    """Every region under ``root`` (a folder or one file), validated: ids unique."""
    root = Path(root)
    files = (
        [root]
        if root.is_file()
        else sorted(
            p
            for p in root.rglob("*.py")
            if not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    )
    regions: list[Region] = []
    for path in files:
        regions.extend(regions_in_file(path))
    seen: dict[str, Region] = {}
    for region in regions:
        if region.id in seen:
            other = seen[region.id]
            raise RegionError(
                f"{region.file}:{region.start}: id {region.id} already used at "
                f"{other.file}:{other.start}"
            )
        seen[region.id] = region
    return regions


def cut_text(text: str, regions: list[Region]) -> str:
    """``text`` (one file's) with the code of ``regions`` (of that file) replaced by their
    stubs, the markers kept."""
    return splice_text(text, {r: r.stub() for r in regions})


def splice_text(text: str, bodies: dict[Region, str]) -> str:
    """``text`` (one file's) with the code between each region's markers replaced by
    ``bodies[region]`` (lines already at the region's indentation)."""
    lines = text.splitlines(keepends=True)
    for region in sorted(bodies, key=lambda r: r.start, reverse=True):
        body = bodies[region]
        lines[region.start : region.end - 1] = [body if body.endswith("\n") else body + "\n"]
    return "".join(lines)


STUB = re.compile(r"^\s*raise NotImplementedError\((?P<q>['\"])assignment (?P<id>\d\d\.\w+)\b")


def is_stub(body: str) -> bool:
    """Whether a region's code is still its stub (one ``raise NotImplementedError(...)``)."""
    code = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    return len(code) == 1 and STUB.match(code[0]) is not None


def region_body(text: str, region: Region) -> str:
    """The code between a region's markers in ``text`` (the file it was found in)."""
    return "".join(text.splitlines(keepends=True)[region.start : region.end - 1])


def cut_files(
    regions: list[Region], src_root: Path, dst_root: Path | None = None
) -> dict[Path, str]:
    """Cut ``regions`` (found under ``src_root``); returns {relative path: new text} and, with
    ``dst_root``, writes each file there. Every cut file must still parse."""
    by_file: dict[Path, list[Region]] = {}
    for region in regions:
        by_file.setdefault(region.file, []).append(region)
    out = {}
    for path, file_regions in by_file.items():
        new = cut_text(path.read_text(), file_regions)
        rel = path.resolve().relative_to(Path(src_root).resolve())
        check_parses(new, rel)
        out[rel] = new
        if dst_root is not None:
            (Path(dst_root) / rel).write_text(new)
    return out


def check_parses(text: str, name: Path | str = "<cut>") -> None:
    try:
        ast.parse(text, filename=str(name))
    except SyntaxError as e:
        raise RegionError(f"{name}: does not parse once cut: {e}") from e


def select(regions: list[Region], chapters=None, ids=None, through: bool = False) -> list[Region]:
    """The regions of ``chapters`` (all when None), or exactly ``ids`` when given. With
    ``through``, every chapter from the earliest of ``chapters`` on (a week's edition that
    does not ship the later weeks' answers)."""
    known = {r.id for r in regions}
    if ids is not None:
        unknown = set(ids) - known
        if unknown:
            raise RegionError(f"no such assignment: {', '.join(sorted(unknown))}")
        return [r for r in regions if r.id in set(ids)]
    if chapters:
        chapters = {f"{int(c):02d}" for c in chapters}
        if through:
            return [r for r in regions if r.chapter >= min(chapters)]
        return [r for r in regions if r.chapter in chapters]
    return list(regions)

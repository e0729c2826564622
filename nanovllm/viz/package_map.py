"""The map of the book and of the package, read from the source (chapter 00 and the README).

Every module's docstring names the chapter that teaches it, so no map is typed by hand:
``package_modules`` reads each module's length, the first sentence of its docstring and the
chapters it names; ``chapter_table`` lists, per chapter (titles from ``chapters/NN_*.py``), the
modules that name it, and last the modules that name none, so that every module appears once at
least; ``module_tree`` prints the package folder by folder. Chapter 00 shows the last two, and

    python -m nanovllm.viz.package_map [--root .] [--check]

writes the chapter table and the module list into the README between their markers
(``--check``: only report whether they are current; tests/test_package_map.py checks). Only the
folders given are read: nothing here guesses where a repository is.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# A docstring names chapters as "chapter 04", "chapters 04 and 06", "chapters 00-11", ...
_CHAPTERS = re.compile(r"chapters?\s+((?:\d\d(?:,\s*|\s+and\s+|\s*-\s*)?)+)", re.I)
_HEADING = re.compile(r"^# # Chapter (\d\d) — (.+)$", re.M)
README_SECTIONS = ("chapter-table", "module-list")


@dataclass(frozen=True)
class ModuleInfo:
    path: str  # relative to the package folder, e.g. "engine/scheduler.py"
    lines: int
    summary: str  # the docstring's first sentence
    chapters: tuple[str, ...]  # the chapters its docstring names, e.g. ("04", "06")


def chapters_named(docstring: str) -> tuple[str, ...]:
    found = []
    for match in _CHAPTERS.finditer(docstring):
        found += re.findall(r"\d\d", match.group(1))
    return tuple(sorted(set(found)))


def first_sentence(docstring: str) -> str:
    """The docstring's first sentence (its first paragraph, up to the first full stop)."""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    return re.split(r"(?<=[.!?])\s(?!\(|[a-z])", paragraph)[0]


def package_modules(package: Path) -> list[ModuleInfo]:
    """Every ``.py`` file under ``package`` (a folder such as ``Path(nanovllm.__file__).parent``),
    in path order."""
    modules = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        modules.append(ModuleInfo(path.relative_to(package).as_posix(), len(text.splitlines()),
                                  first_sentence(doc), chapters_named(doc)))
    return modules


def chapter_titles(chapters: Path) -> dict[str, tuple[str, str]]:
    """Chapter number -> (source file name, title), from the ``# # Chapter NN — Title`` line of
    each ``chapters/NN_*.py``."""
    titles = {}
    for source in sorted(chapters.glob("[0-9][0-9]_*.py")):
        heading = _HEADING.search(source.read_text())
        titles[source.name[:2]] = (source.name, heading.group(2) if heading else source.stem[3:])
    return titles


def _grouped(paths: list[str]) -> str:
    """``["engine/a.py", "engine/b.py", "llm.py"]`` -> ``llm; engine/ a, b``: top-level
    modules first, then folder by folder."""
    folders: dict[str, list[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        folders.setdefault(folder, []).append(name.removesuffix(".py"))
    return "; ".join(f"{folder + '/ ' if folder else ''}{', '.join(names)}"
                     for folder, names in sorted(folders.items()))


def chapter_table(modules: list[ModuleInfo], chapters: Path, links: bool = True) -> str:
    """A Markdown table: each chapter, its title (a link to ``chapters/NN_*.py`` with
    ``links``) and the modules whose docstrings name it; a chapter that modules name but
    that has no source yet is marked as not written; the last row holds the modules that
    name no chapter."""
    titles = chapter_titles(chapters)
    by_chapter: dict[str, list[str]] = {}
    for module in modules:
        for chapter in module.chapters:
            by_chapter.setdefault(chapter, []).append(module.path)
    rows = ["| # | chapter | package modules whose docstring names it (under `nanovllm/`) |",
            "|---|---|---|"]
    for number in sorted(set(titles) | set(by_chapter)):
        source, title = titles.get(number, (None, "*not written yet*"))
        if links and source:
            title = f"[{title}]({chapters.name}/{source})"
        rows.append(f"| {number} | {title} | {_grouped(by_chapter.get(number, [])) or '-'} |")
    unnamed = [m.path for m in modules if not m.chapters]
    if unnamed:
        rows.append(f"| - | *no chapter: tooling and package plumbing* | {_grouped(unnamed)} |")
    return "\n".join(rows)


def module_list(modules: list[ModuleInfo]) -> str:
    """A Markdown list of every module with its docstring's first sentence (no line counts, so
    that it changes only when a module comes, goes or is described anew)."""
    return "\n".join(f"- `{m.path}`: {m.summary or '(no docstring)'}" for m in modules)


def module_tree(modules: list[ModuleInfo]) -> str:
    """The package folder by folder: each module's length in lines, the chapters its
    docstring names and the first sentence of its docstring; a total at the end."""
    rows, shown = [f"{'nanovllm/':<34} {'lines':>5}  {'chapters':<14} summary"], set()
    for m in modules:
        parts = m.path.split("/")
        for depth in range(1, len(parts)):  # each folder once, before its files
            if tuple(parts[:depth]) not in shown:
                shown.add(tuple(parts[:depth]))
                rows.append("  " * depth + parts[depth - 1] + "/")
        name = "  " * len(parts) + parts[-1]
        rows.append(f"{name:<34} {m.lines:5d}  {', '.join(m.chapters):<14} {m.summary}")
    total = sum(m.lines for m in modules)
    rows.append(f"{'total':<34} {total:5d}  lines in {len(modules)} modules")
    return "\n".join(rows)


def _markers(section: str) -> tuple[str, str]:
    return (f"<!-- {section}: generated by python -m nanovllm.viz.package_map -->",
            f"<!-- end of {section} -->")


def render_readme(readme: str, root: Path) -> str:
    """``readme`` with its generated sections (between their markers) made current from
    ``root``'s ``nanovllm/`` and ``chapters/``."""
    modules = package_modules(root / "nanovllm")
    content = {"chapter-table": chapter_table(modules, root / "chapters"),
               "module-list": module_list(modules)}
    for section in README_SECTIONS:
        start, end = _markers(section)
        if readme.count(start) != 1 or readme.count(end) != 1:
            raise ValueError(f"the README must hold the lines {start!r} and {end!r} once each")
        head, rest = readme.split(start)
        tail = rest.split(end)[1]
        readme = f"{head}{start}\n{content[section]}\n{end}{tail}"
    return readme


def repository_root(root: Path) -> Path:
    """``root``, if it holds the README, ``nanovllm/`` and ``chapters/``; else a clear error."""
    if not all((root / name).exists() for name in ("README.md", "nanovllm", "chapters")):
        raise SystemExit(f"{root.resolve()} is not the nanovllm repository (no README.md, "
                         "nanovllm/ and chapters/): run from its root or pass --root")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository (default: the current folder)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if the README's generated sections are stale")
    args = parser.parse_args(argv)
    readme = repository_root(args.root) / "README.md"
    text = readme.read_text()
    current = render_readme(text, args.root)
    if current == text:
        print(f"{readme}: the chapter table and the module list are current")
        return 0
    if args.check:
        print(f"{readme} is stale: run python -m nanovllm.viz.package_map", file=sys.stderr)
        return 1
    readme.write_text(current)
    print(f"{readme}: updated the chapter table and the module list")
    return 0


if __name__ == "__main__":
    sys.exit(main())

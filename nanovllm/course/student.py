"""Build a student edition.

``python -m nanovllm.course.student --out dist/student [--chapters 04]``

Copies what a student needs (the package, the chapters with their notebooks' outputs cleared
and their exercises' worked solutions stripped, the public tests, the build files) and cuts
the assignment regions of the chosen chapters (all by default; ``--chapters 04`` keeps every
other chapter's reference solution, so that week's notebook runs end to end once chapter 04
is filled in). Instructor-only tests (listed in
``tests/course/PRIVATE``, one path relative to tests/ a line, ``#`` comments) stay out,
with ``tests/course/`` itself and ``chapters/INSTRUCTORS.md``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from nanovllm.course.exercises import strip_notebook, strip_solutions
from nanovllm.course.regions import Region, cut_files, find_regions, select

REPO = Path(__file__).resolve().parents[2]
FILES = ["Makefile", "pyproject.toml", "README.md", "environment.yml", "jupytext.toml", "LICENSE"]
FOLDERS = ["figures"]
IGNORE = shutil.ignore_patterns(
    "__pycache__", "*.pyc", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis"
)


def private_tests(repo: Path = REPO) -> set[str]:
    listing = repo / "tests" / "course" / "PRIVATE"
    if not listing.exists():
        return set()
    lines = (line.split("#")[0].strip() for line in listing.read_text().splitlines())
    return {line for line in lines if line} | {"course"}


def build(out: Path, chapters=None, ids=None, repo: Path = REPO) -> list[Region]:
    """Write the edition to ``out`` (replaced if present); returns the regions cut."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(repo / "nanovllm", out / "nanovllm", ignore=IGNORE)
    for name in FILES:
        if (repo / name).exists():
            shutil.copy2(repo / name, out / name)
    for name in FOLDERS:
        if (repo / name).is_dir():
            shutil.copytree(repo / name, out / name, ignore=IGNORE)
    _copy_chapters(repo / "chapters", out / "chapters")
    private = private_tests(repo)
    ignore_private = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")

    def ignore(folder, names):
        rel = Path(folder).resolve().relative_to((repo / "tests").resolve())
        hidden = {n for n in names if (rel / n).as_posix() in private}
        return hidden | set(ignore_private(folder, names))

    shutil.copytree(repo / "tests", out / "tests", ignore=ignore)
    regions = select(find_regions(repo / "nanovllm"), chapters, ids)
    cut_files(regions, repo, out)
    return regions


def _copy_chapters(src: Path, dst: Path) -> None:
    """Chapters with their exercises' worked solutions stripped and notebook outputs cleared."""
    import nbformat

    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        chapter = path.stem[:2]
        if path.suffix == ".ipynb":
            nb = nbformat.read(path, as_version=4)
            strip_notebook(nb, chapter)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            nbformat.validate(nb)
            nbformat.write(nb, dst / path.name)
        elif path.suffix == ".py":
            (dst / path.name).write_text(strip_solutions(path.read_text(), chapter))
        elif path.name == "INSTRUCTORS.md":
            continue
        elif path.is_file() and (path.suffix in {".md", ".cfg"}):
            shutil.copy2(path, dst / path.name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split(chr(10) * 2)[0])
    parser.add_argument("--out", type=Path, default=Path("dist/student"))
    parser.add_argument(
        "--chapters", nargs="*", help="chapters whose regions to cut (default: all)"
    )
    parser.add_argument("--assignments", nargs="*", help="cut exactly these ids (e.g. 04.free)")
    args = parser.parse_args(argv)
    regions = build(args.out, args.chapters, args.assignments)
    for r in regions:
        print(f"cut {r.id:24s} {r.points:3d} points  {r.file.relative_to(REPO)}:{r.start}")
    print(f"{len(regions)} assignments, {sum(r.points for r in regions)} points -> {args.out}")


if __name__ == "__main__":
    main()

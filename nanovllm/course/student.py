"""Build a student edition.

``python -m nanovllm.course.student --repo REPO --out dist/student [--chapters 04 [--through]]``

Copies what a student needs from the instructor's repository ``REPO`` (the package, the
chapters with their notebooks' outputs cleared, the public tests, the build files, figures/)
and cuts the assignment regions of the chosen chapters (all by default; ``--chapters 04``
keeps every other chapter's reference solution, so that week's notebook runs end to end once
chapter 04 is filled in; ``--through`` cuts chapter 04 and every later one, so a week's edition
does not ship the later weeks' answers). A cut region keeps its markers around the stub: the
student writes between them, and the grader takes exactly that code. ``course.json`` lists the
assignments cut; ``make check`` inside the edition runs their public tests; ``analysis/NN.json``
are the blank answers to the chapters' analysis questions (:mod:`nanovllm.course.analysis`).

Never copied: the exercises' worked solutions (``chapters/solutions/``; the chapters hold only
the stubs), ``chapters/INSTRUCTORS.md``, the private tests (listed in
``tests/course/PRIVATE``, one path relative to tests/ a line, ``#`` comments; with
``tests/course/`` itself). The executed GPU-run copies under ``figures/data/gpu_runs/`` ship
without any output that prints reference code (:mod:`nanovllm.course.answer_key`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from nanovllm.course.analysis import write_templates
from nanovllm.course.answer_key import key_lines, scrub_notebook
from nanovllm.course.check import EDITION_FILE
from nanovllm.course.exercises import strip_notebook, strip_solutions
from nanovllm.course.regions import Region, cut_files, find_regions, select

FILES = ["Makefile", "pyproject.toml", "README.md", "environment.yml", "jupytext.toml", "LICENSE"]
FOLDERS = ["figures"]
GPU_RUNS = Path("figures/data/gpu_runs")
IGNORE = shutil.ignore_patterns(
    "__pycache__", "*.pyc", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis"
)


def private_tests(repo: Path) -> set[str]:
    listing = repo / "tests" / "course" / "PRIVATE"
    if not listing.exists():
        return set()
    lines = (line.split("#")[0].strip() for line in listing.read_text().splitlines())
    return {line for line in lines if line} | {"course"}


def build(out: Path, repo: Path, chapters=None, ids=None, through: bool = False) -> list[Region]:
    """Write the edition to ``out`` (replaced if present); returns the regions cut."""
    out, repo = Path(out), Path(repo).resolve()
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
    _scrub_gpu_runs(out / GPU_RUNS, key_lines(repo))
    _copy_chapters(repo / "chapters", out / "chapters")
    private = private_tests(repo)
    ignore_private = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")

    def ignore(folder, names):
        rel = Path(folder).resolve().relative_to((repo / "tests").resolve())
        hidden = {n for n in names if (rel / n).as_posix() in private}
        return hidden | set(ignore_private(folder, names))

    shutil.copytree(repo / "tests", out / "tests", ignore=ignore)
    regions = select(find_regions(repo / "nanovllm"), chapters, ids, through)
    cut_files(regions, repo, out)
    listing = [
        {"id": r.id, "points": r.points, "function": r.function,
         "file": r.file.relative_to(repo).as_posix()}
        for r in regions
    ]  # fmt: skip
    (out / EDITION_FILE).write_text(json.dumps({"assignments": listing}, indent=1) + "\n")
    write_templates(out)  # analysis/NN.json: blank answers to the analysis questions
    return regions


def _scrub_gpu_runs(folder: Path, key: set[str]) -> None:
    """The executed GPU-run copies with their exercises stripped and every output that prints
    reference code dropped (the measurements stay)."""
    import nbformat

    for path in sorted(folder.glob("*.ipynb")) if folder.is_dir() else []:
        nb = nbformat.read(path, as_version=4)
        strip_notebook(nb, path.name[:2])
        scrub_notebook(nb, key)
        nbformat.write(nb, path)


def _copy_chapters(src: Path, dst: Path) -> None:
    """Chapters (notebook outputs cleared); never the solutions folder or this guide."""
    import nbformat

    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        chapter = path.stem[:2]
        if path.suffix == ".ipynb":
            nb = nbformat.read(path, as_version=4)
            strip_notebook(nb, chapter)  # (the chapters hold stubs; in case one slipped in)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            nbformat.validate(nb)
            nbformat.write(nb, dst / path.name)
        elif path.suffix == ".py":
            (dst / path.name).write_text(strip_solutions(path.read_text(), chapter))
        elif path.is_file() and path.suffix in {".md", ".cfg"} and path.name != "INSTRUCTORS.md":
            shutil.copy2(path, dst / path.name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split(chr(10) * 2)[0])
    parser.add_argument("--repo", type=Path, required=True, help="the instructor's repository")
    parser.add_argument("--out", type=Path, default=Path("dist/student"))
    parser.add_argument(
        "--chapters", nargs="*", help="chapters whose regions to cut (default: all)"
    )
    parser.add_argument(
        "--through", action="store_true", help="also cut every chapter after --chapters"
    )
    parser.add_argument("--assignments", nargs="*", help="cut exactly these ids (e.g. 04.free)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    regions = build(args.out, repo, args.chapters, args.assignments, args.through)
    for r in regions:
        print(f"cut {r.id:24s} {r.points:3d} points  {r.file.relative_to(repo)}:{r.start}")
    print(f"{len(regions)} assignments, {sum(r.points for r in regions)} points -> {args.out}")


if __name__ == "__main__":
    main()

"""The map of the book and the package (nanovllm/viz/package_map.py): generated from the
modules' docstrings, listing every module, and the README's copy of it is current."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nanovllm.viz import package_map
from nanovllm.viz.package_map import chapter_table, module_list, module_tree, package_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    """A package of three modules and one chapter source."""
    pkg = tmp_path / "nanovllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "engine" / "scheduler.py").write_text(
        '"""Continuous batching (chapters 01 and 02). More text.\n\nDetails."""\nx = 1\n')
    (pkg / "engine" / "step.py").write_text('"""One step, e.g. a decode\nstep (chapter 02)."""\n')
    (tmp_path / "chapters").mkdir()
    heading = "# %% [markdown]\n# # Chapter 01 — The model\n"
    (tmp_path / "chapters" / "01_model.py").write_text(heading)
    return tmp_path


def test_modules_chapters_and_summaries(tiny_repo: Path) -> None:
    modules = package_modules(tiny_repo / "nanovllm")
    assert [(m.path, m.lines, m.chapters, m.summary) for m in modules] == [
        ("__init__.py", 1, (), "The package."),
        ("engine/scheduler.py", 4, ("01", "02"), "Continuous batching (chapters 01 and 02)."),
        ("engine/step.py", 2, ("02",), "One step, e.g. a decode step (chapter 02)."),
    ]


def test_chapter_table_lists_every_module(tiny_repo: Path) -> None:
    table = chapter_table(package_modules(tiny_repo / "nanovllm"), tiny_repo / "chapters")
    assert table.splitlines()[2:] == [
        "| 01 | [The model](chapters/01_model.py) | engine/ scheduler |",
        "| 02 | *not written yet* | engine/ scheduler, step |",
        "| - | *no chapter: tooling and package plumbing* | __init__ |",
    ]


def test_tree_and_list_show_every_module(tiny_repo: Path) -> None:
    modules = package_modules(tiny_repo / "nanovllm")
    tree = module_tree(modules)
    assert "  engine/\n    scheduler.py" in tree
    assert tree.splitlines()[-1].split() == ["total", "7", "lines", "in", "3", "modules"]
    assert module_list(modules).count("\n- `") == 2


def test_the_real_map_lists_every_module() -> None:
    modules = package_modules(ROOT / "nanovllm")
    table = chapter_table(modules, ROOT / "chapters")
    for m in modules:
        folder, _, name = m.path.rpartition("/")
        row = next(line for line in table.splitlines() if line.startswith(
            f"| {m.chapters[0]} |" if m.chapters else "| - |"))
        assert name.removesuffix(".py") in row and (not folder or f"{folder}/ " in row), m.path
    assert len(module_list(modules).splitlines()) == len(list((ROOT / "nanovllm").rglob("*.py")))


def test_readme_map_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert package_map.render_readme(readme, ROOT) == readme, (
        "the README's chapter table or module list is stale: run python -m nanovllm.viz.package_map"
    )


def test_cli_writes_checks_and_refuses_a_stranger(tiny_repo: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    shutil.copy(ROOT / "README.md", tiny_repo / "README.md")
    assert package_map.main(["--root", str(tiny_repo), "--check"]) == 1  # another package
    assert package_map.main(["--root", str(tiny_repo)]) == 0
    assert "engine/ scheduler, step" in (tiny_repo / "README.md").read_text()
    assert package_map.main(["--root", str(tiny_repo), "--check"]) == 0
    with pytest.raises(SystemExit, match="not the nanovllm repository"):
        package_map.main(["--root", str(tmp_path / "elsewhere")])

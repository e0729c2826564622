"""Every chapter is a pair: chapters/NN_name.py (source) and an executed NN_name.ipynb whose code
cells equal the .py's. `make notebooks` regenerates the pair; this test catches a forgotten run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"
SOURCES = sorted(CHAPTERS.glob("[0-9][0-9]_*.py"))
NOTEBOOKS = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))

pytestmark = pytest.mark.skipif(not (SOURCES or NOTEBOOKS), reason="no chapters yet")


def code_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    text = cell["source"]
    return ("".join(text) if isinstance(text, list) else text).strip()


def test_every_py_has_a_notebook_and_back() -> None:
    assert {p.stem for p in SOURCES} == {p.stem for p in NOTEBOOKS}, "run `make notebooks`"


@pytest.mark.parametrize("py", SOURCES, ids=lambda p: p.stem)
def test_notebook_matches_its_source(py: Path) -> None:
    jupytext = pytest.importorskip("jupytext")
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        pytest.fail(f"{ipynb.name} missing: run `make notebooks CH={py.name[:2]}`")
    stored = json.loads(ipynb.read_text())
    expected = [source(c) for c in code_cells(jupytext.read(py))]
    assert [source(c) for c in code_cells(stored)] == expected, (
        f"{ipynb.name} is stale: run `make notebooks CH={py.name[:2]}`")
    cells = code_cells(stored)
    unrun = [i for i, c in enumerate(cells) if source(c) and c["execution_count"] is None]
    assert not unrun, f"{ipynb.name}: code cells {unrun} were never executed"
    # nbval starts the kernel named here; a custom name fails with NoSuchKernel on other machines.
    assert stored["metadata"].get("kernelspec", {}).get("name") == "python3"

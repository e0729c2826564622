"""A pytest plugin for GPU runs of the chapters: one execution gives the nbval verdict and a copy.

While nbval executes a notebook (``--nbval-lax``: every cell must run, cells marked
``# NBVAL_CHECK_OUTPUT`` must print what the committed CPU run printed), this plugin keeps each
cell's new outputs and its wall-clock start and end. At the end of the session it writes, for every
notebook, into ``$NBVAL_RECORD_DIR``:

- ``NN_name.gpu.ipynb``: the notebook with the outputs of this run, each cell's
  ``metadata.execution`` stamped as nbclient stamps it, so the book's runtime table
  (``nanovllm/viz/book.py``) reads the GPU wall time from it;
- ``NN_name.nbval.json``: cells run, checked, passed, failed (with the first lines of the reason).

Load it with ``-p nbval_record`` and ``tests/gpu`` on ``PYTHONPATH`` (``tests/gpu/h200_session.sh``,
stage ``book_gpu``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import pytest


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or not hasattr(item, "cell"):
        return
    report = outcome.get_result()
    # nbval compared the outputs inside runtest; from here on the cell may take the new ones.
    if item.test_outputs is not None:
        item.cell.outputs = item.test_outputs
    item.cell.metadata["execution"] = {
        "iopub.status.busy": _stamp(call.start), "shell.execute_reply": _stamp(call.stop)}
    item.user_properties.append(("nbval_record", {
        "cell": item.cell_num, "checked": bool(item.options.get("check")),
        "outcome": report.outcome, "seconds": round(call.stop - call.start, 3),
        "reason": str(report.longrepr).strip().splitlines()[:6] if report.failed else None}))


def pytest_sessionfinish(session):
    out = Path(os.environ.get("NBVAL_RECORD_DIR", "."))
    out.mkdir(parents=True, exist_ok=True)
    notebooks: dict = {}
    for item in session.items:
        if hasattr(item, "cell"):
            notebooks.setdefault(item.parent, []).append(item)
    for notebook, items in notebooks.items():
        stem = Path(str(notebook.fspath)).stem
        cells = [value for item in items for key, value in item.user_properties
                 if key == "nbval_record"]
        nbformat.write(notebook.nb, str(out / f"{stem}.gpu.ipynb"))
        summary = {
            "notebook": f"chapters/{stem}.ipynb",
            "code_cells": len(items),
            "cells_run": len(cells),
            "checked_cells": sum(c["checked"] for c in cells),
            "checked_passed": sum(c["checked"] and c["outcome"] == "passed" for c in cells),
            "failed": [c for c in cells if c["outcome"] == "failed"],
            "seconds": round(sum(c["seconds"] for c in cells), 1),
        }
        (out / f"{stem}.nbval.json").write_text(json.dumps(summary, indent=1) + "\n")

"""One record of a GPU run of every chapter (issue 16): the NN_name.nbval.json files that the
nbval_record plugin wrote into a folder, gathered with the device, date and versions.

    python tests/gpu/book_summary.py OUT_FOLDER > book_gpu_h200.json
"""

import json
import sys
from pathlib import Path

from nanovllm.benchmarks.metadata import run_metadata

folder = Path(sys.argv[1])
chapters = [json.loads(p.read_text()) for p in sorted(folder.glob("[0-9][0-9]_*.nbval.json"))]
record = {
    **run_metadata("pytest", ["--nbval-lax", "chapters/NN_name.ipynb", "--nbval-sanitize-with",
                              "chapters/sanitize.cfg", "-p", "nbval_record"]),
    "stage": "OUT=... bash tests/gpu/h200_session.sh book_gpu (with the real SmolLM2 weights)",
    "chapters": len(chapters),
    "cells_run": sum(c["cells_run"] for c in chapters),
    "checked_cells": sum(c["checked_cells"] for c in chapters),
    "checked_passed": sum(c["checked_passed"] for c in chapters),
    "failed_cells": sum(len(c["failed"]) for c in chapters),
    "seconds": round(sum(c["seconds"] for c in chapters), 1),
    "by_chapter": chapters,
}
print(json.dumps(record, indent=1))

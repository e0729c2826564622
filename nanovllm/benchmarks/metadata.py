"""What every recorded measurement says about itself: device, date, versions, commit, command.

Each tool under ``nanovllm/benchmarks/`` writes a JSON file that a chapter later reads from
``figures/data/`` (chapters 02, 05, 07, 08, 09, 10, 11, 12): a number without its machine,
software and command cannot be checked or repeated, so all of them start from ``run_metadata``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path

# Options naming where a tool writes its results: left out of the recorded command, since the
# record is that file, and a path on the measuring machine means nothing on the reader's.
OUTPUT_OPTIONS = ("--out", "--json", "--figure", "--worker-out")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding nanovllm/


def device_name(device: str | None = None) -> str:
    """The GPU's name for a CUDA device (``"NVIDIA H200"``); for a CPU its architecture and
    the threads torch uses (``"CPU (x86_64, 2 threads)"``). ``None``: CUDA where available."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """``python -m module`` and its arguments (``sys.argv[1:]`` by default), without the
    ``OUTPUT_OPTIONS`` and their values."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in OUTPUT_OPTIONS:
            skip = True  # its value is the next argument
        elif not arg.startswith(tuple(f"{opt}=" for opt in OUTPUT_OPTIONS)):
            kept.append(arg)
    return " ".join(["python -m", module, *kept])


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or None where it is not installed."""
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def git_commit(root: Path = PACKAGE_ROOT) -> str | None:
    """``git describe --always --dirty`` of the checkout the package runs from (``-dirty``:
    with uncommitted changes), or None: no git, or the package is installed, not checked out."""
    if not (root / ".git").exists():  # a folder, or a file in a git worktree
        return None
    # GIT_OPTIONAL_LOCKS=0: only read; --dirty would otherwise refresh (and lock) the index,
    # which a git command running beside the benchmark may need.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def run_metadata(
    module: str,
    argv: Sequence[str] | None = None,
    device: str | None = None,
    *,
    device_label: str | None = None,
) -> dict:
    """The header of a recorded result: ``device`` (see ``device_name``; ``device_label``
    instead where the device must not be queried, e.g. to keep CUDA uninitialized in this
    process), ``date`` (UTC, ISO 8601 to the second), ``command`` (see ``command_line``), the
    versions of ``python``, ``torch``, ``triton`` and ``transformers`` (None where not
    installed) and ``git_commit``."""
    import torch

    return {
        "device": device_label if device_label is not None else device_name(device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(module, argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "git_commit": git_commit(),
    }

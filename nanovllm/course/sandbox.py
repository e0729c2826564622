"""Run pytest on a spliced tree where nothing leads back to the instructor's checkout.

:class:`Sandbox` owns a private folder (outside every tree it runs) holding the trusted pytest
plugin, a bootstrap script and a view of the venv's site-packages without nanovllm's editable
install (no ``__editable__`` finder or ``.pth``, no ``nanovllm-*.dist-info`` and so no
``direct_url.json``). Each run starts ``python -S -s -P bootstrap.py``: no site processing, no
user site, no script folder, a fresh environment (no ``PYTHONPATH``, no ``VIRTUAL_ENV``); the
bootstrap sets ``sys.path`` to the tree, then the view, loads the plugin from its file and
only then hands over to pytest, with the tree as working directory. The report comes back
through a file in the private folder; a run past its time limit is killed with its children.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

PLUGIN = Path(__file__).with_name("pytest_plugin.py")
PLUGIN_MODULE = "_nanovllm_course_plugin"
BOOTSTRAP = '''"""Trusted start of a graded pytest run (written by nanovllm.course.sandbox)."""
import importlib.util, site, sys
tree, view, plugin_file, *args = sys.argv[1:]
sys.argv[:] = ["pytest"]
sys.path[:] = [tree] + sys.path
site.addsitedir(view)
spec = importlib.util.spec_from_file_location("{module}", plugin_file)
plugin = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = plugin
spec.loader.exec_module(plugin)
import pytest
sys.exit(pytest.main(args, plugins=[plugin]))
'''
# Environment variables a run inherits (everything else, PYTHONPATH included, is dropped).
PASSED_ON = (
    "HOME", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "TRITON_CACHE_DIR",
)  # fmt: skip


def _leads_to_nanovllm(entry: Path, repo: Path) -> bool:
    name = entry.name.lower()
    if name.startswith(("nanovllm", "__editable__", "_nanovllm")) or name.endswith(".egg-link"):
        return True
    if entry.suffix == ".pth" and entry.is_file():
        text = entry.read_text(errors="replace")
        return "__editable__" in text or "nanovllm" in text or str(repo) in text
    return False


def site_view(view: Path, repo: Path) -> Path:
    """``view``: a folder of links to the venv's site-packages entries, less nanovllm's."""
    view.mkdir(parents=True)
    for folder in site.getsitepackages():
        for entry in sorted(Path(folder).iterdir()):
            target = view / entry.name
            if not target.exists() and not _leads_to_nanovllm(entry, repo.resolve()):
                target.symlink_to(entry)
    return view


class Sandbox:
    """The private side of grading: plugin, bootstrap, site view (in ``private``)."""

    def __init__(self, private: Path, repo: Path) -> None:
        self.private = Path(private)
        self.private.mkdir(parents=True, exist_ok=True)
        self.plugin = self.private / f"{PLUGIN_MODULE}.py"
        self.plugin.write_bytes(PLUGIN.read_bytes())
        self.bootstrap = self.private / "bootstrap.py"
        self.bootstrap.write_text(BOOTSTRAP.format(module=PLUGIN_MODULE))
        self.view = site_view(self.private / "site-packages", repo)

    def env(self, tree: Path, report: Path, chapter: str | None) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ON if k in os.environ}
        from nanovllm.weights.smollm2 import cache_dir

        env.update(
            PATH="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            PYTHONHASHSEED="0",
            PYTHONDONTWRITEBYTECODE="1",
            TQDM_DISABLE="1",
            HF_HUB_OFFLINE="1",
            NANOVLLM_CACHE=str(cache_dir()),
            NANOVLLM_COURSE_REPORT=str(report),
            NANOVLLM_COURSE_STUDENT=str(tree),
        )
        if chapter:
            env["NANOVLLM_COURSE_CHAPTER"] = chapter
        return env

    def run(
        self,
        tree: Path,
        tests: list[str],
        timeout: float,
        chapter: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> dict:
        """pytest on ``tests`` (paths relative to ``tree``) marked ``assignment``, with the
        tree as working directory; the plugin's report plus ``status`` and ``wall_s``."""
        name = f"chapter{chapter or 'all'}{'-collect' if extra else ''}"
        report, log = self.private / f"{name}.json", self.private / f"{name}.log"
        report.unlink(missing_ok=True)
        cmd = [sys.executable, "-S", "-s", "-P", str(self.bootstrap), str(tree), str(self.view)]
        cmd += [str(self.plugin), *tests, "-m", "assignment", "-q", "-p", "no:cacheprovider"]
        cmd += ["--rootdir", str(tree), "-c", str(tree / "pyproject.toml"), *extra]
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=tree, env=self.env(tree, report, chapter), stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"status": f"timeout after {timeout:g} s", "tests": [], "wall_s": timeout}
            finally:
                try:  # children a test left behind (worker processes) go with it
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        wall = time.monotonic() - start
        if code not in (0, 1, 5) or not report.exists():  # 5: no tests ran
            tail = log.read_text(errors="replace")[-2000:]
            return {"status": f"crashed (exit {code})", "tests": [], "output": tail, "wall_s": wall}
        result = json.loads(report.read_text())
        result.update(status="ok", wall_s=wall)
        return result

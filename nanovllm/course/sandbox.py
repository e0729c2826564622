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
# The same start for a module of the tree run as a script (the analysis measurements): no
# plugin, the module's own ``main`` reads its arguments.
MODULE_BOOTSTRAP = '''"""Trusted start of a sandboxed module run (nanovllm.course.sandbox)."""
import runpy, site, sys
tree, view, module, *args = sys.argv[1:]
sys.argv[:] = [module] + args
sys.path[:] = [tree] + sys.path
site.addsitedir(view)
runpy.run_module(module, run_name="__main__", alter_sys=True)
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
        self.module_bootstrap = self.private / "run_module.py"
        self.module_bootstrap.write_text(MODULE_BOOTSTRAP)
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
        code, wall = self._spawn(cmd, tree, self.env(tree, report, chapter), timeout, log)
        if code is None:
            return {"status": f"timeout after {timeout:g} s", "tests": [], "wall_s": timeout}
        if code not in (0, 1, 5) or not report.exists():  # 5: no tests ran
            tail = log.read_text(errors="replace")[-2000:]
            return {"status": f"crashed (exit {code})", "tests": [], "output": tail, "wall_s": wall}
        result = json.loads(report.read_text())
        result.update(status="ok", wall_s=wall)
        return result

    def run_module(
        self, tree: Path, module: str, args: list[str], timeout: float, name: str
    ) -> dict:
        """``python -m module *args`` of ``tree``, started as the graded pytest runs are (same
        environment, ``sys.path`` and site view; no plugin): ``status``, ``wall_s`` and the
        output's tail. ``args`` may name files in ``self.private`` for the results."""
        log = self.private / f"{name}.log"
        cmd = [sys.executable, "-S", "-s", "-P", str(self.module_bootstrap), str(tree)]
        cmd += [str(self.view), module, *args]
        env = self.env(tree, self.private / f"{name}.unused", None)
        code, wall = self._spawn(cmd, tree, env, timeout, log)
        tail = log.read_text(errors="replace")[-2000:]
        if code is None:
            return {"status": f"timeout after {timeout:g} s", "wall_s": timeout, "output": tail}
        status = "ok" if code == 0 else f"crashed (exit {code})"
        return {"status": status, "wall_s": wall, "output": tail}

    @staticmethod
    def _spawn(cmd, tree: Path, env: dict, timeout: float, log: Path) -> tuple[int | None, float]:
        """Run ``cmd`` in ``tree`` in its own process group, output to ``log``; (exit code or
        None after ``timeout``, wall seconds). The group is killed either way: children a
        run left behind (worker processes) go with it."""
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None, timeout
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return code, time.monotonic() - start

"""Run pytest on a spliced tree where nothing leads back to the instructor's checkout.

:class:`Sandbox` owns a private folder (outside every tree it runs) holding the trusted pytest
plugin, a bootstrap script and a view of the venv's site-packages without nanovllm's editable
install (no ``__editable__`` finder or ``.pth``, no ``nanovllm-*.dist-info`` and so no
``direct_url.json``). Each run starts ``python -S -s -P bootstrap.py``: no site processing, no
user site, no script folder, a fresh environment (no ``PYTHONPATH``, no ``VIRTUAL_ENV``); the
bootstrap sets ``sys.path`` to the tree, then the view, loads the plugin from its file and
only then hands over to pytest, with the tree as working directory.

Where bubblewrap (``bwrap``, Debian's ``bubblewrap``) works, each run is also an OS sandbox
(:func:`bwrap_command`): a new mount, process and network namespace that holds the system's
folders and the Python installation read-only, the tree, a scratch home and the run's outbox —
and nothing else, so the reference does not exist for the graded code (no path, however it is
built, leads to it), nothing it starts outlives the run, and it reaches no network.
Without bubblewrap the runs keep the path-based isolation above, and :attr:`Sandbox.isolation`
says so (the grade report prints it). The report comes back through a file in the run's
outbox; a run past its time limit is killed with every process it started.
"""

from __future__ import annotations

import json
import os
import shutil
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
    "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
)  # fmt: skip
# Read-only in the OS sandbox: the system's folders (a link such as /bin -> usr/bin stays a link).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")


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


def python_folders() -> list[Path]:
    """What the interpreter needs: its installation and the venv (``sys.prefix``) — the venv
    alone, even when it lies inside the instructor's checkout."""
    folders = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    folders.add(Path(os.path.realpath(sys.executable)).parent)
    return sorted(folders)


def bwrap_command(readable: list[Path], writable: list[Path], home: Path) -> list[str] | None:
    """The bubblewrap prefix of a sandboxed run, or None when ``bwrap`` is not installed."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None
    cmd = [exe, "--die-with-parent", "--unshare-all", "--new-session", "--proc", "/proc"]
    cmd += ["--tmpfs", "/tmp"]
    if any(Path("/dev").glob("nvidia*")):  # a GPU machine: its devices and their sysfs
        cmd += ["--dev-bind", "/dev", "/dev", "--ro-bind", "/sys", "/sys"]
    else:
        cmd += ["--dev", "/dev"]
    for folder in SYSTEM:
        if os.path.islink(folder):
            cmd += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            cmd += ["--ro-bind", folder, folder]
    for folder in readable:
        cmd += ["--ro-bind", str(folder), str(folder)]
    for folder in [*writable, home]:
        cmd += ["--bind", str(folder), str(folder)]
    return cmd


class Sandbox:
    """The private side of grading: plugin, bootstrap, site view (in ``private``, read-only to
    the runs), and ``outbox``, the one folder a run writes besides its tree."""

    def __init__(self, private: Path, repo: Path) -> None:
        self.private = Path(private)
        self.private.mkdir(parents=True, exist_ok=True)
        self.repo = Path(repo).resolve()
        self.plugin = self.private / f"{PLUGIN_MODULE}.py"
        self.plugin.write_bytes(PLUGIN.read_bytes())
        self.bootstrap = self.private / "bootstrap.py"
        self.bootstrap.write_text(BOOTSTRAP.format(module=PLUGIN_MODULE))
        self.module_bootstrap = self.private / "run_module.py"
        self.module_bootstrap.write_text(MODULE_BOOTSTRAP)
        self.view = site_view(self.private / "site-packages", repo)
        self.outbox = self.private.with_name(self.private.name + "-outbox")
        self.outbox.mkdir(parents=True, exist_ok=True)
        self.home = self.private.with_name(self.private.name + "-home")
        self.home.mkdir(parents=True, exist_ok=True)
        self.isolation = self._probe()

    def _readable(self) -> list[Path]:
        from nanovllm.weights.smollm2 import cache_dir

        folders = [*python_folders(), self.private]
        if Path(cache_dir()).is_dir():
            folders.append(Path(cache_dir()).resolve())
        return folders

    def _prefix(self, tree: Path) -> list[str] | None:
        return bwrap_command(self._readable(), [tree.resolve(), self.outbox], self.home)

    def _probe(self) -> str:
        """Whether runs are OS-sandboxed: bwrap starts here, and the reference is not in reach
        of any folder it binds (the venv may sit inside the checkout; the checkout itself may
        not sit inside a bound folder)."""
        prefix = self._prefix(self.private)
        if prefix is None:
            return "path-based only: bubblewrap (bwrap) is not installed"
        exposed = [f for f in self._readable() if self.repo.is_relative_to(f)]
        if exposed:
            return f"path-based only: the checkout lies inside {exposed[0]}, which runs need"
        probe = subprocess.run([*prefix, sys.executable, "-S", "-c", "pass"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if probe.returncode != 0:
            return f"path-based only: bwrap does not start here ({probe.stderr.strip()[:200]})"
        return "bubblewrap: only the tree, Python and the system are visible; no network"

    @property
    def os_sandboxed(self) -> bool:
        return self.isolation.startswith("bubblewrap")

    def env(self, tree: Path, report: Path, chapter: str | None) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ON if k in os.environ}
        from nanovllm.weights.smollm2 import cache_dir

        env.update(
            PATH="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            HOME=str(self.home),
            TMPDIR=str(self.home),
            PYTHONHASHSEED="0",
            PYTHONDONTWRITEBYTECODE="1",
            TQDM_DISABLE="1",
            HF_HUB_OFFLINE="1",
            NANOVLLM_CACHE=str(cache_dir()),
            NANOVLLM_COURSE_REPORT=str(report),
            NANOVLLM_COURSE_PROGRESS=str(report.with_suffix(".running")),
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
        marks: str = "assignment",
    ) -> dict:
        """pytest on ``tests`` (paths or node ids relative to ``tree``) selected by ``marks``,
        with the tree as working directory; the plugin's report plus ``status``, ``wall_s``
        and, after a timeout, ``running``: the test that was running."""
        name = f"chapter{chapter or 'all'}{'-collect' if extra else ''}"
        report, log = self.outbox / f"{name}.json", self.private / f"{name}.log"
        progress = report.with_suffix(".running")
        report.unlink(missing_ok=True)
        progress.unlink(missing_ok=True)
        cmd = [sys.executable, "-S", "-s", "-P", str(self.bootstrap), str(tree), str(self.view)]
        cmd += [str(self.plugin), *tests, "-m", marks, "-q", "-p", "no:cacheprovider"]
        cmd += ["--rootdir", str(tree), "-c", str(tree / "pyproject.toml"), *extra]
        code, wall = self._spawn(cmd, tree, self.env(tree, report, chapter), timeout, log)
        if code is None:
            running = progress.read_text().strip() if progress.is_file() else "not known"
            return {"status": f"timeout after {timeout:g} s (running: {running})",
                    "tests": [], "wall_s": timeout, "running": running}  # fmt: skip
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
        environment, ``sys.path``, site view and OS sandbox; no plugin): ``status``,
        ``wall_s`` and the output's tail. ``args`` may name files in ``self.outbox`` for the
        results."""
        log = self.private / f"{name}.log"
        cmd = [sys.executable, "-S", "-s", "-P", str(self.module_bootstrap), str(tree)]
        cmd += [str(self.view), module, *args]
        env = self.env(tree, self.outbox / f"{name}.unused", None)
        code, wall = self._spawn(cmd, tree, env, timeout, log)
        tail = log.read_text(errors="replace")[-2000:]
        if code is None:
            return {"status": f"timeout after {timeout:g} s", "wall_s": timeout, "output": tail}
        status = "ok" if code == 0 else f"crashed (exit {code})"
        return {"status": status, "wall_s": wall, "output": tail}

    def _spawn(self, cmd, tree: Path, env: dict, timeout: float, log: Path):
        """Run ``cmd`` in ``tree`` (in the OS sandbox when there is one) in its own process
        group, output to ``log``; (exit code or None after ``timeout``, wall seconds). The
        group is killed either way, and in the OS sandbox its process namespace goes with
        it: nothing a run started (worker processes, servers) outlives it, nor outlives a
        grader that is killed itself (``--die-with-parent``; without bwrap, the child is
        asked to die with its parent)."""
        if self.os_sandboxed:
            cmd = [*self._prefix(tree), "--chdir", str(tree), *cmd]
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
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


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the grader dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)

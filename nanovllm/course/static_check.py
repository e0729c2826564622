"""Read a student's region before it runs: flag code that reaches past the function it fills.

An assignment region computes with its arguments, ``self`` and the module's tensors; it has
no business with the test machinery, files, the import system, frames or other modules'
attributes. The grader (:mod:`nanovllm.course.grade`) zeroes a region this check flags, with
the reasons beside the score. It is a list of what a region may not name (attribute
look-ups by string included: ``attrgetter``, ``methodcaller``, any string holding ``__``), so
it is a speed bump, not a sandbox: the OS sandbox of :mod:`nanovllm.course.sandbox`, where the
reference does not exist, isolates the grading for real (``chapters/INSTRUCTORS.md``).
"""

from __future__ import annotations

import ast

# Names (variables, attributes, imported modules) a region may not mention at all.
FORBIDDEN = {
    # the test machinery
    "pytest", "_pytest", "pluggy", "unittest",
    # the interpreter, the import system, introspection
    "sys", "builtins", "importlib", "inspect", "imp", "site", "gc", "types", "code", "codeop",
    "traceback", "linecache", "runpy", "ctypes", "marshal", "pickle", "dill", "weakref",
    "modules", "meta_path", "path_hooks", "exec", "eval", "compile", "globals", "locals",
    "vars", "setattr", "delattr", "getattr", "type", "breakpoint", "input", "help",
    "attrgetter", "methodcaller", "format_map",
    "_getframe", "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame",
    "cr_frame", "ag_frame", "tb_frame", "tb_next", "func_globals",
    # processes, files, the network
    "os", "posix", "nt", "subprocess", "multiprocessing", "threading", "signal", "socket",
    "shutil", "tempfile", "pathlib", "Path", "PurePath", "io", "open", "fileinput", "mmap",
    "read_text", "read_bytes", "write_text", "write_bytes", "fromfile", "tofile", "loadtxt",
    "savetxt", "genfromtxt", "memmap", "save", "hub", "cpp_extension", "load_library",
    "system", "popen", "spawn", "environ", "getcwd", "chdir", "listdir", "walk", "glob",
    "urllib", "http", "requests",
}  # fmt: skip
# Modules a region may import (the reference imports none; helpers come from the file).
IMPORTABLE = {
    "math", "torch", "triton", "numpy", "collections", "itertools", "functools", "heapq",
    "bisect", "dataclasses", "typing", "operator", "xxhash",
}  # fmt: skip


def module_names(source: str) -> set[str]:
    """The names a file binds to modules or to objects imported from them (``torch``,
    ``F``, ``Sequence``): a region may call them but not assign their attributes."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names | IMPORTABLE


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def check_region(body: str, modules: set[str] = frozenset()) -> list[str]:
    """The reasons to zero this region's code (dedented; it must parse), empty when clean.
    ``modules``: :func:`module_names` of the file it sits in."""
    reasons: list[str] = []

    def flag(node: ast.AST, why: str) -> None:
        reason = f"line {getattr(node, 'lineno', '?')}: {why}"
        if reason not in reasons:
            reasons.append(reason)

    for node in ast.walk(ast.parse(body)):
        name = (
            node.id if isinstance(node, ast.Name)
            else node.attr if isinstance(node, ast.Attribute)
            else node.arg if isinstance(node, ast.keyword) and node.arg
            else None
        )  # fmt: skip
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "__" in node.value:
            flag(node, "a string holds `__` (a dunder name built or looked up by a string)")
        if name in FORBIDDEN:
            flag(node, f"names `{name}` (test machinery, files, processes or the import system)")
        elif name and name.startswith("__") and name.endswith("__"):
            flag(node, f"names the dunder `{name}`")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module in [node.module or ""] if isinstance(node, ast.ImportFrom) else []:
                if module.split(".")[0] not in IMPORTABLE or node.level:
                    flag(node, f"imports from `{'.' * node.level}{module}`")
            for alias in node.names if isinstance(node, ast.Import) else []:
                if alias.name.split(".")[0] not in IMPORTABLE:
                    flag(node, f"imports `{alias.name}`")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            flag(node, "rebinds names outside the function (global / nonlocal)")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    root = _root(part) if isinstance(part, ast.Attribute) else None
                    if root is not None and not isinstance(root, ast.Name):
                        flag(node, "assigns an attribute of a computed object")
                    elif root is not None and root.id in modules:
                        flag(node, f"assigns an attribute of the module-level `{root.id}`")
    return reasons

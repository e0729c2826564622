"""The package's import graph, read from the source with ``ast``: no cycles, and the layers of
the package point one way (tools -> serve -> the ``LLM`` front door -> engine -> models ->
layers -> kernels -> leaves).

What counts as an edge: every ``import`` statement of a nanovllm module, wherever it stands —
at module level, inside a function (a lazy import only postpones a cycle, it does not remove
it), and under ``if TYPE_CHECKING:`` (a type-only import still means that one module knows the
other, and hiding a cycle from the interpreter is that guard's usual job). An import names the
module it loads: ``from nanovllm.engine import policies`` is an edge to
``nanovllm.engine.policies``, ``from nanovllm.engine.sequence import Sequence`` one to
``nanovllm.engine.sequence``. The parent packages that Python initialises on the way are not
edges: every module would otherwise depend on ``nanovllm/__init__.py``, the package's front door,
which imports the engine. That door is safe because no module imports it back (the cycle test
checks that too: ``import nanovllm`` inside the package is an edge to it).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanovllm"

# The package's layers, top to bottom. A part (a subpackage, or a module directly under nanovllm/;
# "__init__" is nanovllm/__init__.py) may import parts of its own layer or of the layers below it.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("tools", frozenset({"benchmarks", "bench", "course", "demo", "deploy", "evaluate", "viz"})),
    ("serve", frozenset({"serve"})),
    ("front door", frozenset({"__init__", "llm"})),
    ("engine", frozenset({"engine", "config"})),
    ("models", frozenset({"models", "weights"})),
    ("layers", frozenset({"layers"})),
    ("kernels", frozenset({"kernels"})),
    ("leaves", frozenset({"configs", "context", "detokenizer", "distributed", "inputs",
                          "outputs", "sampling_params", "speculative_config",
                          "structured_output", "tokenizer",
                          "validation"})),
)


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. "nanovllm.engine.executor"
    target: str  # imported module
    where: str  # "nanovllm/engine/executor.py:39"


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _loaded(name: str, modules: dict[str, Path]) -> str:
    """The module that importing ``name`` (a module, or a name inside one) loads."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_edges(package: Path = PACKAGE) -> list[Edge]:
    modules = module_names(package)
    edges = []
    for source, path in modules.items():
        here = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` folders up
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            edges += [Edge(source, _loaded(t, modules), where)
                      for t in targets if t.split(".")[0] == package.name]
    return [e for e in edges if e.target != e.source]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def describe(cycle: list[str], edges: list[Edge]) -> str:
    where = {(e.source, e.target): e.where for e in edges}
    return "\n".join(f"  {a} -> {b}   ({where[a, b]})" for a, b in zip(cycle, cycle[1:]))


def part(module: str) -> str:
    """``nanovllm.engine.scheduler`` -> ``engine``; ``nanovllm`` -> ``__init__``."""
    return module.split(".")[1] if "." in module else "__init__"


EDGES = import_edges()


def test_the_graph_sees_the_imports() -> None:
    """The reader finds what a reader sees: module-level, lazy and from-imports alike."""
    found = {(e.source, e.target) for e in EDGES}
    assert ("nanovllm.llm", "nanovllm.engine.llm_engine") in found  # module level
    assert ("nanovllm", "nanovllm.weights.smollm2") in found  # inside smollm2_path()
    assert ("nanovllm.engine.model_runner", "nanovllm.distributed") in found  # from pkg import mod
    assert len(module_names()) > 100


def test_find_cycle_names_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_modules() -> None:
    graph = defaultdict(set)
    for e in EDGES:
        graph[e.source].add(e.target)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + describe(cycle, EDGES)


def test_no_import_cycle_between_parts() -> None:
    """Subpackages and top-level modules as nodes: e.g. config.py importing the engine's
    policies while the engine imports the config is a cycle here, not between modules."""
    graph, where = defaultdict(set), []
    for e in EDGES:
        a, b = part(e.source), part(e.target)
        if a != b:
            graph[a].add(b)
            where.append(Edge(a, b, e.where))
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between parts of nanovllm:\n" + describe(cycle, where)


def test_every_part_has_a_layer() -> None:
    placed = set().union(*(parts for _, parts in LAYERS))
    missing = sorted({part(m) for m in module_names()} - placed)
    assert not missing, f"place {missing} in a layer of LAYERS"


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_layers_import_only_downwards(layer: str) -> None:
    rank = {p: i for i, (_, parts) in enumerate(LAYERS) for p in parts}
    level = next(i for i, (name, _) in enumerate(LAYERS) if name == layer)
    upward = [f"  {e.source} -> {e.target}   ({e.where}; layer {LAYERS[rank[part(e.target)]][0]})"
              for e in EDGES
              if rank.get(part(e.source)) == level and rank.get(part(e.target), level) < level]
    assert not upward, f"the {layer} layer imports from above it:\n" + "\n".join(upward)


def test_config_names_exactly_the_engines_policies() -> None:
    """config.py checks a policy name without importing the engine; engine/policies.py maps
    the same names to classes."""
    from nanovllm.config import SCHEDULER_POLICIES
    from nanovllm.engine.policies import POLICIES

    assert sorted(SCHEDULER_POLICIES) == sorted(POLICIES)

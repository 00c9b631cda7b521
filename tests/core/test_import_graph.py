"""No import cycles in `miles_aio` or `benchmarks`: the import graph, read with `ast`, has none.

What an edge is (module A imports module B):
* every `import`/`from ... import` that can run counts: at module level, inside `try`/`if`/`with`, and
  inside functions and methods. A cycle hidden behind a deferred (function-level) import is still a
  cycle (neither module can be read, tested or changed apart from the other; deferring the import is
  how the engine's model and weights, and the simulator and its validation, used to hide theirs).
* imports under `if TYPE_CHECKING:` do NOT count: they never run. A cycle through annotations only (a
  `TYPE_CHECKING` import back, with `from __future__ import annotations`) is fine; a runtime one is not.
* importing `a.b.c` is an edge to `a.b.c` and to the packages `a.b` and `a` whose `__init__` runs first,
  except the importer's own enclosing packages: Python has run those before the importer itself, so
  `from miles_aio import __version__` in `miles_aio.engine.handlers` adds no order. (Left out: a package
  that imports its own child at import time while the child reads the package's names.)
* strings are not imports: plug-in paths (`"module:attr"`) and `importlib` calls are not followed.

`ALLOWED_EDGES` names the deferred imports that still close a cycle, each with who removes it; the test
also fails once an allowance is no longer needed, so the list only shrinks.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

import miles_aio

pytestmark = pytest.mark.pure

SRC = Path(miles_aio.__file__).parent.parent  # src/
REPO = SRC.parent
ROOTS = (SRC / "miles_aio", REPO / "benchmarks")

ALLOWED_EDGES: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC if SRC in path.parents else REPO).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for root in ROOTS for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, anywhere under `body` (not under `if TYPE_CHECKING:`)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child])
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    yield from _imports(child.body)


def _packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache
def imported(module: str) -> frozenset[str]:
    """The modules of the graph that `module` imports (see the module docstring)."""
    mods = modules()
    path = mods[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from . import x, from ..a import b
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        for alias in node.names:  # `from pkg import sub` imports the submodule; otherwise a name of pkg
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
    own = set(_packages(module))
    return frozenset(
        name
        for t in targets
        for name in [*_packages(t), t]
        if name in mods and name != module and name not in own
    )


def graph(*, drop: frozenset[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    return {m: {t for t in imported(m) if (m, t) not in drop} for m in modules()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def describe(g: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return "\n".join(f"  {m} -> {sorted(g[m] & members)}" for m in comp)


def test_the_import_graph_has_no_cycle() -> None:
    g = graph(drop=frozenset(ALLOWED_EDGES))
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n\n".join(describe(g, c) for c in found)


def test_every_allowed_edge_still_closes_a_cycle() -> None:
    """An allowance whose cycle is gone must be deleted (the list only shrinks)."""
    full = graph()
    for (a, b), owner in ALLOWED_EDGES.items():
        assert b in full[a], f"{a} no longer imports {b}: delete its allowance ({owner})"
        alone = graph(drop=frozenset(ALLOWED_EDGES) - {(a, b)})
        assert any(a in c and b in c for c in cycles(alone)), f"{a} -> {b} closes no cycle now: delete it"


def test_the_graph_sees_deferred_imports_and_skips_type_checking_ones() -> None:
    """The reader itself: the two cycles removed here would show again if they came back."""
    g = graph()
    assert "miles_aio.engine.weights" in g["miles_aio.engine.model"]  # it reads its checkpoint
    assert "miles_aio.engine.model" not in g["miles_aio.engine.weights"]  # LlamaSpec: annotations only
    assert "benchmarks.sim_validate" in g["benchmarks.simulate"]  # --validate, a deferred import
    assert "benchmarks.sim_run" in g["benchmarks.sim_validate"]
    assert "benchmarks.simulate" not in g["benchmarks.sim_validate"]
    assert "miles_aio" not in g["miles_aio.engine.handlers"]  # its own package: imported before it
    assert "miles_aio.eval" in g["miles_aio.controller"]  # a target's package runs first
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(toy) == [["a", "b", "c"]]

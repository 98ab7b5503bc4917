"""The import direction of kvtier's packages: the wire contract at the bottom, nothing importing upward.

Read from the source (every ``import`` of a kvtier module, at any depth, except those under ``if TYPE_CHECKING``)
and checked again at run time for what a light import must not load.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ["util", "kernels", "hardware", "wire", "engine", "indexer", "sim"]

# Layer -> the layers it may import (itself included). A module's layer is the longest prefix listed here.
ALLOWED: dict[str, set[str]] = {
    "kvtier.util": {"kvtier.util"},
    "kvtier.kernels": {"kvtier.kernels", "kvtier.util"},
    "kvtier.wire.transport": {"kvtier.wire.transport", "kvtier.wire", "kvtier.kernels", "kvtier.util"},
    "kvtier.wire": {"kvtier.wire", "kvtier.kernels", "kvtier.util"},  # the contract: not even its transport
    "kvtier.hardware": {"kvtier.hardware", "kvtier.wire", "kvtier.util"},
    "kvtier.engine.l3": {"kvtier.engine.l3", "kvtier.wire", "kvtier.util"},
    "kvtier.engine": {"kvtier.engine", "kvtier.engine.l3", "kvtier.wire", "kvtier.wire.transport", "kvtier.kernels",
                      "kvtier.util"},
    "kvtier.indexer.index": {"kvtier.indexer.index", "kvtier.wire", "kvtier.kernels", "kvtier.util"},
    "kvtier.indexer.routing": {"kvtier.indexer.routing", "kvtier.indexer.index", "kvtier.hardware", "kvtier.wire",
                               "kvtier.kernels", "kvtier.util"},
    "kvtier.indexer.service": {"kvtier.indexer.service", "kvtier.indexer.routing", "kvtier.indexer.index",
                               "kvtier.hardware", "kvtier.wire", "kvtier.wire.transport", "kvtier.kernels",
                               "kvtier.util"},
}
# The facades (package __init__ re-exporting lazily) and the simulator, at the top, may import anything.
TOP = {"kvtier.indexer", "kvtier.sim", "kvtier"}


def _layer(module: str) -> str:
    best = ""
    for layer in [*ALLOWED, *TOP]:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    assert best, f"{module} belongs to no layer"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for root in SOURCE_ROOTS:
        for f in (ROOT / root).rglob("*.py"):
            rel = f.relative_to(ROOT / root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = f
    return out


MODULES = _modules()
MODULE_NAMES = set(MODULES)


def _imports(path: Path, module: str) -> set[str]:
    """The kvtier modules ``path`` imports, outside ``if TYPE_CHECKING`` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULE_NAMES  # `from pkg import module`
            found.update(subs or {node.module})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvtier"))
    return found




def _graph() -> dict[str, set[str]]:
    return {m: {d for d in _imports(p, m) if d in MODULES and d != m} for m, p in MODULES.items()}


def test_every_module_imports_only_its_own_layer_and_those_below() -> None:
    wrong = []
    for m, deps in _graph().items():
        layer = _layer(m)
        if layer in TOP:
            continue
        wrong += [f"{m} imports {d}" for d in sorted(deps) if _layer(d) not in ALLOWED[layer]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


@pytest.mark.parametrize(("module", "absent"), [
    ("kvtier.indexer.index.tiered", ["aiohttp", "torch", "zmq", "kvtier.indexer.routing", "kvtier.indexer.service"]),
    ("kvtier.indexer.routing.router", ["aiohttp", "torch", "zmq", "kvtier.indexer.service"]),
    ("kvtier.wire", ["zmq", "aiohttp", "torch", "kvtier.wire.transport"]),
    ("kvtier.engine.cache", ["aiohttp", "torch", "kvtier.indexer"]),
    ("kvtier.kernels.jit", ["kvtier.wire", "zmq"]),
])
def test_a_light_import_loads_nothing_heavy(module: str, absent: list[str]) -> None:
    code = (f"import sys, {module}\n"
            f"print(' '.join(m for m in {absent!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} loaded {out}"


def test_no_symlinks_in_the_source_tree() -> None:
    links = [str(p.relative_to(ROOT)) for root in SOURCE_ROOTS for p in (ROOT / root).rglob("*") if p.is_symlink()]
    assert not links and not (ROOT / "kvtier").exists(), links

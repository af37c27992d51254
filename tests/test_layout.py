"""The dependency arrows between top-level packages go one way (docs/architecture.md draws
them). Every `import`/`from ... import` in every module, including imports inside functions,
is read with `ast` and checked against the table; a reverse import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (besides itself). Read top to bottom: each
# row may only name rows above it, except `workers.protocol`, the seam both sides share.
# `common` (the error family's base) imports nothing of ours, and every package may import it.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "formats": {"common"},
    "compile_cache": {"common"},
    "workers": {"common", "formats", "compile_cache"},
    "ingest": {"common", "formats"},
    # workers.cpus: the standard-library CPU count both sides plan threads with.
    "host": {"common", "workers.protocol", "workers.cpus", "ingest", "formats"},
    "certification": {"common", "host", "ingest", "workers", "compile_cache", "formats"},
    "service": {"common", "host", "ingest", "certification", "compile_cache", "workers.protocol"},
    "batch": {"common", "host", "ingest", "certification", "workers.protocol"},
    "cli": {
        "common",
        "host",
        "ingest",
        "certification",
        "compile_cache",
        "service",
        "batch",
        "workers",
        "formats",
    },
}
PROJECT = set(ALLOWED)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _allowed(package: str, target: str) -> bool:
    top = target.split(".")[0]
    if top not in PROJECT or top == package:
        return True
    return any(target == rule or target.startswith(rule + ".") for rule in ALLOWED[package])


def _violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, target in _imports(path):
            if not _allowed(package, target):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


@pytest.mark.parametrize("package", sorted(PROJECT))
def test_imports_follow_the_arrows(package):
    assert (ROOT / package).is_dir(), f"{package}/ is in the table but not in the tree"
    assert _violations(package) == []


def test_every_top_level_package_is_in_the_table():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == PROJECT


def test_the_checker_catches_a_reverse_import(tmp_path):
    # The rule itself must bite: a worker importing host is refused.
    assert not _allowed("workers", "host.lane")
    assert not _allowed("host", "service.app")
    assert _allowed("host", "workers.protocol.messages")
    assert not _allowed("host", "workers.llama.engine")
    assert _allowed("host", "workers.cpus") and not _allowed("host", "workers.cpus_extra")
    # The leaf: everyone may import it, it may import no one.
    assert all(_allowed(package, "common.errors") for package in PROJECT)
    assert not _allowed("common", "host.errors") and not _allowed("common", "formats")


# ---- import cycles between the project's own modules -----------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it names in an import: every import counts, inside
    functions and under `if TYPE_CHECKING:` too (a type-only import is still a seam that
    runs both ways). `from pkg import name` names `pkg.name` when that is a module, else
    `pkg`; a package's `__init__` is not implied by importing one of its modules."""
    files = {_module_name(p): p for package in PROJECT for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in files
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the longest import chain
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# Cycles that were there before this check and are not broken yet, each with how it runs:
# the list may only shrink (a broken one must leave it, a new cycle fails).
KNOWN_CYCLES = [
    # store.py keeps QuantizationRanges in the manifest; quantization names the store's
    # types for its hints only (under TYPE_CHECKING).
    ["ingest.quantization", "ingest.store"],
]


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(_import_graph()) == KNOWN_CYCLES


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}, "b": set()}
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []

"""The dependency direction, read from every import statement (lazy ones included):
edge_agent -> models, fldata, shared_protocol; cloud_server -> models, fldata,
shared_protocol; models, fldata and shared_protocol import none of the others;
edge_agent and cloud_server never import each other; shared_protocol never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared_protocol", "models", "fldata", "edge_agent", "cloud_server")
FORBIDDEN = {
    "shared_protocol": {"models", "fldata", "edge_agent", "cloud_server", "torch", "torchvision"},
    "models": {"shared_protocol", "fldata", "edge_agent", "cloud_server"},
    "fldata": {"shared_protocol", "models", "edge_agent", "cloud_server"},
    "edge_agent": {"cloud_server"},
    "cloud_server": {"edge_agent"},
}


def imported_roots(source: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_the_layering_allows(package: str) -> None:
    offences = {
        str(source.relative_to(ROOT)): sorted(imported_roots(source) & FORBIDDEN[package])
        for source in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: roots for path, roots in offences.items() if roots} == {}


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from cloud_server.config import ServerConfig\n    import torch.nn\n")
    assert imported_roots(bad) == {"cloud_server", "torch"}


# -- no import cycle between two modules of the packages ------------------------------------------ #


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for package in packages:
        for source in sorted((root / package).rglob("*.py")):
            parts = list(source.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (source, is_package)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports: every import statement, lazy ones and
    ``TYPE_CHECKING`` ones included (``from pkg import name`` counts as importing the module
    ``pkg.name`` when there is one, else ``pkg``)."""
    modules = _modules(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (source, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names]
            for target in targets:
                resolved = resolve(target)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycle_between_modules() -> None:
    assert import_cycles(import_graph(ROOT, PACKAGES)) == [], "break these cycles (move what both need to a third module)"


def test_the_cycle_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nimport os\n")
    (pkg / "d.py").write_text("from . import a\n")  # imports into the cycle, not part of it
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "a.py").write_text("")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == []

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

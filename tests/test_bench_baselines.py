"""bench/render_results.py: docs/results.md is exactly what the renderer makes of the recorded
JSON files; ``load`` imports a bench script for the bench tests."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from fedhelpers import ROOT

BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def load(name: str) -> ModuleType:
    # bench/ is not a package; appended (not prepended) to sys.path so that a script of it can
    # never shadow the standard library, while the scripts still import each other.
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"edgesplit_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_results_page_is_rendered_from_the_recorded_results() -> None:
    render = load("render_results")
    assert (ROOT / "docs" / "results.md").read_text() == render.render(RESULTS), "rerun bench/render_results.py"

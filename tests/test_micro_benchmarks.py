"""The micro-benchmarks' harness (bench/micro/, pytest-benchmark) cannot rot: every file of it
collects, one tiny case runs and writes the JSON its results section reads."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from fedhelpers import ROOT


def micro_docs() -> ModuleType:
    """bench/micro_docs.py (bench/ is not a package; the module imports only the standard library)."""
    spec = importlib.util.spec_from_file_location("edgesplit_bench_micro_docs", ROOT / "bench" / "micro_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_harness_collects_every_file_and_runs_a_tiny_case(tmp_path: Path) -> None:
    out = tmp_path / "edge_cost.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/micro", "--quick",
         "-k", "test_training_batch and resnet8 or test_runtime_alone and ort", f"--benchmark-json={out}"],
        cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout and "deselected" in result.stdout  # the other files were collected, not run
    docs = micro_docs()
    data = docs.load_micro(out)
    assert data is not None and sorted(data["by_name"]) == ["test_runtime_alone[ort]", "test_training_batch[resnet8]"]
    ort = docs.case(data, "test_runtime_alone[ort]")["extra_info"]
    assert ort["peak_rss_bytes_max"] > 0 and ort["runs"][0]["torch_loaded"] is False  # the ort worker runs without torch
    case = docs.case(data, "test_training_batch[resnet8]")
    assert case["stats"]["median"] > 0 and case["extra_info"]["params"] > 0 and case["extra_info"]["training_flops_per_sample"] > 0
    assert "At `--quick` sizes" in docs.source_line(data, "edge_cost")  # a quick run never reads as a measurement

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


def test_the_transport_verdicts_follow_the_recorded_rates() -> None:
    spec = importlib.util.spec_from_file_location("edgesplit_bench_micro_transport", ROOT / "bench" / "micro" / "test_transport.py")
    assert spec is not None and spec.loader is not None
    transport = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(transport)
    docs = micro_docs()

    def page(ours_rate: float, ours_cpu: float, apart_rate: float | None = None) -> tuple[dict, str]:
        rates = {"tcp_socket": [900.0, 1000.0]}
        cpu = {}
        for mode in ("plain", "tls", *(("plain_procs", "tls_procs") if apart_rate else ())):
            rate = apart_rate if mode.endswith("_procs") else ours_rate
            rates[f"paho_raw_{mode}"], cpu[f"paho_raw_{mode}"] = [100.0, 100.0], {"clients": [1.0, 1.0], "broker": [1.0, 1.0]}
            rates[f"edgesplit_{mode}"], cpu[f"edgesplit_{mode}"] = [rate] * 2, {"clients": [ours_cpu] * 2, "broker": [1.0, 1.0]}
        info = {"megabytes": 8, "repeats": 2, "chunk_bytes": 2**19, "blob_megabytes": 8, "method": "alternately",
                **transport.summary(rates, cpu)}
        data = {"machine_info": {}, "datetime": "2026-01-01T00:00:00", "benchmarks": [{"name": "test_transport", "extra_info": info}]}
        return info, "\n".join(docs.transport_section({**data, "by_name": {"test_transport": data["benchmarks"][0]}}))

    near, text = page(ours_rate=90.0, ours_cpu=1.5)  # 1.11x the time, 1.25x the CPU
    assert near["within_time_target"] and near["within_cpu_target"] and "1.2×: within" in text and "raw paho's: within" in text
    assert "MB XXH3-128-verified blobs" in text and "process of its own" not in text  # the receivers apart: not measured
    far, text = page(ours_rate=50.0, ours_cpu=3.0)  # 2x the time, 2x the CPU
    assert not far["within_time_target"] and not far["within_cpu_target"] and text.count("**not** within") == 2
    # Apart, the verdicts are the second arrangement's own: here it meets the time target the first misses.
    both, text = page(ours_rate=50.0, ours_cpu=1.2, apart_rate=95.0)
    assert not both["within_time_target"] and both["within_time_target_apart"] and both["within_cpu_target_apart"]
    assert "EdgeSplit transport, plain, receiver apart | 95 |" in text and "plain 1.05×, TLS 1.05× (time: within)" in text
    assert "1.2×: **not** within" in text

"""The ledger's server device per round: the DeviceMeter's figures, their schema, summary.md."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from cloud_server import device_meter as dm
from cloud_server.device_meter import DeviceMeter
from cloud_server.report import ReportError, validate_report
from cloud_server.report.markdown import summary_md

from fedhelpers import agent_config, in_memory_federation, server_config
from test_report import make_report

CPU_ROUND = {
    "device": "cpu", "device_name": "AMD EPYC", "train_s": 12.5, "peak_memory_bytes": None,
    "gpu_utilization_percent": None, "gpu_utilization_max_percent": None, "gpu_utilization_samples": 0,
    "gpu_utilization_unavailable": "the server trains on the cpu, not a GPU",
}
GPU_ROUND = {
    "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "train_s": 31.25, "peak_memory_bytes": 3_456_000_000,
    "gpu_utilization_percent": 63.5, "gpu_utilization_max_percent": 97, "gpu_utilization_samples": 62,
    "gpu_utilization_unavailable": None,
}


def _with_server(rounds: list[dict[str, Any] | None]) -> dict[str, Any]:
    report = make_report(rounds=len(rounds))
    for record, server in zip(report["rounds"], rounds):
        if server is not None:
            record["server"] = copy.deepcopy(server)
    return report


def test_server_device_figures_validate_and_show_in_the_summary() -> None:
    report = _with_server([None, CPU_ROUND, GPU_ROUND])  # round 1 as written before the field existed
    validate_report(report)
    summary = summary_md(report)
    assert "## Server device per round" in summary
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("|")}
    assert "NVIDIA H100 80GB HBM3" in rows["3"] and "31.2" in rows["3"] and "3,456" in rows["3"] and "64% / 97%" in rows["3"]
    assert "AMD EPYC" in rows["2"] and "12.5" in rows["2"] and "—" in rows["2"]
    assert "the server trains on the cpu, not a GPU" in summary


def test_reports_without_server_device_figures_have_no_such_section() -> None:
    report = make_report()
    validate_report(report)
    assert "Server device per round" not in summary_md(report)


BAD = {
    "missing device name": ({"device_name": None}, "device_name: expected str, got None"),
    "negative training time": ({"train_s": -1.0}, "train_s: must be >= 0"),
    "utilisation over 100": ({"gpu_utilization_percent": 120.0}, "gpu_utilization_percent: must be <= 100"),
    "fractional peak bytes": ({"peak_memory_bytes": 1.5}, "peak_memory_bytes: expected int or None"),
    "a figure and a reason": ({"gpu_utilization_unavailable": "no NVML"}, "exactly one of them"),
    "neither figure nor reason": ({"gpu_utilization_percent": None, "gpu_utilization_max_percent": None,
                                   "gpu_utilization_samples": 0}, "exactly one of them"),
    "samples without a figure": ({"gpu_utilization_percent": None, "gpu_utilization_max_percent": None,
                                  "gpu_utilization_unavailable": "no NVML"}, "disagree"),
    "mean above max": ({"gpu_utilization_percent": 99.0}, "exceeds gpu_utilization_max_percent"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_server_device_figures_are_refused(case: str) -> None:
    change, message = BAD[case]
    report = _with_server([GPU_ROUND])
    report["rounds"][0]["server"].update(change)
    with pytest.raises(ReportError, match="rounds\\[0\\] \\(round 1\\)\\.server") as err:
        validate_report(report)
    assert any(message in p for p in err.value.problems), err.value.problems


def test_a_missing_server_field_is_named() -> None:
    report = _with_server([CPU_ROUND])
    del report["rounds"][0]["server"]["train_s"]
    with pytest.raises(ReportError, match="server.train_s: missing"):
        validate_report(report)


# --------------------------------------------------------------------------- #
# the meter
# --------------------------------------------------------------------------- #


def test_device_meter_on_the_cpu_counts_training_and_says_why_there_is_no_utilisation() -> None:
    meter = DeviceMeter("cpu")
    with meter.training():
        time.sleep(0.05)
    with meter.training():
        time.sleep(0.02)
    figures = meter.take().to_json()  # the record as report.json holds it
    assert figures["device"] == "cpu" and figures["device_name"] == dm.cpu_model()
    assert figures["train_s"] >= 0.07
    assert figures["peak_memory_bytes"] is None and figures["gpu_utilization_percent"] is None
    assert "cpu" in figures["gpu_utilization_unavailable"]
    report = _with_server([figures])
    validate_report(report)
    assert meter.take().train_s == 0.0  # the next round starts from zero


def test_device_meter_samples_utilisation_only_while_training(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter(range(10, 100, 10))
    monkeypatch.setattr(dm, "utilization_reader", lambda device: ((lambda: next(readings, 90)), None))
    meter = DeviceMeter("cpu", sample_every_s=0.01)
    with meter.training():
        time.sleep(0.2)
    time.sleep(0.1)  # not training: no samples
    figures = meter.take().to_json()  # the record as report.json holds it
    assert figures["gpu_utilization_samples"] >= 3
    assert figures["gpu_utilization_percent"] is not None and figures["gpu_utilization_unavailable"] is None
    assert figures["gpu_utilization_max_percent"] >= figures["gpu_utilization_percent"] >= 10
    validate_report(_with_server([figures]))
    assert meter.take().gpu_utilization_samples == 0  # taken: the next round samples afresh
    with pytest.raises(ValueError, match="sample_every_s"):
        DeviceMeter("cpu", sample_every_s=0)


def test_utilisation_is_unavailable_off_a_gpu() -> None:
    read, why = dm.utilization_reader("cpu")
    assert read is None and "cpu" in why


def test_every_round_of_a_federation_records_the_server_device(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, run_id="ledger", rounds=1)
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start()
    report = fed.join()
    validate_report(report)
    (record,) = report["rounds"]
    server = record["server"]
    assert server["device"] == "cpu" and server["peak_memory_bytes"] is None
    assert 0 < server["train_s"] <= record["time_s"]["round"]
    assert "Server device per round" in (tmp_path / "run" / "summary.md").read_text()

"""Figures quoted outside docs/results.md match the bench JSON they name: a re-measured bench
that changes a figure fails here until the prose says the new one (docs/results.md itself is
checked by the renderer's tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _demo_runs() -> list[dict]:
    runs = [r for r in _load("fedgkt_async.json")["runs"].values() if r["name"] == "fedgkt-sync"]
    return sorted(runs, key=lambda r: r["seed"])


def test_the_readme_quotes_the_demo_figures_of_fedgkt_async_json() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`bench/results/fedgkt_async.json`, the sync runs" in readme
    runs = _demo_runs()
    assert [r["seed"] for r in runs] == [0, 1, 2]
    global_ = " / ".join(_pct(r["final_accuracy"]) for r in runs)
    edges = " / ".join(_pct(r["final_edge_accuracy"]) for r in runs)
    assert f"the server model reaches {global_} global after round 6" in readme
    cell = _load("fedgkt_async.json")["cells"]["fedgkt-sync"]["final_accuracy"]
    assert f"({100 * cell['mean']:.1f} ± {100 * cell['sd']:.1f}%)" in readme
    assert f"the ResNet-8s left on the devices {edges}" in readme
    minutes = re.search(r"seeds 0 and 1 took ([\d.]+) and ([\d.]+) minutes", readme)
    assert minutes is not None
    assert [float(m) for m in minutes.groups()] == [round(r["wall_time_s"] / 60, 1) for r in runs[:2]]


def test_configuration_quotes_the_compiled_step_of_server_loop_json() -> None:
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    check = _load("server_loop.json")["compile_check"]
    assert f"{check['compiled_speedup_median']:.2f}x faster (median; `compile_check.compiled_speedup_median`" in text
    assert f"its {check['compile_s']:.0f} s cold compilation after about {check['break_even_steps']:.0f} steps" in text


def test_deploy_quotes_what_watching_costs_from_metrics_overhead_json() -> None:
    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    direct = _load("metrics_overhead.json")["summary"]["direct"]
    cpu = direct["cpu_s_per_run"]["values"]
    assert f"spent {min(cpu):.1f}-{max(cpu):.1f} s of CPU on metrics" in text
    assert f"rounds take about {direct['off_round_time_total_s']:.0f} s" in text
    assert f"at most {100 * direct['highest_share']:.2f} % of the round time (`bench/results/metrics_overhead.json`" in text

"""bench/metrics_overhead.py (what watching a run costs): its --quick mode end to
end with the JSON's schema (not its figures), the ABBA order, the banner it reads the
endpoints from, the pairing and the verdict rule; and the results page's section."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fedhelpers import ROOT
from test_bench_baselines import load

FIGURES = {"round_time", "server_train", "run_wall_time", "cpu_tree", "cpu_server", "cpu_agents"}


def _mean_sd_shape(cell: dict[str, Any]) -> None:
    assert set(cell) == {"mean", "sd", "n", "values"}, cell


@pytest.mark.slow
@pytest.mark.broker
def test_quick_mode_runs_off_and_on_scrapes_every_endpoint_and_writes_the_schema(tmp_path: Path) -> None:
    bench = load("metrics_overhead")
    out = tmp_path / "overhead.json"
    assert bench.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "metrics_overhead" and data["generated_by"] == "bench/metrics_overhead.py --quick"
    assert data["setting"] == bench.QUICK and data["setting"]["agents"] == 2 and data["setting"]["rounds"] == 1
    scale = data["scale"]
    assert scale["name"] == "quick" and scale["order"] == ["off", "on"] and scale["complete"] is True
    assert scale["pairs_planned"] == scale["pairs_measured"] == 1 and scale["runs_made"] == 2
    # The claim that nothing is imported when off points at the test that checks it.
    test_file, test_name = data["off_not_imported"]["checked_by"].split("::")
    assert f"def {test_name}(" in (ROOT / test_file).read_text()
    off, on = data["runs"]
    assert (off["condition"], on["condition"]) == ("off", "on")
    for run in (off, on):
        assert run["status"] == "finished" and len(run["round_s"]) == len(run["server_train_s"]) == 1
        assert len(run["load_average_before"]) == len(run["load_average_after"]) == 3
        cpu = run["cpu_s"]
        assert cpu["tree_total"] > 0 and set(cpu["by_process"]) <= {"server", "agent-0", "agent-1", "mosquitto", "other"}
        assert {"server", "agents", "tree_is", "sampled_is"} <= set(cpu)
    assert "scrapes" not in off
    scrapes = on["scrapes"]
    assert set(scrapes["endpoints"]) == {"status_page", "server", "agent-0", "agent-1"}
    assert scrapes["endpoints"]["server"] == scrapes["endpoints"]["status_page"] + "metrics"
    assert set(scrapes["per_endpoint"]) == set(scrapes["endpoints"])
    assert all(set(c) == {"ok", "failed", "bytes", "seconds"} for c in scrapes["per_endpoint"].values())
    # Something actually scraped the server while the run was on.
    assert scrapes["per_endpoint"]["server"]["ok"] + scrapes["per_endpoint"]["status_page"]["ok"] >= 1
    # The endpoints' own cost, read from their last scrape: the server's hooks ran for every message.
    cost = on["self_cost"]
    assert cost["by_endpoint"]["server"]["update_cpu_s"] > 0 and cost["by_endpoint"]["server"]["requests"] >= 1
    assert cost["cpu_s_total"] > 0 and 0 < cost["share_of_round_time"] < 1
    summary = data["summary"]
    assert summary["direct"]["runs"] == [1]
    (pair,) = summary["pairs"]
    assert pair["runs"] == [0, 1] and set(pair["ratios"]) == FIGURES | {"per_round"} and len(pair["ratios"]["per_round"]) == 1
    assert set(summary["on_over_off"]) == FIGURES
    for cell in (*summary["on_over_off"].values(), summary["on_over_off_per_round"]):
        _mean_sd_shape(cell)
    assert summary["same_condition_pairs"] == []
    assert summary["verdict"]["within_target"] is None and summary["verdict"]["target_ratio"] == pytest.approx(1.02)
    assert {"rule", "result", "overhead_percent", "sd_percent", "same_condition_noise_percent"} <= set(summary["verdict"])


def test_runs_are_interleaved_in_abba_blocks() -> None:
    bench = load("metrics_overhead")
    assert bench.order(1) == ["off", "on"]
    assert bench.order(4) == ["off", "on", "on", "off", "off", "on", "on", "off"]
    assert bench.command(bench.DEMO, "off", "r", Path("x"))[-4:] == ["--run-id", "r", "--out", "x"]
    assert bench.command(bench.DEMO, "on", "r", Path("x"))[-1] == "--metrics"


def test_the_endpoints_are_read_from_the_launchers_banner(tmp_path: Path) -> None:
    from cloud_server.launcher import metrics_banner
    from shared_protocol.tomlio import write_toml

    server = tmp_path / "server.toml"
    write_toml(server, {"server": {"metrics_address": "127.0.0.1:9464"}})
    agents = []
    for i, port in enumerate((40001, 40002)):
        agents.append(tmp_path / f"agent-{i}.toml")
        write_toml(agents[-1], {"agent": {"agent_id": f"agent-{i}", "metrics_address": f"127.0.0.1:{port}"}})
    banner = metrics_banner(server, agents)
    assert banner is not None and banner.startswith(load("metrics_overhead").BANNER)
    assert load("metrics_overhead").endpoints(banner) == {
        "status_page": "http://127.0.0.1:9464/", "server": "http://127.0.0.1:9464/metrics",
        "agent-0": "http://127.0.0.1:40001/metrics", "agent-1": "http://127.0.0.1:40002/metrics"}
    with pytest.raises(ValueError, match="banner"):
        load("metrics_overhead").endpoints("edgesplit: broker mqtt://127.0.0.1:1883")


def _run(index: int, condition: str, round_s: list[float], cpu: float = 100.0) -> dict[str, Any]:
    return {"index": index, "condition": condition, "status": "finished", "round_s": round_s, "server_train_s": [1.0] * len(round_s),
            "run_wall_time_s": sum(round_s) + 10, "cpu_s": {"tree_total": cpu, "server": cpu / 2, "agents": cpu / 2}}


def test_pairs_ratios_noise_and_the_verdict_rule() -> None:
    bench = load("metrics_overhead")
    # ABBA: (off, on), (on, off); runs 1-2 are an on/on A/A pair.
    runs = [_run(0, "off", [10.0, 10.0]), _run(1, "on", [10.05, 10.05], 101.0), _run(2, "on", [10.1, 10.1]), _run(3, "off", [10.0, 10.0])]
    summary = bench.summarise(runs, 2)
    assert [p["order"] for p in summary["pairs"]] == ["off,on", "on,off"]
    assert summary["pairs"][0]["ratios"]["round_time"] == pytest.approx(1.005)
    assert summary["pairs"][1]["ratios"]["per_round"] == pytest.approx([1.01, 1.01])
    assert summary["on_over_off"]["round_time"]["mean"] == pytest.approx(1.0075)
    assert summary["on_over_off_per_round"]["n"] == 4
    assert summary["same_condition_pairs"][0]["condition"] == "on"
    assert summary["same_condition_noise"]["round_time"]["mean"] == pytest.approx(0.05 / 10.05)
    assert summary["verdict"]["within_target"] is True  # 1.0075 + 0.0035 <= 1.02
    over = bench.verdict({"mean": 1.10, "sd": 0.01}, {})
    unresolved = bench.verdict({"mean": 1.01, "sd": 0.05}, {})
    assert over["within_target"] is False and over["result"].startswith("over 2 %")
    assert unresolved["within_target"] is None and unresolved["result"].startswith("not resolved")
    # Far below 1 with a large sd is noise, not "within": the sd must be below the target.
    assert bench.verdict({"mean": 0.60, "sd": 0.32}, {})["within_target"] is None
    # So must the spread of runs with nothing changed, where measured.
    assert bench.verdict({"mean": 1.00, "sd": 0.01}, {"mean": 0.05})["within_target"] is None
    assert bench.verdict({"mean": 1.00, "sd": 0.01}, {"mean": 0.01})["within_target"] is True
    # Too noisy to tell end to end: the direct measurement decides, within only when its bound
    # is at most the target; it never overrules an "over".
    noisy = ({"mean": 1.007, "sd": 0.12}, {"mean": 0.094})
    direct = bench.verdict(*noisy, 0.004)
    assert direct["within_target"] is True and direct["decided_by"] == "direct" and "0.40 %" in direct["result"]
    assert bench.verdict(*noisy, 0.03)["within_target"] is None and "3.00 %" in bench.verdict(*noisy, 0.03)["result"]
    assert bench.verdict(*noisy)["within_target"] is None
    assert bench.verdict({"mean": 1.10, "sd": 0.01}, {}, 0.001)["within_target"] is False
    # The on runs' own cost, from what their endpoints served.
    text = ('edgesplit_metrics_cpu_seconds_total{method="fedgkt",part="serve",run="r"} 0.25\n'
            'edgesplit_metrics_cpu_seconds_total{method="fedgkt",part="update",run="r"} 0.05\n'
            'edgesplit_metrics_requests_total{method="fedgkt",run="r"} 12.0\n'
            'edgesplit_rounds_total{method="fedgkt",run="r",status="ok"} 2.0\n')
    assert bench.self_cost_of(text) == {"serve_cpu_s": 0.25, "update_cpu_s": 0.05, "requests": 12.0}
    cost = bench.direct_cost({"server": bench.self_cost_of(text), "agent-0": {"serve_cpu_s": 0.1, "update_cpu_s": 0.1}}, [50.0, 50.0])
    assert cost["cpu_s_total"] == pytest.approx(0.5) and cost["share_of_round_time"] == pytest.approx(0.005)
    with_cost = [dict(r) for r in runs]
    with_cost[1]["self_cost"] = cost
    with_cost[2]["self_cost"] = bench.direct_cost({"server": {"serve_cpu_s": 0.1}}, [10.0, 10.0])
    summary = bench.summarise(with_cost, 2)
    # Against the off runs' summed round time (20 s), not the on run's own: 0.5 / 20 and 0.1 / 20.
    assert summary["direct"]["runs"] == [1, 2] and summary["direct"]["off_round_time_total_s"] == pytest.approx(20.0)
    assert summary["direct"]["highest_share"] == pytest.approx(0.025)
    assert summary["direct"]["share_of_round_time"]["mean"] == pytest.approx(0.015)
    # A failed run leaves its pair out; the JSON still has the other.
    runs[3] = {"index": 3, "condition": "off", "failed": "exit 1"}
    assert [p["pair"] for p in bench.summarise(runs, 2)["pairs"]] == [0]


def _synthetic() -> dict[str, Any]:
    """A made-up JSON in the bench's schema (figures invented; for the renderer only)."""
    bench = load("metrics_overhead")
    runs = [_run(0, "off", [60.0] * 6, 900.0), _run(1, "on", [61.0] * 6, 910.0), _run(2, "on", [63.0] * 6, 930.0),
            _run(3, "off", [62.0] * 6, 920.0)]
    for r in runs:
        r.update(load_average_before=[3.0, 2.5, 2.0], load_average_after=[4.0, 3.0, 2.5], run_id=f"overhead-{r['index']:02d}-{r['condition']}")
        if r["condition"] == "on":
            r["scrapes"] = {"interval_s": 5.0, "endpoints": {}, "scraper_thread_cpu_s": 0.5,
                            "per_endpoint": {"server": {"ok": 70, "failed": 2, "bytes": 1_000_000, "seconds": 1.0},
                                             "status_page": {"ok": 70, "failed": 2, "bytes": 300_000, "seconds": 2.0}}}
    return {"benchmark": "metrics_overhead", "setting": bench.DEMO, "generated_by": "bench/metrics_overhead.py",
            "scale": {"name": "demo", "pairs_planned": 2, "pairs_measured": 2, "order": bench.order(2), "runs_made": 4,
                      "complete": True, "wall_time_min": 33.0, "scrape_interval_s": 5.0},
            "off_not_imported": {"checked_by": bench.OFF_CHECK}, "summary": bench.summarise(runs, 2), "runs": runs,
            "machine": {"cpu_model": "AMD EPYC", "arch": "x86_64", "cores": 2, "torch": "2.x", "date_utc": "2026-11-25T19:00:00Z",
                        "load_average_at_start": [1.0, 1.0, 1.0], "load_average_at_end": [2.0, 2.0, 2.0]}}


def test_the_results_page_section_matches_a_synthetic_json() -> None:
    render = load("render_results")
    data = _synthetic()
    text = "\n".join(render.metrics_overhead_section(data))
    assert text.startswith("## What watching a run costs: metrics off vs on (issue 29)")
    assert "`bench/results/metrics_overhead.json` (`bench/metrics_overhead.py`)" in text
    assert "tests/test_metrics.py::test_metrics_code_is_imported_only_when_on" in text
    # One row per pair with its ratio, and the mean ± sd over the pairs.
    pairs = data["summary"]["pairs"]
    for p in pairs:
        assert re.search(rf"\| {p['pair'] + 1} \| {p['order'].replace(',', ', ')} \| {p['ratios']['round_time']:.4f} \|", text), text
    rt = data["summary"]["on_over_off"]["round_time"]
    assert f"{rt['mean']:.4f} ± {rt['sd']:.4f}" in text
    assert data["summary"]["verdict"]["result"] in text
    assert "Measured directly" not in text  # no on run recorded its endpoints' own cost
    costly = _synthetic()
    for r in costly["runs"]:
        if r["condition"] == "on":
            r["self_cost"] = load("metrics_overhead").direct_cost(
                {"server": {"serve_cpu_s": 0.2, "update_cpu_s": 0.1}, "agent-0": {"serve_cpu_s": 0.05, "update_cpu_s": 0.05}},
                r["round_s"])
    costly["summary"] = load("metrics_overhead").summarise(costly["runs"], 2)
    direct_text = "\n".join(render.metrics_overhead_section(costly))
    assert "Measured directly" in direct_text and "| 200 / 100 | 100 | 400 |" in direct_text
    # Load averages before/after each run appear.
    assert "3.0 → 4.0" in text
    incomplete = {**data, "scale": {**data["scale"], "complete": False, "pairs_measured": 1}}
    assert "**Incomplete:** 1 of 2 pairs measured" in "\n".join(render.metrics_overhead_section(incomplete))
    assert "not found" in "\n".join(render.metrics_overhead_section(None))
    assert "Not `make demo`'s setting" not in text
    reduced = {**data, "setting": {**data["setting"], "rounds": 3},
               "scale": {**data["scale"], "departs_from_demo": {"rounds": {"demo": 6, "here": 3}}, "note": "Too slow here."}}
    assert "**Not `make demo`'s setting:** rounds 3 (demo: 6). Too slow here." in "\n".join(render.metrics_overhead_section(reduced))


def test_collect_rebuilds_the_summary_from_the_recorded_runs(tmp_path: Path) -> None:
    bench = load("metrics_overhead")
    data = _synthetic()
    data["summary"] = {"stale": True}
    out = tmp_path / "overhead.json"
    out.write_text(json.dumps(data))
    assert bench.main(["--collect", "--out", str(out)]) == 0
    rebuilt = json.loads(out.read_text())
    assert rebuilt["summary"] == bench.summarise(data["runs"], 2) and rebuilt["runs"] == data["runs"]
    assert rebuilt["scale"]["complete"] is True and rebuilt["generated_by"].endswith("(summary rebuilt with --collect)")

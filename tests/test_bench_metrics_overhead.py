"""bench/micro/test_metrics_overhead.py (what watching a run costs): its --quick run end to end
with the JSON the results page reads (not its figures), the banner it reads the endpoints from,
the endpoints' own cost, and micro_docs' verdict rule and section."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fedhelpers import ROOT
from test_micro_benchmarks import micro_docs


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("edgesplit_bench_metrics_overhead", ROOT / "bench" / "micro" / "test_metrics_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.broker
def test_quick_runs_off_and_on_scrapes_every_endpoint_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "metrics_overhead.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/micro/test_metrics_overhead.py",
                             "--quick", f"--benchmark-json={out}"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    docs = micro_docs()
    data = docs.load_micro(out)
    assert data is not None
    (off,), (on,) = (docs.case(data, f"test_demo[{c}]")["extra_info"]["runs"] for c in ("off", "on"))
    for run in (off, on):
        assert run["status"] == "finished" and len(run["round_s"]) == len(run["server_train_s"]) == 1 and run["cpu_s"]["tree_total"] > 0
    assert "scrapes" not in off
    assert set(on["scrapes"]["endpoints"]) == {"status_page", "server", "agent-0", "agent-1"}
    assert on["scrapes"]["endpoints"]["server"] == on["scrapes"]["endpoints"]["status_page"] + "metrics"
    assert on["scrapes"]["per_endpoint"]["server"]["ok"] + on["scrapes"]["per_endpoint"]["status_page"]["ok"] >= 1
    # The endpoints' own cost, read from their last scrape: the server's hooks ran for every message.
    cost = on["self_cost"]
    assert cost["by_endpoint"]["server"]["update_cpu_s"] > 0 and cost["by_endpoint"]["server"]["requests"] >= 1
    assert cost["cpu_s_total"] > 0 and 0 < cost["share_of_round_time"] < 1
    # The claim that nothing is imported when off points at the test that checks it.
    test_file, test_name = docs.case(data, "test_demo[off]")["extra_info"]["off_not_imported_checked_by"].split("::")
    assert f"def {test_name}(" in (ROOT / test_file).read_text()
    assert "Target, round time with metrics on within 2 % of off" in "\n".join(docs.metrics_overhead_section(data))


def test_the_command_is_make_demos_and_the_endpoints_are_read_from_the_launchers_banner(tmp_path: Path) -> None:
    from cloud_server.launcher import metrics_banner
    from shared_protocol.tomlio import write_toml

    b = bench()
    assert b.command(b.DEMO, "off", "r", Path("x"))[-4:] == ["--run-id", "r", "--out", "x"]
    assert b.command(b.DEMO, "on", "r", Path("x"))[-1] == "--metrics"
    server = tmp_path / "server.toml"
    write_toml(server, {"server": {"metrics_address": "127.0.0.1:9464"}})
    agents = []
    for i, port in enumerate((40001, 40002)):
        agents.append(tmp_path / f"agent-{i}.toml")
        write_toml(agents[-1], {"agent": {"agent_id": f"agent-{i}", "metrics_address": f"127.0.0.1:{port}"}})
    banner = metrics_banner(server, agents)
    assert banner is not None and banner.startswith(b.BANNER)
    assert b.endpoints(banner) == {"status_page": "http://127.0.0.1:9464/", "server": "http://127.0.0.1:9464/metrics",
                                   "agent-0": "http://127.0.0.1:40001/metrics", "agent-1": "http://127.0.0.1:40002/metrics"}
    with pytest.raises(ValueError, match="banner"):
        b.endpoints("edgesplit: broker mqtt://127.0.0.1:1883")


def test_an_endpoints_own_cost_is_read_from_what_it_serves() -> None:
    b = bench()
    text = ('edgesplit_metrics_cpu_seconds_total{method="fedgkt",part="serve",run="r"} 0.25\n'
            'edgesplit_metrics_cpu_seconds_total{method="fedgkt",part="update",run="r"} 0.05\n'
            'edgesplit_metrics_requests_total{method="fedgkt",run="r"} 12.0\n'
            'edgesplit_rounds_total{method="fedgkt",run="r",status="ok"} 2.0\n')
    assert b.self_cost_of(text) == {"serve_cpu_s": 0.25, "update_cpu_s": 0.05, "requests": 12.0}
    cost = b.direct_cost({"server": b.self_cost_of(text), "agent-0": {"serve_cpu_s": 0.1, "update_cpu_s": 0.1}}, [50.0, 50.0])
    assert cost["cpu_s_total"] == pytest.approx(0.5) and cost["share_of_round_time"] == pytest.approx(0.005)
    assert b.direct_cost({}, [50.0])["share_of_round_time"] is None  # nothing scraped: no bound


def _run(condition: str, round_s: float, own_cpu_s: float | None = None, **extra: Any) -> dict[str, Any]:
    run = {"condition": condition, "status": "finished", "round_s": [round_s] * 2, "server_train_s": [1.0, 1.0],
           "run_wall_time_s": 2 * round_s + 10, "cpu_s": {"tree_total": 100.0}, "load_average_before": [1.0, 1.0, 1.0],
           "load_average_after": [2.0, 2.0, 2.0], **extra}
    if own_cpu_s is not None:
        run["self_cost"] = bench().direct_cost({"server": {"serve_cpu_s": own_cpu_s}}, run["round_s"])
        run["scrapes"] = {"endpoints": {}, "per_endpoint": {"server": {"ok": 10, "failed": 1, "bytes": 1000}}}
    return run


def _data(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> dict[str, Any]:
    """A made-up JSON in the harness's shape (figures invented; for the verdict and the renderer only)."""
    b = bench()
    info = {"setting": b.DEMO, "scrape_interval_s": 5.0, "off_not_imported_checked_by": b.OFF_CHECK}
    return {"machine_info": {"cpu_model": "AMD EPYC", "cores": 2, "load_average": [1.0, 1.0, 1.0]}, "datetime": "2026-11-25T19:00:00",
            "by_name": {f"test_demo[{c}]": {"extra_info": {**info, "runs": runs}} for c, runs in (("off", off), ("on", on))}}


def test_the_verdict_weighs_the_ratio_against_the_spread_and_falls_back_on_the_direct_bound() -> None:
    verdict = micro_docs().metrics_verdict
    steady = [_run("off", 10.0), _run("off", 10.0)]
    assert verdict(_data(steady, [_run("on", 10.05), _run("on", 10.05)]))["within"] is True
    over = verdict(_data(steady, [_run("on", 11.0), _run("on", 11.0)]))
    assert over["within"] is False and over["result"].startswith("over 2 %")
    noisy_off = [_run("off", 8.0), _run("off", 12.0)]
    # Too noisy to tell end to end: the direct bound decides, "within" only when it is at most the target.
    direct = verdict(_data(noisy_off, [_run("on", 10.0, own_cpu_s=0.08), _run("on", 10.0, own_cpu_s=0.04)]))
    assert direct["within"] is True and "0.40 %" in direct["result"] and direct["highest_share"] == pytest.approx(0.004)
    costly = verdict(_data(noisy_off, [_run("on", 10.0, own_cpu_s=0.6), _run("on", 10.0)]))
    assert costly["within"] is None and "3.00 %" in costly["result"]
    assert verdict(_data(noisy_off, [_run("on", 10.0), _run("on", 10.0)]))["within"] is None
    # The direct bound never overrules an "over".
    assert verdict(_data(steady, [_run("on", 11.0, own_cpu_s=0.01), _run("on", 11.0)]))["within"] is False
    # Runs marked out of the ratio (made on a busier machine, for the direct bound) leave the ratio alone.
    busy = [_run("on", 10.05), _run("on", 10.05), _run("on", 30.0, own_cpu_s=0.01, in_ratio=False)]
    assert verdict(_data(steady, busy))["ratio"] == pytest.approx(1.005)


def test_the_results_page_section_matches_a_synthetic_json() -> None:
    docs = micro_docs()
    data = _data([_run("off", 10.0), _run("off", 10.0)], [_run("on", 10.05), _run("on", 10.05, own_cpu_s=0.04)])
    text = "\n".join(docs.metrics_overhead_section(data))
    assert text.startswith("## What watching a run costs: metrics off vs on")
    assert "`bench/results/metrics_overhead.json` (`bench/micro/test_metrics_overhead.py`" in text
    assert "tests/test_metrics.py::test_metrics_code_is_imported_only_when_on" in text
    assert "| on 2 | 10.1 | 2.0 | 30 | 100 |" in text
    assert "| on 2 | 40 | 0 | 40 | 0.200% |" in text  # the direct bound: 0.04 s over the off runs' 20 s
    assert docs.metrics_verdict(data)["result"] in text
    assert "Measured directly" not in "\n".join(docs.metrics_overhead_section(_data([_run("off", 10.0)] * 2, [_run("on", 10.0)] * 2)))

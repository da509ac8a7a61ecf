"""deploy/grafana: the dashboard is an importable Grafana dashboard whose every query names
a metric the server or the agents really export (with the suffix its type gives it), and the
example scrape config names the jobs the dashboard reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from shared_protocol.metrics_endpoint import MetricsAddress, MetricsEndpointConfig
from shared_protocol.transport import TrafficStats

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "edgesplit-dashboard.json"
SCRAPE = ROOT / "deploy" / "grafana" / "prometheus.yml.example"


def exported_names() -> set[str]:
    """Every series name the server's and an agent's registries expose, as Prometheus sees it."""
    from cloud_server.metrics import ServerMetrics
    from edge_agent.metrics import AgentMetrics

    endpoint = MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0))
    transport = SimpleNamespace(inbound_progress=lambda topic: (0, 0), rejections=dict, connected=True, connect_count=1,
                                stats=TrafficStats())
    loop = SimpleNamespace(
        config=SimpleNamespace(run_id="r", rounds=2), method=SimpleNamespace(name="fedgkt", schedule="sync"),
        registry=SimpleNamespace(agents={}), transport=transport, topics=SimpleNamespace(up=lambda a: a), open_rounds={},
        recorder=SimpleNamespace(status="starting"), completed_round=0, rejected={},
    )
    names = set()
    for registry in (ServerMetrics(loop, endpoint).registry, AgentMetrics("r", "a", transport, endpoint).registry):  # type: ignore[arg-type]
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
            names |= {family.name + s for s in suffixes}
    return names


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    assert "id" not in dash  # an id would tie the import to one Grafana instance
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 20
    for p in dash["panels"]:
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_every_query_names_an_exported_metric() -> None:
    exported = exported_names()
    assert "edgesplit_wire_bytes_total" in exported and "edgesplit_round_duration_seconds_bucket" in exported
    assert "process_resident_memory_bytes" in exported
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\b((?:edgesplit|process)_[a-z0-9_]+)", e)}
    assert used - exported == set()
    assert len(used) >= 25
    # Every label the dashboard filters or groups by is one the series carry.
    for e in exprs:
        for label in re.findall(r"by \(([a-z_, ]+)\)", e):
            assert set(x.strip() for x in label.split(",")) <= {"agent", "direction", "reason", "le", "scope", "model", "phase"}, e


def test_scrape_config_names_the_dashboards_jobs() -> None:
    text = SCRAPE.read_text()
    jobs = set(re.findall(r"job_name: (\S+)", text))
    assert jobs == {"edgesplit-server", "edgesplit-agents"}
    dash_jobs = set(re.findall(r'job="([^"]+)"', DASHBOARD.read_text()))
    assert dash_jobs <= jobs

"""The status page and the live series rendered from a coordinator's state, without a
broker or a browser (tests/test_status_page_browser.py opens the page in Chromium during a
real run): an open round's progress and deadline, the agent table, escaping, the JSON."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cloud_server.rounds import HookClock
from shared_protocol.metrics_endpoint import MetricsAddress, MetricsEndpointConfig
from shared_protocol.transport import TrafficStats


def fake_loop(deadline_in_s: float = 60.0) -> SimpleNamespace:
    """What ServerMetrics reads of a coordinator: one joined agent, round 3 open."""
    agent = SimpleNamespace(online=True, dropped=False, status="training", round=3, rejections=2)
    rnd = SimpleNamespace(round=3, participants={"pi-1", "pi-2"}, done={"pi-2": object()}, missing=set(),
                          started_at=time.monotonic() - 5, deadline_at=time.monotonic() + deadline_in_s,
                          waiting_for=lambda: ["pi-1"])
    transport = SimpleNamespace(inbound_progress=lambda topic: (1, 4096), rejections=lambda: {"bad_frame": 1},
                                stats=TrafficStats())
    return SimpleNamespace(
        config=SimpleNamespace(run_id="r<1>", rounds=5), method=SimpleNamespace(name="fedgkt", schedule="sync"),
        registry=SimpleNamespace(agents={"pi-1": agent}), transport=transport, topics=SimpleNamespace(up=lambda a: a),
        open_rounds={3: rnd}, recorder=SimpleNamespace(status="running"), completed_round=2,
        rejected={"stale_message": 2}, hook_clock=HookClock(), out_dir=Path("/nonexistent-run-dir"),
    )


def samples(registry) -> dict:  # type: ignore[no-untyped-def]
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_open_round_progress_and_agents_in_the_series_and_the_page() -> None:
    from cloud_server.metrics import ServerMetrics
    from cloud_server.status_page import fragment, render_page

    metrics = ServerMetrics(fake_loop(), MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)))  # type: ignore[arg-type]
    got = samples(metrics.registry)
    base = (("method", "fedgkt"), ("run", "r<1>"))
    assert got[("edgesplit_round_in_progress", base)] == 3
    assert got[("edgesplit_round_completed", base)] == 2
    assert got[("edgesplit_round_agents", tuple(sorted((*base, ("round_state", "participants")))))] == 2
    assert got[("edgesplit_round_agents", tuple(sorted((*base, ("round_state", "waiting")))))] == 1
    assert 50 < got[("edgesplit_round_deadline_remaining_seconds", base)] <= 60
    assert got[("edgesplit_reassembly_bytes", tuple(sorted((*base, ("agent", "pi-1")))))] == 4096
    assert got[("edgesplit_agent_rejected_messages_total", tuple(sorted((*base, ("agent", "pi-1")))))] == 2
    assert got[("edgesplit_rejected_chunks_total", tuple(sorted((*base, ("reason", "bad_frame")))))] == 1
    # The deadline counts down between snapshots (a long server step does not freeze it).
    time.sleep(1.1)
    assert samples(metrics.registry)[("edgesplit_round_deadline_remaining_seconds", base)] < got[
        ("edgesplit_round_deadline_remaining_seconds", base)]
    page = render_page(metrics.state)
    assert 'id="round">3<' in page and 'data-agent="pi-1"' in page and "1 of 2 agents done" in page
    assert "waiting for pi-1" in page and "deadline in" in page
    assert "r&lt;1&gt;" in page and "r<1>" not in page  # escaped
    assert "<script>" in page and "http" not in page.split("<script>")[1]  # no external assets
    assert fragment(metrics.state) in page
    status = json.loads(json.dumps(metrics.state.to_json()))
    assert status["round_in_progress"] == 3 and status["open_rounds"][0]["waiting_for"] == ["pi-1"]
    assert math.isclose(status["open_rounds"][0]["open_s"], 6, abs_tol=2)


def test_an_async_round_has_no_deadline_series() -> None:
    from cloud_server.metrics import ServerMetrics
    from cloud_server.status_page import render_page

    loop = fake_loop(deadline_in_s=math.inf)
    metrics = ServerMetrics(loop, MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)))  # type: ignore[arg-type]
    assert not [k for k in samples(metrics.registry) if k[0] == "edgesplit_round_deadline_remaining_seconds"]
    assert "deadline in" not in render_page(metrics.state)


def test_the_page_says_what_the_server_is_working_on_while_it_works() -> None:
    from cloud_server.metrics import ServerMetrics
    from cloud_server.status_page import fragment

    loop = fake_loop()
    metrics = ServerMetrics(loop, MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)))  # type: ignore[arg-type]
    assert metrics.live().server_phase == "" and 'id="server-phase"' not in fragment(metrics.live())
    with loop.hook_clock.timing(3, "complete"):  # the coordinator thread is busy: its snapshot is not refreshed
        live = metrics.live()
        assert live.server_phase.startswith("working on the round's uploads (training, aggregating or distilling) (round 3, ")
        assert 'id="server-phase">server: working on the round' in fragment(live)
        assert json.loads(json.dumps(live.to_json()))["server_phase"] == live.server_phase
    assert metrics.live().server_phase == ""


def test_after_the_run_the_page_says_it_ended_and_until_when_it_stays_up() -> None:
    from cloud_server.metrics import ServerMetrics
    from cloud_server.status_page import fragment

    loop = fake_loop()
    metrics = ServerMetrics(loop, MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)))  # type: ignore[arg-type]
    assert 'id="ended"' not in fragment(metrics.live())  # running: nothing ended
    loop.recorder.status = "finished"
    loop.open_rounds = {}
    metrics.refresh(force=True)
    assert 'id="ended">the run has ended (finished): its <a href="summary.md">summary.md</a> and ' \
        '<a href="report.json">report.json</a></span>' in fragment(metrics.live())
    until = metrics.linger(90)
    assert until > time.time() + 80
    shown = fragment(metrics.live())
    assert f"this page stays up until {time.strftime('%H:%M:%S', time.localtime(until))}" in shown
    assert json.loads(json.dumps(metrics.live().to_json()))["serving_until"] == until


def test_the_page_serves_the_runs_report_files(tmp_path: Path) -> None:
    import urllib.request

    from cloud_server.metrics import ServerMetrics

    loop = fake_loop()
    loop.out_dir = tmp_path
    metrics = ServerMetrics(loop, MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)))  # type: ignore[arg-type]
    url = metrics.start()
    try:
        def get(name: str) -> tuple[bytes, str]:
            with urllib.request.urlopen(url.rstrip("/") + "/" + name, timeout=10) as reply:
                return reply.read(), reply.headers["Content-Type"]

        assert get("report.json") == (b"report.json is not written yet\n", "text/plain; charset=utf-8")
        (tmp_path / "report.json").write_text('{"status": "finished"}')
        (tmp_path / "summary.md").write_text("# run\n")
        assert get("report.json") == (b'{"status": "finished"}', "application/json")
        assert get("summary.md") == (b"# run\n", "text/markdown; charset=utf-8")
    finally:
        metrics.close()

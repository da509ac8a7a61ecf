"""The live view: the server's and the agents' Prometheus endpoints scraped during and after
a 2-agent, 2-round run over a real mosquitto and parsed with prometheus_client's text
parser; the endpoint's refusal of a non-loopback bind without credentials, and basic auth
over TLS with them; and nothing of it imported when it is off."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cloud_server.config import ServerConfig
from edge_agent.config import EdgeConfig
from shared_protocol.metrics_endpoint import MetricsAddress, MetricsEndpointConfig

from fedhelpers import ROOT, agent_config, child_pythonpath, server_config, write_agent_toml, write_server_toml
from metricshelpers import HeldFederation, scrape, total, value, wait_for

@pytest.mark.broker
@pytest.mark.slow
def test_server_and_agent_metrics_during_and_after_a_run(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fed = HeldFederation(tmp_path, mosquitto.url, "metrics").start()
    try:
        url = fed.server.metrics.url + "metrics"
        run = {"run": "metrics", "method": "fedgkt"}
        # During: round 1 is open, both agents are its participants, none is done yet.
        wait_for(lambda: value(scrape(url), "edgesplit_round_in_progress", **run) == 1, 120, "round 1 to open")
        during = scrape(url)
        assert value(during, "edgesplit_round_agents", round_state="participants", **run) == 2
        assert value(during, "edgesplit_round_agents", round_state="done", **run) == 0
        assert 0 < value(during, "edgesplit_round_deadline_remaining_seconds", **run) <= 120
        assert value(during, "edgesplit_agents", agent_state="registered", **run) == 2
        assert value(during, "edgesplit_agent_online", agent="agent-1", **run) == 1
        assert value(during, "edgesplit_rounds_planned", **run) == 2
        assert total(during, "edgesplit_rounds_total") == 0
        assert value(during, "edgesplit_run_info", status="running", **run) == 1
        agent_during = scrape(fed.agents[0].metrics.url)
        assert value(agent_during, "edgesplit_edge_connected", agent="agent-0", run="metrics") == 1
        assert value(agent_during, "edgesplit_edge_reconnects_total", agent="agent-0") == 0
        fed.release()
        # Agents' endpoints between rounds 1 and 2 show round 1's costs.
        wait_for(lambda: total(scrape(fed.agents[1].metrics.url), "edgesplit_edge_rounds_total") >= 1, 300, "agent-1's round 1")
        report = fed.join()
        after = scrape(url)
        agent_after = [scrape(a.metrics.url) for a in fed.agents]
        page = urllib.request.urlopen(fed.server.metrics.url, timeout=10).read().decode()
        status = json.loads(urllib.request.urlopen(fed.server.metrics.url + "status.json", timeout=10).read())
    finally:
        fed.close()
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    assert on_disk["status"] == "finished" and report["status"] == "finished"
    totals = on_disk["totals"]
    # Rounds and their outcome, duration, progress.
    assert value(after, "edgesplit_rounds_total", status="ok", **run) == 2
    assert value(after, "edgesplit_round_duration_seconds_count", **run) == 2
    assert value(after, "edgesplit_round_duration_seconds_sum", **run) == pytest.approx(
        sum(r["time_s"]["round"] for r in on_disk["rounds"]), rel=1e-6)
    assert value(after, "edgesplit_round_completed", **run) == 2
    assert value(after, "edgesplit_round_in_progress", **run) == 0
    assert value(after, "edgesplit_run_info", status="finished", **run) == 1
    # Bytes per agent and direction add up to report.json's totals, training's and evaluation's.
    for direction in ("up", "down"):
        for kind in ("wire", "payload"):
            assert total(after, f"edgesplit_{kind}_bytes_total", direction=direction, traffic="round") == totals[f"{direction}_{kind}"]
            assert total(after, f"edgesplit_{kind}_bytes_total", direction=direction, traffic="evaluation") == \
                totals["eval_bytes"][f"{direction}_{kind}"]
        assert total(after, "edgesplit_wire_bytes_total", direction=direction, traffic="round", agent="agent-0") > 0
    assert total(after, "edgesplit_wire_bytes_total", traffic="round", agent="unregistered") == 0
    # Accuracy of the last evaluated round, labelled by scope and model.
    last = on_disk["rounds"][-1]
    assert value(after, "edgesplit_evaluated_round", **run) == 2
    assert value(after, "edgesplit_accuracy_ratio", scope="global", model="model", **run) == pytest.approx(last["accuracy"])
    assert value(after, "edgesplit_accuracy_ratio", scope="local", model="model", **run) == pytest.approx(last["local_accuracy"])
    # Per-agent last-round costs as the server received them.
    for agent in ("agent-0", "agent-1"):
        costs = last["per_agent"][agent]
        assert value(after, "edgesplit_agent_last_round", agent=agent, **run) == 2
        assert value(after, "edgesplit_agent_last_round_train_flops", agent=agent, **run) == costs["train_flops"]
        assert value(after, "edgesplit_agent_last_round_peak_rss_bytes", agent=agent, **run) == costs["peak_rss_bytes"]
        assert value(after, "edgesplit_agent_last_round_phase_seconds", agent=agent, phase="idle", **run) == pytest.approx(costs["idle_s"])
        assert value(after, "edgesplit_agent_train_flops_total", agent=agent, **run) == sum(
            r["per_agent"][agent]["train_flops"] for r in on_disk["rounds"])
    assert total(after, "edgesplit_rejected_messages_total") == totals["rejected_messages"]
    assert value(after, "process_resident_memory_bytes") > 0
    # What watching cost the server: its hooks ran (every message's bytes), every scrape was counted
    # (the three scrapes of the server's /metrics so far, this one included), both parts in CPU seconds.
    assert value(after, "edgesplit_metrics_cpu_seconds_total", part="update", **run) > 0
    assert value(after, "edgesplit_metrics_cpu_seconds_total", part="serve", **run) > 0
    assert value(after, "edgesplit_metrics_requests_total", **run) >= 3
    # Each agent's own endpoint: its round costs, as it sent them in its round_end.
    for agent, samples in zip(("agent-0", "agent-1"), agent_after):
        costs = last["per_agent"][agent]
        labels = {"run": "metrics", "agent": agent, "method": "fedgkt"}
        assert value(samples, "edgesplit_edge_rounds_total", **labels) == 2
        assert value(samples, "edgesplit_edge_last_round", **labels) == 2
        assert value(samples, "edgesplit_edge_last_round_train_flops", **labels) == costs["train_flops"]
        assert value(samples, "edgesplit_edge_last_round_samples", **labels) == costs["samples"]
        assert value(samples, "edgesplit_edge_last_round_peak_rss_bytes", **labels) == costs["peak_rss_bytes"]
        for phase in ("compute", "encode", "network", "idle"):
            assert value(samples, "edgesplit_edge_last_round_phase_seconds", phase=phase, **labels) == pytest.approx(costs[f"{phase}_s"])
        assert value(samples, "edgesplit_edge_last_round_wire_bytes", direction="up", **labels) == costs["wire_bytes_up"]
        assert value(samples, "edgesplit_edge_phase_seconds_total", phase="compute", **labels) > costs["compute_s"]
        assert value(samples, "edgesplit_edge_wire_bytes_total", direction="up", agent=agent) > 0
        assert value(samples, "edgesplit_metrics_cpu_seconds_total", part="update", run="metrics", agent=agent) > 0
        assert value(samples, "edgesplit_metrics_requests_total", run="metrics", agent=agent) >= 2  # during and after
    # The status page and its JSON name every agent.
    assert 'id="agents"' in page and 'data-agent="agent-0"' in page and 'data-agent="agent-1"' in page
    assert status["completed_round"] == 2 and sorted(status["agents"]) == ["agent-0", "agent-1"]
    assert [p["round"] for p in status["history"]] == [1, 2]


# -- binding ------------------------------------------------------------------------------ #


def test_non_loopback_bind_is_refused_without_credentials(tmp_path: Path) -> None:
    for address in ("0.0.0.0:9464", "192.0.2.7:9464", "[::]:9464", "metrics.example.org:9464"):
        with pytest.raises(ValueError, match=r"\[server\] metrics_address .* is not a loopback address.*metrics_password_file"):
            ServerConfig(metrics_address=address)
        with pytest.raises(ValueError, match=r"\[agent\] metrics_password_file, metrics_cert_file, metrics_key_file"):
            EdgeConfig(agent_id="a", metrics_address=address)
    with pytest.raises(ValueError, match="metrics_cert_file, metrics_key_file"):  # a password alone is not enough
        ServerConfig(metrics_address="0.0.0.0:9464", metrics_password_file="pw")
    for address in ("127.0.0.1:9464", "localhost:0", "[::1]:9464", "127.0.0.2:1"):
        assert ServerConfig(metrics_address=address).metrics_endpoint() is not None
    assert ServerConfig().metrics_endpoint() is None
    with pytest.raises(ValueError, match="HOST:PORT"):
        MetricsAddress.parse("9464")
    # The command line says the same and starts nothing.
    toml = write_server_toml(tmp_path / "server.toml", server_config(tmp_path))
    result = subprocess.run([sys.executable, "-m", "cloud_server.cli", "run", "--config", str(toml), "--metrics", "0.0.0.0:0"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=child_pythonpath()))
    assert result.returncode == 2 and "metrics_password_file" in result.stderr and "127.0.0.1:0" in result.stderr, result.stderr
    agent_toml = write_agent_toml(tmp_path / "agent.toml", agent_config("t1", 0, 1))
    result = subprocess.run([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(agent_toml), "--metrics", "0.0.0.0:0"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=child_pythonpath()))
    assert result.returncode == 2 and "[agent] metrics_password_file" in result.stderr, result.stderr


def test_non_loopback_bind_with_credentials_serves_tls_and_basic_auth(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl on PATH (apt-get install openssl) to make a test certificate")
    from prometheus_client import CollectorRegistry, Counter

    from shared_protocol.metrics_http import MetricsServer

    cert, key, password = tmp_path / "m.crt", tmp_path / "m.key", tmp_path / "m.password"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    password.write_text("s3cret\n")
    registry = CollectorRegistry()
    Counter("edgesplit_probe", "A probe.", registry=registry).inc(3)
    endpoint = MetricsEndpointConfig(MetricsAddress("0.0.0.0", 0), password_file=str(password), cert_file=str(cert),
                                     key_file=str(key))
    server = MetricsServer(endpoint, registry).start()
    context = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{server.port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10, context=context)
        assert refused.value.code == 401
        wrong = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"edgesplit:nope").decode()})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong, timeout=10, context=context)
        right = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"edgesplit:s3cret").decode()})
        text = urllib.request.urlopen(right, timeout=10, context=context).read().decode()
        assert "edgesplit_probe_total 3.0" in text
        with pytest.raises(OSError):  # plain HTTP to the TLS port (URLError or a reset connection)
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
    finally:
        server.close()


def test_a_port_in_use_names_the_key_to_change() -> None:
    from prometheus_client import CollectorRegistry

    from shared_protocol.metrics_endpoint import MetricsEndpointError
    from shared_protocol.metrics_http import MetricsServer

    first = MetricsServer(MetricsEndpointConfig(MetricsAddress("127.0.0.1", 0)), CollectorRegistry()).start()
    try:
        with pytest.raises(MetricsEndpointError, match=r"--metrics or \[server\] metrics_address"):
            MetricsServer(MetricsEndpointConfig(MetricsAddress("127.0.0.1", first.port)), CollectorRegistry()).start()
    finally:
        first.close()


# -- off ---------------------------------------------------------------------------------- #

_OFF_SCRIPT = textwrap.dedent("""
    import sys
    from dataclasses import replace
    from pathlib import Path
    from fedhelpers import agent_config, in_memory_federation, server_config
    on = sys.argv[2] == "on"
    cfg = server_config(Path(sys.argv[1]), run_id="off", agents=1, rounds=1,
                        metrics_address="127.0.0.1:0" if on else None)
    agents = [replace(agent_config("off", 0, 1), metrics_address="127.0.0.1:0" if on else None)]
    fed = in_memory_federation(cfg, agents)
    if not on:  # a whole run, every hook passed
        assert fed.start().join(300)["status"] == "finished"
    loaded = sorted(m for m in sys.modules if m.startswith("prometheus_client") or m in (
        "cloud_server.metrics", "cloud_server.status_page", "edge_agent.metrics", "shared_protocol.metrics_http"))
    print("LOADED", ",".join(loaded))
""")


@pytest.mark.parametrize("switch", ["off", "on"])
def test_metrics_code_is_imported_only_when_on(tmp_path: Path, switch: str) -> None:
    result = subprocess.run([sys.executable, "-c", _OFF_SCRIPT, str(tmp_path), switch], capture_output=True, text=True,
                            timeout=400, cwd=ROOT, env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT / "tests"), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = [line for line in result.stdout.splitlines() if line.startswith("LOADED")][-1].split(" ", 1)[1]
    if switch == "off":
        assert loaded == "", loaded
    else:  # the check sees the modules when they are loaded
        for module in ("cloud_server.metrics", "edge_agent.metrics", "shared_protocol.metrics_http", "prometheus_client"):
            assert module in loaded.split(","), loaded


# -- edgesplit local --metrics ----------------------------------------------------------- #


@pytest.mark.broker
@pytest.mark.slow
def test_edgesplit_local_metrics_prints_the_page_and_every_endpoint_answers(tmp_path: Path) -> None:
    import queue
    import re
    import threading
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloud_server.launcher", "local", "--agents", "2", "--rounds", "2", "--dataset", "synthetic",
         "--partition", "iid", "--train-samples", "320", "--test-samples", "64", "--out", str(out), "--run-id", "cli-metrics",
         "--metrics"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=child_pythonpath()),
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    scraped: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 500
        banner = None
        while banner is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            banner = seen[-1] if seen[-1].startswith("edgesplit: status page on ") else None
        assert banner is not None, "".join(seen)
        urls = re.findall(r"(http://127\.0\.0\.1:\d+/)(?:metrics)?", banner)
        page, agent_urls = urls[0], [u + "metrics" for u in re.findall(r"agent-\d (http://127\.0\.0\.1:\d+/)metrics", banner)]
        assert len(agent_urls) == 2 and len(set(urls)) == 3, banner
        # Scrape each endpoint while the run goes (agents serve theirs once their data is loaded).
        while len(scraped) < 3 and time.monotonic() < deadline and proc.poll() is None:
            for url in (page + "metrics", *agent_urls):
                if url not in scraped:
                    try:
                        scraped[url] = scrape(url, timeout_s=5)
                    except OSError:
                        pass
            time.sleep(0.3)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert len(scraped) == 3, (sorted(scraped), "".join(seen)[-2000:])
    assert value(scraped[page + "metrics"], "edgesplit_run_info", run="cli-metrics", method="fedgkt") == 1
    for i, url in enumerate(agent_urls):
        assert value(scraped[url], "edgesplit_edge_reconnects_total", run="cli-metrics", agent=f"agent-{i}") == 0
    assert json.loads((out / "report.json").read_text())["status"] == "finished"

"""A FedGKT round where the agents live in a network namespace behind a 10 Mbit/s
token-bucket link, reach the broker through a proxy adding 50 ms each way, and
have their connection cut once in the middle of an upload."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhelpers import ROOT, agent_config, child_pythonpath, mqtt_federation, server_config, write_agent_toml
from netlab import DelayProxy, Namespace, NetlabUnavailable

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_fedgkt_round_over_a_slow_cut_link(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    try:
        lab = Namespace(rate="10mbit").__enter__()
    except NetlabUnavailable as exc:
        pytest.skip(f"this kernel or user cannot create network namespaces: {exc}")
    proxy = DelayProxy(lab.host_ip, (mosquitto.host, mosquitto.port), delay_s=0.05, cut_after_bytes=1_000_000)
    procs = []
    try:
        cfg = server_config(tmp_path, run_id="slow", rounds=1, round_deadline_s=240.0)
        fed = mqtt_federation(cfg, [], mosquitto.url)
        for i in range(2):
            agent_toml = write_agent_toml(tmp_path / f"agent-{i}.toml", agent_config("slow", i, 2, broker_url=f"mqtt://{lab.host_ip}:{proxy.port}"))
            log = open(tmp_path / f"agent-{i}.log", "w")
            procs.append(subprocess.Popen(lab.command("env", f"PYTHONPATH={child_pythonpath()}", "OMP_NUM_THREADS=1", sys.executable,
                                                      "-m", "edge_agent.cli", "run", "--config", str(agent_toml)),
                                          stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        started = time.monotonic()
        report = fed.start().join(400)
        elapsed = time.monotonic() - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        proxy.close()
        lab.__exit__()
    (round1,) = report["rounds"]
    assert round1["status"] == "ok" and round1["completed"] == ["agent-0", "agent-1"]
    assert round1["samples"] == 160
    assert proxy.cuts == 1  # the connection really was cut mid-upload ...
    reconnects = sum((tmp_path / f"agent-{i}.log").read_text().count("reconnect") for i in range(2))
    assert reconnects >= 1  # ... and the agent came back
    # What the server counted arriving (training's and evaluation's) is what went through
    # the shaped link, give or take the MQTT control packets and chunks resent after the cut.
    up_wire = round1["bytes"]["up_wire"] + round1["evaluation"]["bytes"]["up_wire"]
    assert up_wire <= proxy.bytes_up <= up_wire * 1.3 + 200_000
    # 10 Mbit/s bounds the upload from below.
    assert elapsed >= up_wire * 8 / 10e6
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    assert on_disk["rounds"][0]["bytes"] == round1["bytes"]

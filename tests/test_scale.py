"""Many agents: 64 simulated agents (one process, 64 MQTT clients) through a real
mosquitto for 2 FedGKT rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_server.report import validate_report
from edge_agent.simulate import SimulationConfig, build_agents

from fedhelpers import Federation, agent_config, mqtt_federation, server_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_64_simulated_agents_two_rounds(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    n = 64
    cfg = server_config(tmp_path, run_id="scale", agents=n, rounds=2, round_deadline_s=400.0, registration_timeout_s=120.0,
                        method_config={"upload_batch_samples": 64})
    base = agent_config("scale", 0, n, broker_url=mosquitto.url, train_samples=n * 8, test_samples=n * 4)
    agents = build_agents(SimulationConfig(base, n))
    assert len({a.config.agent_id for a in agents}) == n
    assert sum(len(a.train) for a in agents) == n * 8  # one dataset, partitioned once
    fed = mqtt_federation(cfg, [], mosquitto.url)
    report = Federation(fed.coordinator, agents).start().join(900)
    validate_report(report)
    assert report["status"] == "finished"
    assert len(report["agents"]) == n
    for record in report["rounds"]:
        assert record["status"] == "ok"
        assert len(record["completed"]) == n and record["missing"] == []
        assert record["samples"] == n * 8

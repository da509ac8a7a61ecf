"""A stopped agent exits promptly, also when its broker is already gone."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from edge_agent.agent import EdgeAgent
from fedhelpers import agent_config


@pytest.mark.broker
def test_an_agent_stops_within_seconds_after_its_broker_died(tmp_path: Path, mosquitto) -> None:  # type: ignore[no-untyped-def]
    agent = EdgeAgent(agent_config("shutdown", 0, 1, broker_url=mosquitto.url))
    runner = threading.Thread(target=agent.run, name="agent", daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while agent.transport.connect_count < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent.transport.connect_count >= 1, "the agent never connected"
    time.sleep(1.0)  # its hello and online status are out
    mosquitto.stop()  # the broker goes first, as when a launcher is killed
    time.sleep(1.0)
    started = time.monotonic()
    agent.stop()  # what SIGTERM does
    runner.join(30)
    assert not runner.is_alive(), "the agent was still waiting 30 s after stop()"
    assert time.monotonic() - started < 15

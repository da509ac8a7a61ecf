"""Restarts say what happens: a resume of a run that is over says so and exits without
waiting for agents; a run directory that holds a run is not reused silently; the key
tool's --agents / --agent-ids confusion is answered with a pointer."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from edge_agent.agent import EdgeAgent

from fedhelpers import Federation, agent_config, child_pythonpath, in_memory_federation, make_server, server_config, write_server_toml

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)  # generous: a loaded 2-core machine


@pytest.mark.slow
def test_resume_of_a_finished_run_says_so_and_returns_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = server_config(tmp_path, run_id="over", rounds=1, registration_timeout_s=60)
    first = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start().join(240)
    assert first["status"] == "finished"
    again = make_server(cfg, InMemoryTransport(InMemoryBroker(), "server"))
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cloud_server"):
        report = again.run(resume=True)
    assert time.monotonic() - started < 20  # not the 60 s registration wait
    assert report["status"] == "finished" and len(report["rounds"]) == 1
    assert "already over" in caplog.text and "nothing to resume" in caplog.text
    # With more rounds to go the resume goes on, and the report says where it resumed.
    more = make_server(replace(cfg, rounds=2), InMemoryTransport(InMemoryBroker(), "server"))
    more.load_checkpoint()
    assert more.report.resumed[-1]["after_round"] == 1 and more._finished_on_disk() is None
    assert more.report.totals.wall_time_s == first["totals"]["wall_time_s"]  # carried over, not restarted at 0


def test_a_run_directory_holding_a_run_is_refused_without_resume_or_force(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, run_id="held", broker_url="mqtt://127.0.0.1:9", registration_timeout_s=1)
    path = write_server_toml(tmp_path / "server.toml", cfg)
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "report.json").write_text('{"run_id": "held", "status": "finished", "rounds": [{}, {}]}')
    refused = _cli("cloud_server.cli", "run", "--config", str(path), "--no-progress", cwd=tmp_path)
    assert refused.returncode == 2
    assert "already holds run 'held' (finished, 2 round(s)" in refused.stderr
    assert "--resume" in refused.stderr and "--force" in refused.stderr
    forced = _cli("cloud_server.cli", "run", "--config", str(path), "--no-progress", "--force", cwd=tmp_path)
    assert "already holds" not in forced.stderr and "--force: starting a new run" in forced.stderr
    assert "127.0.0.1:9" in forced.stderr  # it went on, to the (absent) broker


def test_keys_init_agents_with_ids_points_at_agent_ids(tmp_path: Path) -> None:
    result = _cli("cloud_server.launcher", "keys", "init", "--agents", "pi-1,pi-2", "--out", str(tmp_path / "k"), cwd=ROOT)
    assert result.returncode == 2
    assert "--agent-ids pi-1,pi-2" in result.stderr and "takes a number" in result.stderr


@pytest.mark.slow
def test_a_new_run_with_the_same_run_id_does_not_restore_the_agents_earlier_state(tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    """keys init names every run "default": a second run (another out_dir) once restored each
    agent's model of the first and logged "round 1 again: this agent finished it already"."""
    states = [tmp_path / f"state-{i}" for i in range(2)]

    def agents() -> list:
        return [agent_config("same", i, 2, state_dir=str(states[i])) for i in range(2)]

    first_cfg = server_config(tmp_path / "first", run_id="same", rounds=1)
    first = in_memory_federation(first_cfg, agents()).start().join(240)
    assert first["status"] == "finished"
    assert json.loads((states[0] / "agent-0.json").read_text())["last_round_done"] == 1
    # A resumed run is the same run: its agents keep their state.
    resumed = make_server(replace(first_cfg, rounds=2), InMemoryTransport(InMemoryBroker(), "server"))
    resumed.load_checkpoint()
    assert resumed.welcome_settings()["run_started_at"] == first["started_at"]

    second_cfg = server_config(tmp_path / "second", run_id="same", rounds=1)
    with caplog.at_level(logging.INFO, logger="edge_agent"):
        second = in_memory_federation(second_cfg, agents()).start().join(240)
    assert second["status"] == "finished" and second["started_at"] != first["started_at"]
    assert second["totals"]["rejected_messages"] == 0, second["totals"]
    assert "restored local state" not in caplog.text and "round 1 again" not in caplog.text
    assert caplog.text.count("it is from an earlier run same") == 2, caplog.text


class _RepeatsItsHello(EdgeAgent):
    """Answers a discover queued in its MQTT session from before it started, as a restarted
    agent with a persistent session does: a second hello on the same connection, arriving at
    the server after its round 1 started."""

    def _on_round_start(self, msg):  # type: ignore[no-untyped-def]
        if msg.round == 1 and not getattr(self, "_repeated", False):
            self._repeated = True
            self.hello()
        super()._on_round_start(msg)


@pytest.mark.slow
def test_a_hello_repeated_on_the_same_connection_does_not_restart_the_agents_round(tmp_path: Path,
                                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The walkthrough's first run: a refused agent's session kept the server's discover; its next
    instance answered it after its own hello, and the server restarted that agent's round 1, which
    it then did twice (its first round_end rejected as stale)."""
    cfg = server_config(tmp_path, run_id="dup", rounds=1)
    broker = InMemoryBroker()
    coord = make_server(cfg, InMemoryTransport(broker, "server"))
    configs = [agent_config(cfg.run_id, i, 2) for i in range(2)]
    agents = [_RepeatsItsHello(configs[0], transport=InMemoryTransport(broker, configs[0].agent_id)),
              EdgeAgent(configs[1], transport=InMemoryTransport(broker, configs[1].agent_id))]
    with caplog.at_level(logging.INFO):
        report = Federation(coord, agents).start().join(240)
    assert report["status"] == "finished" and sorted(report["rounds"][0]["completed"]) == ["agent-0", "agent-1"]
    assert "round 1 again" not in caplog.text  # agent-0 did its round once
    assert report["totals"]["rejected_messages"] == 0, report["totals"]  # no stale round_end
    assert "said hello again on the same connection; its round 1 goes on" in caplog.text

"""The command lines a user types: the launcher end to end, report re-rendering,
config errors; and coordinator policies (allow-list, target accuracy)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_server.report import validate_report
from shared_protocol.messages import Hello, Welcome, decode_message, encode_message
from shared_protocol.topics import Topics
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import ROOT, agent_config, in_memory_federation, make_server, server_config

PY = sys.executable


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain ``text`` (as ``pgrep -f`` matches)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if text in cmdline:
            found.append(cmdline)
    return found


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_edgesplit_local_runs_a_federation_of_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The directory holds a previous, larger run: its files are replaced, not mixed with this run's.
    (out / "logs").mkdir(parents=True)
    (out / "checkpoint").mkdir()
    (out / "logs" / "agent-7.log").write_text("an old run's agent\n")
    (out / "checkpoint" / "coordinator.json").write_text("{}")
    (out / "report.json").write_text("{}")
    (out / "notes.txt").write_text("the user's own file\n")
    result = run(
        "cloud_server.launcher", "local", "--agents", "2", "--rounds", "2", "--dataset", "synthetic", "--partition", "iid",
        "--train-samples", "128", "--test-samples", "64", "--out", str(out), "--run-id", "cli-smoke",
        "--audit", "--audit-steps", "3", "--low-memory", "--link-mbit", "1", "--device-memory", "1MB",
        "--metrics", "127.0.0.1:0", "--set", "server.metrics_linger_s=1",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "held a previous run; replaced" in result.stderr
    assert not (out / "logs" / "agent-7.log").exists() and (out / "notes.txt").exists()
    assert "round 1/2" in result.stdout and "round 2/2" in result.stdout
    assert "# EdgeSplit run `cli-smoke`" in result.stdout  # the summary is printed
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and len(report["rounds"]) == 2
    assert sorted(report["agents"]) == ["agent-0", "agent-1"]
    # --low-memory: every agent ran in the Pi's low-memory mode and said so in its hello.
    for info in report["agents"].values():
        assert info["memory"]["micro_batch_samples"] == 16 and info["memory"]["shard_on_disk"] is True
    # Per device, against the stated link and device: the console's lines after the run's last
    # line, the summary's table, and the memory warning naming the setting that lowers it.
    assert "per device, per round at 1 Mbit/s: up " in result.stdout and "per device, peak RSS: " in result.stdout
    assert "warning: agent agent-0: peak RSS" in result.stdout and "lower [memory] micro_batch_samples (now 16" in result.stdout
    assert "## Per device" in result.stdout and "**Memory warning**: agent agent-1: peak RSS" in result.stdout
    assert report["per_device"]["link_mbit"] == 1.0 and report["per_device"]["device_memory_bytes"] == 10**6
    # --metrics with metrics_linger_s: the console says the page stays up after the run, and until when.
    assert "the run has ended; serving the final metrics and the status page (http://127.0.0.1:" in result.stdout
    # --audit: the audit ran when the run ended, and the printed summary already shows it.
    assert "edgesplit audit: best white_box_inversion" in result.stdout
    assert report["leakage"]["strongest"] is not None and (out / "leakage.png").exists()
    assert result.stdout.index("edgesplit audit: wrote") < result.stdout.index("## What the server can reconstruct")
    for name in ("server.log", "agent-0.log", "agent-1.log"):
        assert (out / "logs" / name).exists()
    # Every process is gone: nothing is left listening or running. (psutil, a dependency, rather
    # than pgrep: procps is not on every machine, e.g. a slim GPU image.)
    assert processes_mentioning(str(out)) == []

    # cloud-server report re-renders from report.json alone.
    for name in ("summary.md", "rounds.csv", "accuracy_vs_round.png"):
        (out / name).unlink()
    rendered = run("cloud_server.cli", "report", str(out))
    assert rendered.returncode == 0, rendered.stderr
    assert (out / "summary.md").exists() and (out / "accuracy_vs_round.png").exists()


def test_edgesplit_local_stopped_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    # Started as a script's background job, whose Ctrl-C is ignored: SIGTERM still stops the broker,
    # the server and the agents rather than orphaning them.
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cloud_server.launcher", "local", "--agents", "1", "--rounds", "50", "--dataset", "synthetic",
         "--partition", "iid", "--train-samples", "64", "--test-samples", "32", "--out", str(out), "--run-id", "sigterm"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    for line in proc.stdout:  # the federation is up: a round finished
        if line.startswith("round 1/50"):
            break
    assert len(processes_mentioning(str(out))) >= 3  # the server, the agent and the broker at least
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert "interrupted; stopping processes" in rest and proc.returncode == 130
    deadline = time.monotonic() + 30
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(out)) == []


def test_config_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "server.toml"
    bad.write_text('[server]\nrun_id = "x"\nrounds = 0\n')
    result = run("cloud_server.cli", "run", "--config", str(bad))
    assert result.returncode == 2 and "rounds" in result.stderr
    bad.write_text('[server]\nrun_idd = "x"\n')
    result = run("cloud_server.cli", "run", "--config", str(bad))
    assert result.returncode == 2 and "run_idd" in result.stderr
    agent = tmp_path / "agent.toml"
    agent.write_text('[agent]\nagent_id = "bad/id"\n')
    result = run("edge_agent.cli", "run", "--config", str(agent))
    assert result.returncode == 2 and "agent id" in result.stderr
    missing = run("cloud_server.cli", "report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "report.json" in missing.stderr


def test_allow_list_refuses_unknown_agents(tmp_path: Path) -> None:
    broker = InMemoryBroker()
    cfg = server_config(tmp_path, run_id="allow", agents=1, allow_list=("agent-0",))
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    topics = Topics("allow")
    stranger = InMemoryTransport(broker, "agent-9")
    stranger.subscribe(topics.down("agent-9"))
    stranger.connect()
    coordinator.transport.subscribe(topics.up_any)
    coordinator.transport.connect()
    hello = Hello(run="allow", round=0, sender="agent-9", cpu_model="x", arch="x", cores=1, memory_bytes=1, backend="torch",
                  num_samples=1, class_counts=[1], methods=["fedgkt"])
    stranger.publish(topics.up("agent-9"), encode_message(hello))
    coordinator.pump(1.0)
    reply = decode_message(stranger.receive(1.0).payload)
    assert isinstance(reply, Welcome) and not reply.accepted and "allow-list" in reply.reason
    assert "agent-9" not in coordinator.agents
    assert coordinator.rejected["unknown_sender"] == 1


def test_run_stops_at_target_accuracy(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, run_id="target", rounds=5, target_accuracy=0.01)
    report = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start().join()
    assert report["status"] == "stopped_target"
    assert len(report["rounds"]) == 1

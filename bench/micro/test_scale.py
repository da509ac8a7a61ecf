"""FedGKT with many agents (the shape of the paper's Table 4): 8 to 128 simulated agents sharing
one Fashion-MNIST subset, through a real mosquitto. The server runs in this process, the agents
in one ``edge-agent simulate`` process (one MQTT client each, compute shared), one fresh broker
per agent count; the timed figure is the whole run. Per agent count, in ``extra_info``: round
times, server training seconds, accuracy, messages and bytes per round, and the peak RSS of the
server (its high-water mark reset before the run, else VmRSS sampled), the agents' process and
the broker.

    make bench-micro MICRO=scale     # or: pytest bench/micro/test_scale.py [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fresh import status_bytes

ROOT = Path(__file__).resolve().parents[2]
#: (training samples, test samples) split over the agents, and rounds; full and --quick. The
#: global set is the test samples' number of images (every agent scores its ResNet-8 on it).
SIZES = {False: (2048, 512, 2), True: (256, 128, 1)}
DATASET = "fashion-mnist"
METHOD_CONFIG = {"upload_batch_samples": 64, "server_batch_size": 64}


def one_run(agents: int, per_agent: int, test_per_agent: int, rounds: int, work: Path, eval_samples: int) -> dict[str, Any]:
    from cloud_server.assemble import build_server
    from cloud_server.config import ServerConfig
    from edge_agent.costs import reset_peak_rss
    from shared_protocol.local_broker import LocalBroker
    from shared_protocol.tomlio import write_toml

    broker = LocalBroker(work / "broker").start()  # the local runs' mosquitto settings
    run_id = f"scale{agents}"
    write_toml(work / "agent.toml", {
        "agent": {"agent_id": "sim", "run_id": run_id, "broker_url": broker.url},
        "data": {"dataset": DATASET, "partition": "iid", "num_agents": agents, "train_samples": agents * per_agent,
                 "test_samples": agents * test_per_agent, "seed": 0}})
    coordinator = build_server(ServerConfig(run_id=run_id, broker_url=broker.url, out_dir=str(work / run_id), expected_agents=agents,
                                            rounds=rounds, round_deadline_s=1800, registration_timeout_s=600, dataset=DATASET,
                                            eval_samples=eval_samples,
                                            progress=False, method_config=METHOD_CONFIG), device="cpu")
    sim = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "simulate", "--config", str(work / "agent.toml"), "--agents", str(agents)],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(work / "simulate.log", "w"), env=dict(os.environ, OMP_NUM_THREADS="1"))
    exact = reset_peak_rss()
    peaks = {"agents": 0, "server": status_bytes("VmRSS")}

    def watch() -> None:
        while sim.poll() is None:
            peaks["agents"] = max(peaks["agents"], status_bytes("VmHWM", sim.pid))
            peaks["server"] = max(peaks["server"], status_bytes("VmRSS"))
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    try:
        report = coordinator.run()
    finally:
        broker_peak = status_bytes("VmHWM", broker.proc.pid) if broker.proc is not None else 0
        sim.wait(120)
        broker.stop()
    rounds_out, connection = report["rounds"], report["totals"]["server_connection"]
    return {
        "agents": agents, "samples_per_agent": per_agent, "test_samples_per_agent": test_per_agent, "rounds": rounds,
        "eval_samples": eval_samples,
        "status": report["status"], "round_status": [r["status"] for r in rounds_out],
        "round_s": [r["time_s"]["round"] for r in rounds_out], "server_train_s": [r["time_s"]["server_train"] for r in rounds_out],
        "accuracy": [r["accuracy"] for r in rounds_out], "edge_accuracy": [r["edge_accuracy"] for r in rounds_out],
        "up_wire_bytes_per_round": [r["bytes"]["up_wire"] for r in rounds_out],
        "down_wire_bytes_per_round": [r["bytes"]["down_wire"] for r in rounds_out],
        "completed_per_round": [len(r["completed"]) for r in rounds_out],
        # The server connection's messages over the run (registration and status included), per round.
        "messages_per_round": (connection["messages_in"] + connection["messages_out"]) / max(1, len(rounds_out)),
        "server_peak_rss_bytes": status_bytes("VmHWM") if exact else peaks["server"],
        "server_peak_rss_method": "VmHWM reset before the run" if exact else "VmRSS sampled every 0.2 s",
        "agents_process_peak_rss_bytes": peaks["agents"], "broker_peak_rss_bytes": broker_peak,
    }


@pytest.mark.parametrize("agents", [8, 16, 64, 128])
def test_agents(benchmark: Any, quick: bool, tmp_path: Path, agents: int) -> None:
    train, test, rounds = SIZES[quick]
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(one_run(agents, train // agents, max(1, test // agents), rounds, tmp_path, test)),
                       rounds=1, iterations=1)
    benchmark.extra_info.update(dataset=DATASET, partition="iid", edge_model="resnet8", server_model="resnet55_server",
                                **METHOD_CONFIG, **result)
    assert result["status"] == "finished", result["round_status"]

"""FedGKT with many agents (the shape of the paper's Table 4): 8, 16, 64 and 128
simulated agents on small Fashion-MNIST shards, through a real mosquitto.

The server runs in this process; the agents run in one `edge-agent simulate`
process (one MQTT client each, compute shared). Per agent count: round time,
server and broker peak memory, messages and bytes per round, accuracy.
Writes ``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from _common import REPO_ROOT, RESULTS, machine, write_json

from cloud_server.config import ServerConfig
from cloud_server.coordinator import Coordinator
from cloud_server.methods import ServerContext, get_server_method
from shared_protocol.tomlio import write_toml
from shared_protocol.transport import MqttTransport


def vm_hwm_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def one_run(agents: int, per_agent: int, rounds: int, dataset: str, work: Path) -> dict:
    port = _free_port()
    conf = work / f"mq-{agents}.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 100000\n")
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    url = f"mqtt://127.0.0.1:{port}"
    run_id = f"scale{agents}"
    agent_toml = work / f"agent-{agents}.toml"
    write_toml(agent_toml, {
        "agent": {"agent_id": "sim", "run_id": run_id, "broker_url": url},
        "data": {"dataset": dataset, "partition": "iid", "num_agents": agents, "train_samples": agents * per_agent,
                 "test_samples": agents * max(4, per_agent // 4), "seed": 0},
    })
    cfg = ServerConfig(run_id=run_id, broker_url=url, out_dir=str(work / run_id), expected_agents=agents, rounds=rounds,
                       round_deadline_s=1800, registration_timeout_s=600, dataset=dataset, progress=False,
                       method_config={"upload_batch_samples": 64, "server_batch_size": 64})
    ctx = ServerContext(run_id=run_id, num_classes=10, in_channels=cfg.resolved_in_channels, device="cpu")
    coordinator = Coordinator(cfg, get_server_method("fedgkt")(ctx, cfg.method_config), MqttTransport(cfg.transport_config()))
    sim = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "simulate", "--config", str(agent_toml), "--agents", str(agents)],
                           cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=open(work / f"sim-{agents}.log", "w"),
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak_sim = [0]

    def watch() -> None:
        while sim.poll() is None:
            peak_sim[0] = max(peak_sim[0], vm_hwm_bytes(sim.pid))
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    started = time.monotonic()
    try:
        report = coordinator.run()
    finally:
        broker_peak = vm_hwm_bytes(broker.pid)
        sim.wait(120)
        broker.kill()
    rounds_out = report["rounds"]
    return {
        "agents": agents,
        "samples_per_agent": per_agent,
        "rounds": rounds,
        "wall_s": time.monotonic() - started,
        "round_s": [r["time_s"]["round"] for r in rounds_out],
        "server_train_s": [r["time_s"]["server_train"] for r in rounds_out],
        "accuracy": [r["accuracy"] for r in rounds_out],
        "edge_accuracy": [r["edge_accuracy"] for r in rounds_out],
        "up_wire_bytes_per_round": [r["bytes"]["up_wire"] for r in rounds_out],
        "down_wire_bytes_per_round": [r["bytes"]["down_wire"] for r in rounds_out],
        "messages_in": report["totals"]["server_connection"]["messages_in"],
        "messages_out": report["totals"]["server_connection"]["messages_out"],
        "server_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "agents_process_peak_rss_bytes": peak_sim[0],
        "broker_peak_rss_bytes": broker_peak,
        "completed_per_round": [len(r["completed"]) for r in rounds_out],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", default="8,16,64,128")
    parser.add_argument("--per-agent", type=int, default=32, help="training samples per agent")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgesplit-scale-"))
    runs = []
    for n in (int(x) for x in args.agents.split(",")):
        print(f"{n} agents ...", flush=True)
        result = one_run(n, args.per_agent, args.rounds, args.dataset, work)
        print(f"  rounds {['%.1f s' % t for t in result['round_s']]}, accuracy {result['accuracy']}", flush=True)
        runs.append(result)
    write_json(Path(args.out), {
        "machine": machine(),
        "note": "server peak RSS is this process's lifetime peak (monotone across the runs, in order)",
        "setup": {"per_agent": args.per_agent, "rounds": args.rounds, "dataset": args.dataset},
        "runs": runs,
    })


if __name__ == "__main__":
    main()

"""FedGKT with many agents (the shape of the paper's Table 4): 8, 16, 64 and 128
simulated agents on small Fashion-MNIST shards, through a real mosquitto.

The server runs in this process; the agents run in one `edge-agent simulate`
process (one MQTT client each, compute shared). Per agent count: round time,
server and broker peak memory, messages and bytes per round, accuracy.
Writes ``bench/results/scale.json``.

Server peak RSS is per run: the kernel's high-water mark is reset before each
run (``/proc/self/clear_refs``), falling back to sampling VmRSS every 0.2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import REPO_ROOT, RESULTS, machine, write_json

from cloud_server.assemble import build_server
from cloud_server.config import ServerConfig
from edge_agent.costs import reset_peak_rss
from shared_protocol.local_broker import LocalBroker, free_port
from shared_protocol.tomlio import write_toml


def _status_bytes(pid: int | str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def vm_hwm_bytes(pid: int | str) -> int:
    """Peak resident memory of a process (since start or the last reset)."""
    return _status_bytes(pid, "VmHWM")


def one_run(agents: int, per_agent: int, test_per_agent: int, rounds: int, dataset: str, work: Path) -> dict:
    port = free_port()
    conf = work / f"mq-{agents}.conf"
    # The broker as measured so far: mosquitto's in-flight default, no log file.
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 100000\n")
    broker = LocalBroker(work / f"mq-{agents}", port, config_file=conf).start()
    url = broker.url
    run_id = f"scale{agents}"
    agent_toml = work / f"agent-{agents}.toml"
    write_toml(agent_toml, {
        "agent": {"agent_id": "sim", "run_id": run_id, "broker_url": url},
        "data": {"dataset": dataset, "partition": "iid", "num_agents": agents, "train_samples": agents * per_agent,
                 "test_samples": agents * test_per_agent, "seed": 0},
    })
    cfg = ServerConfig(run_id=run_id, broker_url=url, out_dir=str(work / run_id), expected_agents=agents, rounds=rounds,
                       round_deadline_s=1800, registration_timeout_s=600, dataset=dataset, progress=False,
                       method_config={"upload_batch_samples": 64, "server_batch_size": 64})
    coordinator = build_server(cfg, device="cpu")
    sim = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "simulate", "--config", str(agent_toml), "--agents", str(agents)],
                           cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=open(work / f"sim-{agents}.log", "w"),
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak_sim = [0]
    exact_server_peak = reset_peak_rss()
    peak_server = [_status_bytes("self", "VmRSS")]

    def watch() -> None:
        while sim.poll() is None:
            peak_sim[0] = max(peak_sim[0], vm_hwm_bytes(sim.pid))
            peak_server[0] = max(peak_server[0], _status_bytes("self", "VmRSS"))
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    started = time.monotonic()
    try:
        report = coordinator.run()
    finally:
        broker_peak = vm_hwm_bytes(broker.proc.pid) if broker.proc is not None else 0
        sim.wait(120)
        broker.stop()
    rounds_out = report["rounds"]
    connection = report["totals"]["server_connection"]
    return {
        "agents": agents,
        "samples_per_agent": per_agent,
        "test_samples_per_agent": test_per_agent,
        "rounds": rounds,
        "wall_s": time.monotonic() - started,
        "round_s": [r["time_s"]["round"] for r in rounds_out],
        "server_train_s": [r["time_s"]["server_train"] for r in rounds_out],
        "accuracy": [r["accuracy"] for r in rounds_out],
        "edge_accuracy": [r["edge_accuracy"] for r in rounds_out],
        "up_wire_bytes_per_round": [r["bytes"]["up_wire"] for r in rounds_out],
        "down_wire_bytes_per_round": [r["bytes"]["down_wire"] for r in rounds_out],
        "status": report["status"],
        "round_status": [r["status"] for r in rounds_out],
        # The server connection's totals over the run (registration and status included), and per round.
        "messages_in": connection["messages_in"],
        "messages_out": connection["messages_out"],
        "chunks_in": connection["chunks_in"],
        "chunks_out": connection["chunks_out"],
        "messages_per_round": (connection["messages_in"] + connection["messages_out"]) / max(1, len(rounds_out)),
        "server_peak_rss_bytes": vm_hwm_bytes("self") if exact_server_peak else peak_server[0],
        "server_peak_rss_method": "VmHWM reset before the run" if exact_server_peak else "VmRSS sampled every 0.2 s",
        "agents_process_peak_rss_bytes": peak_sim[0],
        "broker_peak_rss_bytes": broker_peak,
        "completed_per_round": [len(r["completed"]) for r in rounds_out],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", default="8,16,64,128")
    parser.add_argument("--total-samples", type=int, default=2048,
                        help="training samples split over the agents (the paper's Table 4 splits one dataset over 16-128 edges)")
    parser.add_argument("--total-test-samples", type=int, default=512)
    parser.add_argument("--per-agent", type=int, default=0, help="training samples per agent instead of a fixed total")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgesplit-scale-"))
    started = time.monotonic()
    runs = []
    for n in (int(x) for x in args.agents.split(",")):
        per_agent = args.per_agent or args.total_samples // n
        test_per_agent = max(1, args.total_test_samples // n)
        print(f"{n} agents x {per_agent} samples ...", flush=True)
        result = one_run(n, per_agent, test_per_agent, args.rounds, args.dataset, work)
        print(f"  rounds {['%.1f s' % t for t in result['round_s']]}, accuracy {result['accuracy']}", flush=True)
        runs.append(result)
        # Written after every agent count, so a run cut short still leaves its results.
        write_json(Path(args.out), {
            "benchmark": "scale",
            "machine": machine(),
            "scale": (f"agents {args.agents}; "
                      + (f"{args.per_agent} training samples per agent" if args.per_agent else
                         f"{args.total_samples} training / {args.total_test_samples} test samples split over the agents")
                      + f" ({args.dataset}, iid); {args.rounds} rounds; resnet8 edge / resnet55_server; the paper uses "
                      "full CIFAR-10 shards and hundreds of rounds, so accuracies here show the trend at toy scale, "
                      "not the paper's numbers"),
            "setup": {"per_agent": args.per_agent or None, "total_samples": None if args.per_agent else args.total_samples,
                      "total_test_samples": args.total_test_samples, "rounds": args.rounds, "dataset": args.dataset,
                      "upload_batch_samples": 64, "server_batch_size": 64, "wall_s_total": time.monotonic() - started},
            "complete": len(runs) == len(args.agents.split(",")),
            "runs": runs,
        })
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

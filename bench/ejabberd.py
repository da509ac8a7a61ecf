"""A FedGKT federation through ejabberd's MQTT broker (mod_mqtt), on one node and on a
two-node ejabberd cluster, all on loopback. Writes ``bench/results/ejabberd.json``.

Needs the Debian package (``apt-get install -y ejabberd``; 23.01 on Debian 12) and root
(``ejabberdctl`` runs the nodes as the ``ejabberd`` user). Each node gets its own name,
MQTT port, spool (Mnesia) and log directory in a temporary directory, and is stopped at
the end; nothing in /etc/ejabberd or /var/lib/ejabberd is changed (the Erlang cookie in
the ``ejabberd`` user's home, which both nodes share, is created by Erlang if missing).

1. ``single``: ``edgesplit local --broker mqtt://USER:PASSWORD@127.0.0.1:PORT1`` runs the
   server and two agents through node 1: the launcher passes the URL's credentials on.
2. ``cluster``: node 2 joins node 1 (``ejabberdctl join_cluster``); the agents connect
   to node 1 and the server to node 2, so every message crosses the cluster.

Both: 2 agents, 2 rounds, synthetic data (256 training samples), default chunk size.
mod_mqtt refuses an empty password without a client certificate; the nodes accept any
non-empty one (``auth_method: [anonymous]``, ``anonymous_protocol: login_anon``), so
the runs use a user name and a password file like a real deployment would.

    python bench/ejabberd.py            # about 3-5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, RESULTS, machine, write_json

from shared_protocol.local_broker import free_port
from shared_protocol.transport import MqttTransport, TransportConfig, TransportError

EJABBERDCTL = "/usr/sbin/ejabberdctl"
USER, PASSWORD = "edgesplit", "any-non-empty-password"
SESSION_EXPIRY_S = 300  # mod_mqtt's default, kept to show what the agents are told about it
MAX_PAYLOAD_BYTES = 1024 * 1024  # the listener's max_payload_size


def node_config(mqtt_port: int) -> str:
    """ejabberd.yml of one node: only the MQTT listener, anonymous login with any password,
    and ACLs that let the fleet's user (and nobody else) use the EdgeSplit topics; an ACL by IP
    does not work for the will (mod_mqtt checks the will before it knows the address)."""
    return f"""\
hosts:
  - localhost
loglevel: info
log_rotate_count: 0
listen:
  -
    port: {mqtt_port}
    ip: "127.0.0.1"
    module: mod_mqtt
    backlog: 1000
    max_payload_size: {MAX_PAYLOAD_BYTES}
auth_method: [anonymous]
anonymous_protocol: login_anon
acl:
  fleet:
    user: {USER}
modules:
  mod_mqtt:
    session_expiry: {SESSION_EXPIRY_S}
    max_queue: 100000
    access_subscribe:
      "edgesplit/v1/#":
        - allow: fleet
    access_publish:
      "edgesplit/v1/#":
        - allow: fleet
"""


class Node:
    """One ejabberd node we start and stop: name, MQTT port, directories of its own."""

    def __init__(self, base: Path, index: int, mqtt_port: int) -> None:
        self.name = f"edgesplit{index}@localhost"
        self.port = mqtt_port
        self.dir = base / f"node{index}"
        for sub in ("spool", "logs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "ejabberd.yml").write_text(node_config(mqtt_port))
        (self.dir / "ejabberdctl.cfg").write_text(
            f'ERL_OPTIONS="-env ERL_CRASH_DUMP_BYTES 0"\nINET_DIST_INTERFACE=127.0.0.1\n'
            f"EJABBERD_PID_PATH={self.dir / 'ejabberd.pid'}\nEJABBERD_BYPASS_WARNINGS=true\n"
        )
        user = pwd.getpwnam("ejabberd")
        for path in [self.dir, *self.dir.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid)

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [EJABBERDCTL, "--node", self.name, "--spool", str(self.dir / "spool"), "--logs", str(self.dir / "logs"),
               "--config", str(self.dir / "ejabberd.yml"), "--ctl-config", str(self.dir / "ejabberdctl.cfg"), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.dir)

    def start(self) -> None:
        result = self.ctl("start")
        if result.returncode != 0:
            raise RuntimeError(f"ejabberdctl start {self.name}: {result.stdout}{result.stderr}")
        started = self.ctl("started", timeout=180)
        if started.returncode != 0:
            raise RuntimeError(f"{self.name} did not start: {started.stdout}{started.stderr}; see {self.dir / 'logs'}")

    def stop(self) -> None:
        self.ctl("stop", timeout=60)
        self.ctl("stopped", timeout=60)

    def log_tail(self, lines: int = 40) -> str:
        path = self.dir / "logs" / "ejabberd.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def transport(url: str, name: str) -> MqttTransport:
    return MqttTransport(TransportConfig(broker_url=url, username=USER, password=PASSWORD, connect_timeout_s=15,
                                         client_id=f"{name}-{time.monotonic_ns()}"))


def probe(url: str) -> dict[str, Any]:
    """What the broker's CONNACK says, as our transport reads it."""
    t = transport(url, "probe")
    try:
        t.connect()
    except TransportError as exc:
        return {"connected": False, "error": str(exc)}
    out = {"connected": True, "max_packet_bytes": t.broker_max_packet_bytes, "chunk_size_bytes": t.chunk_size_bytes,
           "session_expiry_granted_s": t.granted_session_expiry_s, "session_expiry_asked_s": t.config.session_expiry_s}
    t.close()
    return out


def oversize_outcome(url: str) -> str:
    """What the broker does with one PUBLISH over its max_payload_size (it announces no
    Maximum Packet Size in CONNACK, so clients cannot adapt to it)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    events: list[str] = []
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"big-{time.monotonic_ns()}",
                         protocol=mqtt.MQTTv5)
    client.username_pw_set(USER, PASSWORD)
    client.on_disconnect = lambda c, u, f, rc, p: events.append(f"disconnected: {rc}")
    client.on_publish = lambda c, u, mid, rc, p: events.append(f"puback: {rc}")
    client.connect("127.0.0.1", int(url.rsplit(":", 1)[1]))
    client.loop_start()
    client.publish("edgesplit/v1/probe/big", os.urandom(2 * MAX_PAYLOAD_BYTES), qos=1)
    time.sleep(3)
    client.loop_stop()
    client.disconnect()
    return "; ".join(events) or "no answer within 3 s"


def cross_node_delivery(publish_url: str, subscribe_url: str) -> bool:
    """A 3 MB blob published on one node reaches a subscriber on the other."""
    rx, tx = transport(subscribe_url, "rx"), transport(publish_url, "tx")
    rx.subscribe("edgesplit/v1/probe/#")
    rx.connect()
    tx.connect()
    try:
        blob = os.urandom(3 * 1024 * 1024)
        tx.publish("edgesplit/v1/probe/x", blob)
        got = rx.receive(timeout_s=30)
        return got is not None and got.payload == blob
    finally:
        rx.close()
        tx.close()


def summarize(out: Path, seconds: float, code: int) -> dict[str, Any]:
    report_path = out / "report.json"
    if not report_path.exists():
        return {"exit_code": code, "status": "no report", "wall_s": round(seconds, 1)}
    report = json.loads(report_path.read_text())
    totals = report["totals"]
    by_process = {p.stem: p.read_text(errors="replace") for p in sorted((out / "logs").glob("*.log"))}
    logs = "\n".join(by_process.values())
    return {
        "exit_code": code,
        "status": report["status"],
        # process -> the nodes (ports) it connected to, from its log
        "connected_to_ports": {name: sorted({int(p) for p in re.findall(r"connected to mqtt://127\.0\.0\.1:(\d+) as", log)})
                               for name, log in by_process.items()},
        "wall_s": round(seconds, 1),
        "rounds": [
            {"round": r["round"], "status": r["status"], "completed": r["completed"], "samples": r["samples"],
             "accuracy": r["accuracy"], "edge_accuracy": r["edge_accuracy"]}
            for r in report["rounds"]
        ],
        "rejected_messages": totals["rejected_messages"],
        "rejected_chunks": totals.get("rejected_chunks"),
        "server_connection": {k: totals["server_connection"][k] for k in ("chunks_in", "messages_in", "resent_chunks", "rejected_chunks")},
        "session_expiry_warnings": len(re.findall(r"granted a session expiry of", logs)),
        "reconnects_logged": len(re.findall(r"disconnected from .*; reconnecting", logs)),
        "resend_requests_logged": len(re.findall(r"asking .* to resend", logs)),
    }


COMMON = ["--agents", "2", "--rounds", "2", "--dataset", "synthetic", "--partition", "iid",
          "--train-samples", "256", "--test-samples", "128", "--deadline", "600"]


def run_single(node: Node, out: Path) -> dict[str, Any]:
    url = f"mqtt://{USER}:{PASSWORD}@127.0.0.1:{node.port}"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cloud_server.launcher", "local", *COMMON, "--broker", url,
                             "--out", str(out), "--run-id", "ejabberd-single"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    (out / "launcher.out").write_text(result.stdout + result.stderr)
    return summarize(out, time.monotonic() - started, result.returncode)


def run_cluster(agents_node: Node, server_node: Node, out: Path, password_file: Path) -> dict[str, Any]:
    """Configs as ``edgesplit local`` writes them for node 1; the server is pointed at node 2."""
    from cloud_server.launcher import build_parser, write_configs

    args = build_parser().parse_args(["local", *COMMON, "--username", USER, "--password-file", str(password_file)])
    server_toml, agent_tomls = write_configs(args, "ejabberd-cluster", out, agents_node.url)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    started = time.monotonic()
    with contextlib.ExitStack() as logs_open:
        def start(log: str, *argv: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", *argv, "--no-progress"], cwd=REPO_ROOT, env=env,
                                    stdout=logs_open.enter_context(open(logs / log, "w")), stderr=subprocess.STDOUT)

        server = start("server.log", "cloud_server.cli", "run", "--config", str(server_toml), "--broker", server_node.url)
        agents = [start(f"agent-{i}.log", "edge_agent.cli", "run", "--config", str(toml)) for i, toml in enumerate(agent_tomls)]
        try:
            code = server.wait(timeout=1500)
        finally:
            for p in agents:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.terminate()
                    p.wait(10)
    return summarize(out, time.monotonic() - started, code)


def ejabberd_version() -> str:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "ejabberd"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "ejabberd.json")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs, run reports)")
    args = parser.parse_args()
    if not Path(EJABBERDCTL).exists():
        print("ejabberd is not installed (apt-get install -y ejabberd); nothing measured", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("ejabberdctl starts nodes as the ejabberd user: run this as root", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="edgesplit-ejabberd-"))
    base.chmod(0o755)
    password_file = base / "broker.password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    nodes = [Node(base, 1, free_port()), Node(base, 2, free_port())]
    result: dict[str, Any] = {
        "benchmark": "ejabberd", "generated_by": "python bench/ejabberd.py", "machine": machine(),
        "ejabberd": ejabberd_version(),
        "setup": {"agents": 2, "rounds": 2, "method": "fedgkt", "dataset": "synthetic", "train_samples": 256,
                  "test_samples": 128, "session_expiry_s": SESSION_EXPIRY_S, "max_payload_size": MAX_PAYLOAD_BYTES,
                  "auth": "anonymous, login_anon (any non-empty password)"},
        "node_mqtt_ports": {node.name: node.port for node in nodes},
    }
    try:
        nodes[0].start()
        result["node1_connack"] = probe(nodes[0].url)
        result["publish_over_max_payload_size"] = oversize_outcome(nodes[0].url)
        result["single"] = run_single(nodes[0], base / "single")
        print("single node:", json.dumps(result["single"]), flush=True)
        nodes[1].start()
        joined = nodes[1].ctl("join_cluster", nodes[0].name, timeout=180)
        result["join_cluster"] = {"exit_code": joined.returncode, "output": (joined.stdout + joined.stderr).strip()[-500:]}
        listed = nodes[0].ctl("list_cluster")
        result["cluster_nodes"] = listed.stdout.split()
        result["node2_connack"] = probe(nodes[1].url)
        result["cross_node_3MB_delivered"] = cross_node_delivery(nodes[0].url, nodes[1].url)
        result["cluster"] = run_cluster(nodes[0], nodes[1], base / "cluster", password_file)
        print("cluster:", json.dumps(result["cluster"]), flush=True)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyboardInterrupt) as exc:
        result["error"] = str(exc)
        result["node_logs"] = {n.name: n.log_tail() for n in nodes}
    finally:
        for node in reversed(nodes):
            node.stop()
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    write_json(args.out, result)
    ok = all(result.get(k, {}).get("status") == "finished" for k in ("single", "cluster"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

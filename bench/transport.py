"""Throughput of the chunked MQTT transport on loopback, next to raw paho
publishing of the same bytes through the same broker and a raw TCP socket copy;
plain and TLS. Writes ``bench/results/transport.json``.

Each measurement sends ``--mb`` megabytes from one client to another and stops
the clock when the receiver has everything (for the transport: the reassembled,
hash-verified blobs).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import RESULTS, machine, write_json

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from cloud_server.keys import KeysConfig, init_keys
from shared_protocol.local_broker import LocalBroker, free_port
from shared_protocol.transport import MqttTransport, TransportConfig

CHUNK = 512 * 1024
#: The targets: raw paho's MB/s over ours at most this (medians, plain and TLS), and our CPU per MB
#: (clients and broker) over raw paho's at most this.
TARGET_TIME_RATIO = 1.2
TARGET_CPU_RATIO = 1.5


def sha256_ms_per_mb(megabytes: int = 64, repeats: int = 3) -> float:
    """One SHA-256 pass over a blob, per MB (the best of ``repeats``): the integrity check each
    side of the transport makes over every blob, which raw paho does not."""
    import hashlib

    blob = os.urandom(megabytes * 2**20)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        hashlib.sha256(blob).digest()
        best = min(best, time.process_time() - start)
    return 1000 * best / megabytes


def tcp_copy(total: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = server.accept()
        while received < total:
            data = conn.recv(1 << 20)
            if not data:
                break
            received += len(data)
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        sent = 0
        while sent < total:
            c.sendall(block)
            sent += len(block)
    t.join()
    server.close()
    return time.perf_counter() - start


def raw_paho(port: int, total: int, tls: dict | None, meter: Meter | None = None) -> float:
    done = threading.Event()
    got = [0]
    count = total // CHUNK

    def on_message(c, u, m):  # type: ignore[no-untyped-def]
        got[0] += 1
        if got[0] >= count:
            done.set()

    def client(name: str) -> mqtt.Client:
        cl = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{name}-{time.monotonic_ns()}", protocol=mqtt.MQTTv5)
        if tls:
            cl.username_pw_set(tls["user"], tls["password"])
            cl.tls_set(ca_certs=tls["ca"])
        cl.connect("localhost" if tls else "127.0.0.1", port)
        cl.loop_start()
        return cl

    rx = client("rx")
    rx.on_message = on_message
    rx.subscribe("bench/raw", qos=1)
    time.sleep(0.3)
    tx = client("tx")
    block = os.urandom(CHUNK)
    meter = meter or Meter()
    meter.start()
    start = time.perf_counter()
    infos = [tx.publish("bench/raw", block, qos=1) for _ in range(count)]
    for info in infos:
        info.wait_for_publish(60)
    done.wait(120)
    elapsed = time.perf_counter() - start
    meter.stop()
    for cl in (rx, tx):
        cl.loop_stop()
        cl.disconnect()
    return elapsed


def ours(port: int, total: int, tls: dict | None, blob_mb: int, meter: Meter | None = None) -> float:
    def transport(name: str) -> MqttTransport:
        url = f"mqtts://localhost:{port}" if tls else f"mqtt://127.0.0.1:{port}"
        return MqttTransport(TransportConfig(broker_url=url, client_id=f"{name}-{time.monotonic_ns()}", username=tls["user"] if tls else None,
                                             password=tls["password"] if tls else None, ca_file=tls["ca"] if tls else None))

    rx, tx = transport("rx"), transport("tx")
    rx.subscribe("bench/ours")
    rx.connect()
    tx.connect()
    time.sleep(0.3)
    blob = os.urandom(blob_mb * 1024 * 1024)
    n = max(1, total // len(blob))
    received: list[int] = []

    def consume() -> None:
        # Like the raw receiver (and the coordinator), take each blob as it completes and let it go.
        for _ in range(n):
            got = rx.receive(120)
            if got is None:
                return
            received.append(len(got.payload))

    consumer = threading.Thread(target=consume)
    meter = meter or Meter()
    meter.start()
    start = time.perf_counter()
    consumer.start()
    for _ in range(n):
        tx.publish("bench/ours", blob, wait=False)  # pipelined, as agents stream uploads
    tx.flush()
    consumer.join()
    elapsed = time.perf_counter() - start
    meter.stop()
    if received != [len(blob)] * n:
        raise RuntimeError(f"receiver got {len(received)} of {n} blobs")
    rx.close()
    tx.close()
    return elapsed


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process, or of ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU seconds of this process and of the broker over the timed part of one transfer."""

    def __init__(self, broker_pid: int | None = None) -> None:
        self.broker_pid = broker_pid
        self.clients_s = self.broker_s = 0.0

    def start(self) -> None:
        self._c0 = cpu_s()
        self._b0 = cpu_s(self.broker_pid) if self.broker_pid else 0.0

    def stop(self) -> None:
        self.clients_s = cpu_s() - self._c0
        self.broker_s = (cpu_s(self.broker_pid) - self._b0) if self.broker_pid else 0.0


def measured(run_once, mb: int, broker_pid: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """(MB/s, client CPU ms per MB, broker CPU ms per MB) of one transfer."""
    meter = Meter(broker_pid)
    elapsed = run_once(meter)
    return mb / elapsed, 1000 * meter.clients_s / mb, 1000 * meter.broker_s / mb


def paired(port: int, total: int, tls: dict | None, repeats: int, mb: int, broker_pid: int) -> dict[str, list]:
    """Raw paho and the transport alternately, after one untimed warm-up of each: on a shared
    machine the load drifts, and a pair measured back to back sees (nearly) the same load.
    CPU time per MB (sender and receiver in this process; the broker separately) does not
    depend on the load the way wall time does."""
    raw_paho(port, CHUNK * 16, tls)
    ours(port, CHUNK * 16, tls, 8)
    out: dict[str, list] = {"raw": [], "ours": []}
    for _ in range(repeats):
        out["raw"].append(measured(lambda m: raw_paho(port, total, tls, m), mb, broker_pid))
        out["ours"].append(measured(lambda m: ours(port, total, tls, 8, m), mb, broker_pid))
    return out


def run(mb: int, repeats: int) -> dict:
    total = mb * 1024 * 1024
    work = Path(tempfile.mkdtemp(prefix="edgesplit-bench-"))
    work.chmod(0o755)  # mosquitto reads its TLS files as the mosquitto user
    results: dict = {
        "benchmark": "transport",
        "machine": machine(),
        "setup": {
            "megabytes": mb, "repeats": repeats, "chunk_bytes": CHUNK, "blob_megabytes": 8,
            "method": "raw paho and EdgeSplit measured alternately (one untimed warm-up each); "
                      "medians over the repeats; ratios are raw paho MB/s over EdgeSplit MB/s, per pair and of the medians",
        },
        "mb_per_s": {},
    }
    pairs: dict[str, dict[str, list]] = {}
    try:
        results["mb_per_s"]["tcp_socket"] = [mb / tcp_copy(total) for _ in range(repeats)]
        plain_port = free_port()
        plain_conf = work / "plain.conf"  # as measured so far: mosquitto's in-flight default, no log file
        plain_conf.write_text(f"listener {plain_port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 100000\n")
        plain = LocalBroker(work / "plain", plain_port, config_file=plain_conf).start()
        try:
            pairs["plain"] = paired(plain_port, total, None, repeats, mb, plain.proc.pid)
        finally:
            plain.stop()
        tls_port = free_port()
        keys = work / "keys"
        init_keys(KeysConfig(keys, ("bench",), port=tls_port, bind="127.0.0.1"))
        conf = keys / "mosquitto.conf"
        conf.write_text(conf.read_text().replace("max_queued_messages 10000", "max_queued_messages 100000"))
        acl = keys / "acl"
        acl.write_text(acl.read_text() + "\nuser bench\ntopic readwrite bench/#\n")
        tls_broker = LocalBroker(work / "tls", tls_port, config_file=conf).start()
        tls = {"user": "bench", "password": (keys / "secrets" / "bench.password").read_text().strip(), "ca": str(keys / "ca.crt")}
        try:
            pairs["tls"] = paired(tls_port, total, tls, repeats, mb, tls_broker.proc.pid)
        finally:
            tls_broker.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["cpu_ms_per_mb"] = {}
    for mode, both in pairs.items():
        for who, name in (("raw", f"paho_raw_{mode}"), ("ours", f"edgesplit_{mode}")):
            results["mb_per_s"][name] = [r[0] for r in both[who]]
            results["cpu_ms_per_mb"][name] = {"clients": [r[1] for r in both[who]], "broker": [r[2] for r in both[who]]}
    rates = results["mb_per_s"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    results["median_mb_per_s"] = med
    results["ratios"] = {
        "paho_over_edgesplit_plain": med["paho_raw_plain"] / med["edgesplit_plain"],
        "paho_over_edgesplit_tls": med["paho_raw_tls"] / med["edgesplit_tls"],
    }
    results["pair_ratios"] = {
        mode: [r / e for r, e in zip(rates[f"paho_raw_{mode}"], rates[f"edgesplit_{mode}"])] for mode in ("plain", "tls")
    }
    results["median_pair_ratio"] = {mode: statistics.median(v) for mode, v in results["pair_ratios"].items()}
    results["median_cpu_ms_per_mb"] = {
        name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in results["cpu_ms_per_mb"].items()
    }
    results["cpu_ratio_edgesplit_over_paho"] = {
        mode: sum(results["median_cpu_ms_per_mb"][f"edgesplit_{mode}"].values())
        / sum(results["median_cpu_ms_per_mb"][f"paho_raw_{mode}"].values())
        for mode in ("plain", "tls")
    }
    results["targets"] = {"time_ratio_max": TARGET_TIME_RATIO, "cpu_ratio_max": TARGET_CPU_RATIO}
    results["within_time_target"] = all(r <= TARGET_TIME_RATIO for r in results["ratios"].values())
    results["within_cpu_target"] = all(r <= TARGET_CPU_RATIO for r in results["cpu_ratio_edgesplit_over_paho"].values())
    # What the blob's integrity check alone costs: one hash pass on each side. With raw paho's CPU
    # per MB as it is, the CPU ratio cannot go below (raw + 2 x hash) / raw.
    hash_ms = sha256_ms_per_mb()
    results["sha256_ms_per_mb"] = hash_ms
    results["cpu_ratio_floor_of_the_hashes"] = {
        mode: (raw + 2 * hash_ms) / raw for mode in ("plain", "tls")
        for raw in [sum(results["median_cpu_ms_per_mb"][f"paho_raw_{mode}"].values())]}
    try:
        import json

        codecs = json.loads((RESULTS / "codecs.json").read_text())
        results["codecs_reference"] = "see bench/results/codecs.json (bench/codecs.py) for codec MB/s"
        results["codecs_summary"] = codecs.get("summary", None)
    except (OSError, ValueError):
        pass
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "transport.json"))
    args = parser.parse_args()
    result = run(args.mb, args.repeats)
    for name, value in result["median_mb_per_s"].items():
        print(f"{name:>18}: {value:8.1f} MB/s")
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()

"""The chunked MQTT transport on loopback next to raw paho publishing the same bytes through the
same mosquitto, and a raw TCP socket copy; plain and TLS. Each measurement sends ``MB`` megabytes
from one client to another and stops the clock when the receiver has everything (for the
transport: the reassembled, digest-verified blobs). Raw paho and the transport are measured
alternately, so a pair sees nearly the same load; the one case records every repeat, the
medians, CPU per MB and the targets in ``extra_info`` (its own timing is not the figure).

Every timed transfer runs after an untimed one of each, so both are measured with a warm
allocator: once a process has freed blob-sized buffers, glibc serves the next ones from its heap
instead of fresh mappings. A cold process pays a page fault per fresh page of every buffer; raw
paho's CPU per MB, whose copies are all fresh buffers, is then several times its warm figure
(as a long-running agent or server process never sees it).

    make bench-micro MICRO=transport     # or: pytest bench/micro/test_transport.py [--quick]
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from cloud_server.keys import KeysConfig, init_keys
from shared_protocol.mqtt.chunk_format import DIGEST_NAME, blob_hasher
from shared_protocol.local_broker import LocalBroker, free_port
from shared_protocol.transport import MqttTransport, TransportConfig

CHUNK = 512 * 1024
BLOB_MB = 8
#: (megabytes per measurement, repeats): full and --quick.
SIZES = {False: (64, 15), True: (8, 2)}
#: The targets: raw paho's MB/s over ours at most this (medians, plain and TLS), and our CPU per MB
#: (clients and broker) over raw paho's at most this.
TARGET_TIME_RATIO = 1.2
TARGET_CPU_RATIO = 1.5
MODES = ("plain", "tls")


def digest_ms_per_mb(megabytes: int = 64, repeats: int = 3) -> float:
    """One pass of the chunk layer's blob digest over a blob, per MB (the best of ``repeats``): the
    integrity check each side of the transport makes over every blob, which raw paho does not."""
    blob = os.urandom(megabytes * 2**20)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        hasher = blob_hasher()
        hasher.update(blob)
        hasher.digest()
        best = min(best, time.process_time() - start)
    return 1000 * best / megabytes


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


def raw_paho(port: int, total: int, tls: dict[str, str] | None, meter: Meter) -> float:
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
    meter.start()
    start = time.perf_counter()
    infos = [tx.publish("bench/raw", block, qos=1) for _ in range(count)]
    for info in infos:
        info.wait_for_publish(60)
    complete = done.wait(120)
    elapsed = time.perf_counter() - start
    meter.stop()
    for cl in (rx, tx):
        cl.loop_stop()
        cl.disconnect()
    assert complete, f"raw paho's receiver got {got[0]} of {count} messages"
    return elapsed


def ours(port: int, total: int, tls: dict[str, str] | None, meter: Meter) -> float:
    def transport(name: str) -> MqttTransport:
        url = f"mqtts://localhost:{port}" if tls else f"mqtt://127.0.0.1:{port}"
        return MqttTransport(TransportConfig(broker_url=url, client_id=f"{name}-{time.monotonic_ns()}", username=tls["user"] if tls else None,
                                             password=tls["password"] if tls else None, ca_file=tls["ca"] if tls else None))

    rx, tx = transport("rx"), transport("tx")
    rx.subscribe("bench/ours")
    rx.connect()
    tx.connect()
    time.sleep(0.3)
    blob = os.urandom(BLOB_MB * 2**20)
    n = max(1, total // len(blob))
    received: list[int] = []

    def consume() -> None:
        # Like the coordinator, take each blob as it completes and let it go.
        for _ in range(n):
            got = rx.receive(120)
            if got is None:
                return
            received.append(len(got.payload))

    consumer = threading.Thread(target=consume)
    meter.start()
    start = time.perf_counter()
    consumer.start()
    for _ in range(n):
        tx.publish("bench/ours", blob, wait=False)  # pipelined, as agents stream uploads
    tx.flush()
    consumer.join()
    elapsed = time.perf_counter() - start
    meter.stop()
    rx.close()
    tx.close()
    assert received == [len(blob)] * n, f"the transport's receiver got {len(received)} of {n} blobs"
    return elapsed


def paired(port: int, mb: int, repeats: int, tls: dict[str, str] | None, broker_pid: int) -> dict[str, list[tuple[float, float, float]]]:
    """Raw paho and the transport alternately, after one untimed warm-up of each: on a shared
    machine the load drifts, and a pair measured back to back sees (nearly) the same load. CPU
    time per MB (sender and receiver in this process; the broker separately) does not depend on
    the load the way wall time does. Each entry: (MB/s, client CPU ms / MB, broker CPU ms / MB)."""
    runs: dict[str, Callable[[int, Meter], float]] = {"raw": lambda total, m: raw_paho(port, total, tls, m),
                                                      "ours": lambda total, m: ours(port, total, tls, m)}
    for run in runs.values():
        run(BLOB_MB * 2**20, Meter())
    out: dict[str, list[tuple[float, float, float]]] = {"raw": [], "ours": []}
    for _ in range(repeats):
        for who, run in runs.items():
            meter = Meter(broker_pid)
            elapsed = run(mb * 2**20, meter)
            out[who].append((mb / elapsed, 1000 * meter.clients_s / mb, 1000 * meter.broker_s / mb))
    return out


def measure(mb: int, repeats: int) -> dict[str, Any]:
    # mosquitto reads its TLS files as the mosquitto user: a directory of its own, readable on the way to it.
    with tempfile.TemporaryDirectory(prefix="edgesplit-bench-") as name:
        work = Path(name)
        work.chmod(0o755)
        return measure_in(mb, repeats, work)


def measure_in(mb: int, repeats: int, work: Path) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"tcp_socket": [mb / tcp_copy(mb * 2**20) for _ in range(repeats)]}
    pairs = {}
    port = free_port()
    conf = work / "plain.conf"  # mosquitto's in-flight default, no log file
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 100000\n")
    broker = LocalBroker(work / "plain", port, config_file=conf).start()
    try:
        pairs["plain"] = paired(port, mb, repeats, None, broker.proc.pid)
    finally:
        broker.stop()
    port, keys = free_port(), work / "keys"
    init_keys(KeysConfig(keys, ("bench",), port=port, bind="127.0.0.1"))
    conf = keys / "mosquitto.conf"
    conf.write_text(conf.read_text().replace("max_queued_messages 10000", "max_queued_messages 100000"))
    acl = keys / "acl"
    acl.write_text(acl.read_text() + "\nuser bench\ntopic readwrite bench/#\n")
    broker = LocalBroker(work / "tls", port, config_file=conf).start()
    tls = {"user": "bench", "password": (keys / "secrets" / "bench.password").read_text().strip(), "ca": str(keys / "ca.crt")}
    try:
        pairs["tls"] = paired(port, mb, repeats, tls, broker.proc.pid)
    finally:
        broker.stop()
    cpu: dict[str, dict[str, list[float]]] = {}
    for mode, both in pairs.items():
        for who, name in (("raw", f"paho_raw_{mode}"), ("ours", f"edgesplit_{mode}")):
            rates[name] = [r[0] for r in both[who]]
            cpu[name] = {"clients": [r[1] for r in both[who]], "broker": [r[2] for r in both[who]]}
    return summary(rates, cpu, digest_ms_per_mb())


def summary(rates: dict[str, list[float]], cpu: dict[str, dict[str, list[float]]], hash_ms: float | None) -> dict[str, Any]:
    """The medians, the ratios and the targets' verdicts of the recorded MB/s and CPU per MB."""
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_cpu = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in cpu.items()}
    raw_cpu = {mode: sum(med_cpu[f"paho_raw_{mode}"].values()) for mode in MODES}
    ratios = {f"paho_over_edgesplit_{mode}": med[f"paho_raw_{mode}"] / med[f"edgesplit_{mode}"] for mode in MODES}
    pair_ratios = {mode: [r / e for r, e in zip(rates[f"paho_raw_{mode}"], rates[f"edgesplit_{mode}"])] for mode in MODES}
    cpu_ratio = {mode: sum(med_cpu[f"edgesplit_{mode}"].values()) / raw_cpu[mode] for mode in MODES}
    out = {
        "mb_per_s": rates, "cpu_ms_per_mb": cpu, "median_mb_per_s": med, "median_cpu_ms_per_mb": med_cpu, "ratios": ratios,
        "pair_ratios": pair_ratios, "median_pair_ratio": {mode: statistics.median(v) for mode, v in pair_ratios.items()},
        "cpu_ratio_edgesplit_over_paho": cpu_ratio,
        "targets": {"time_ratio_max": TARGET_TIME_RATIO, "cpu_ratio_max": TARGET_CPU_RATIO},
        "within_time_target": all(r <= TARGET_TIME_RATIO for r in ratios.values()),
        "within_cpu_target": all(r <= TARGET_CPU_RATIO for r in cpu_ratio.values()),
    }
    if hash_ms is not None:
        # One digest pass on each side: with raw paho's CPU per MB as it is, the ratio cannot go below this.
        out["digest"] = DIGEST_NAME
        out["digest_ms_per_mb"] = hash_ms
        out["cpu_ratio_floor_of_the_hashes"] = {mode: (raw_cpu[mode] + 2 * hash_ms) / raw_cpu[mode] for mode in MODES}
    return out


def test_transport(benchmark: Any, quick: bool) -> None:
    mb, repeats = SIZES[quick]
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(measure(mb, repeats)), rounds=1, iterations=1)
    benchmark.extra_info.update(
        megabytes=mb, repeats=repeats, chunk_bytes=CHUNK, blob_megabytes=BLOB_MB,
        method="raw paho and EdgeSplit measured alternately (one untimed warm-up each); medians over the repeats; "
               "ratios are raw paho MB/s over EdgeSplit MB/s, per pair and of the medians", **result)
    assert all(len(v) == repeats and min(v) > 0 for v in result["mb_per_s"].values())

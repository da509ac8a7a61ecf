"""The chunked MQTT transport on loopback next to raw paho publishing the same bytes through the
same mosquitto, and a raw TCP socket copy; plain and TLS. Each measurement sends ``MB`` megabytes
from one client to another and stops the clock when the receiver has everything (for the
transport: the reassembled, digest-verified blobs). Raw paho and the transport are measured
alternately, so a pair sees nearly the same load; the one case records every repeat, the
medians, CPU per MB and the targets in ``extra_info`` (its own timing is not the figure). Two
arrangements: the receiver in the sender's process (``plain``, ``tls``: one interpreter lock,
so work on either side slows the other) and, as an agent and the server run, in a process of
its own (``plain_procs``, ``tls_procs``; this file run as a script).

Every timed transfer runs after an untimed one of each, so both are measured with a warm
allocator: once a process has freed blob-sized buffers, glibc serves the next ones from its heap
instead of fresh mappings (a cold process pays a page fault per fresh page of every buffer,
which a long-running agent or server never sees). For the same reason the receivers apart run
with glibc's trimming off (``NO_TRIM``): by default a process that frees each message's payload
in its network thread hands the pages back and faults them in again for the next message, which
raw paho's receiver does, at a cost in CPU that dwarfs its own work, and ours, holding its
blob's buffer, mostly does not: the comparison is of the work each does.

    make bench-micro MICRO=transport     # or: pytest bench/micro/test_transport.py [--quick]
"""

from __future__ import annotations

import json
import os
import queue
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from cloud_server.keys import KeysConfig, init_keys
from shared_protocol.mqtt.chunk_format import DIGEST_NAME
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
MODES = ("plain", "tls")  # the targets' arrangement: sender and receiver in one process
PROCESS_MODES = ("plain_procs", "tls_procs")
NO_TRIM = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process, or of ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tcp_copy(total: int) -> float:
    """Seconds to copy ``total`` bytes through one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        conn, _ = server.accept()

        def sink() -> None:
            received = 0
            while received < total and (data := conn.recv(1 << 20)):
                received += len(data)

        t = threading.Thread(target=sink)
        t.start()
        block, start = os.urandom(CHUNK), time.perf_counter()
        for _ in range(total // CHUNK):
            c.sendall(block)
        t.join()
        conn.close()
        return time.perf_counter() - start


def paho_client(name: str, port: int, tls: dict[str, str] | None) -> mqtt.Client:
    cl = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{name}-{time.monotonic_ns()}", protocol=mqtt.MQTTv5)
    if tls:
        cl.username_pw_set(tls["user"], tls["password"])
        cl.tls_set(ca_certs=tls["ca"])
    cl.connect("localhost" if tls else "127.0.0.1", port)
    cl.loop_start()
    return cl


def edgesplit(name: str, port: int, tls: dict[str, str] | None) -> MqttTransport:
    # Sessions that end at disconnect, as raw paho's here: a kept session would queue every later measurement's messages.
    url = f"mqtts://localhost:{port}" if tls else f"mqtt://127.0.0.1:{port}"
    return MqttTransport(TransportConfig(broker_url=url, client_id=f"{name}-{time.monotonic_ns()}", username=tls["user"] if tls else None,
                                         password=tls["password"] if tls else None, ca_file=tls["ca"] if tls else None, session_expiry_s=0))


class Receiver:
    """The receiving end, subscribed once, in a thread or ``apart`` (this file run as a script): told how
    many messages (raw paho) or blobs (the transport) to take, it answers when it has them."""

    def __init__(self, who: str, port: int, tls: dict[str, str] | None, apart: bool) -> None:
        self.apart, self.cpu_s = apart, 0.0
        if apart:
            self.proc = subprocess.Popen([sys.executable, __file__, who, str(port), json.dumps(tls)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env={**os.environ, **NO_TRIM})
            self.expect: Callable[[int | None], None] = lambda count: print(count, file=self.proc.stdin, flush=True)
            self._answer: Callable[[], str] = lambda: self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        else:
            counts: queue.SimpleQueue[int | None] = queue.SimpleQueue()
            answers: queue.SimpleQueue[str] = queue.SimpleQueue()
            threading.Thread(target=serve, args=(who, port, tls, counts.get, answers.put), daemon=True).start()
            self.expect, self._answer = counts.put, lambda: answers.get(timeout=180)
        assert self._answer() == "ready", f"the {who} receiver did not start"

    def done(self) -> float:
        """Once it has them all: its CPU seconds since the last time when apart (ours count a thread's)."""
        total = float(self._answer())
        used, self.cpu_s = total - self.cpu_s, total
        return used if self.apart else 0.0

    def close(self) -> None:
        self.expect(None)
        if self.apart:
            self.proc.wait(30)


def serve(who: str, port: int, tls: dict[str, str] | None, counts: Callable[[], int | None], answer: Callable[[str], None]) -> None:
    """A :class:`Receiver`'s side: for each count, take that many, then answer its CPU seconds. Raw
    paho's messages are only counted, in its network thread, as raw paho's receiver would."""
    got, goal, arrived = [0], [0], threading.Event()

    def on_message(c: Any, u: Any, m: Any) -> None:
        got[0] += 1
        if got[0] >= goal[0]:
            arrived.set()

    if who == "raw":
        rx: Any = paho_client("rx", port, tls)
        rx.on_message = on_message
        rx.subscribe("bench/raw", qos=1)
    else:
        rx = edgesplit("rx", port, tls)
        rx.subscribe("bench/ours")
        rx.connect()
    time.sleep(0.3)
    answer("ready")
    while (count := counts()) is not None:
        goal[0] += count
        while who == "raw" and got[0] < goal[0]:
            arrived.wait(120) or sys.exit("raw paho's receiver timed out")
            arrived.clear()
        for _ in range(count if who == "ours" else 0):  # like the coordinator, take each blob as it completes and let it go
            rx.receive(120) or sys.exit("the transport's receiver timed out")
        answer(str(cpu_s()))
    rx.close() if who == "ours" else (rx.loop_stop(), rx.disconnect())


Sender = Callable[[int], tuple[int, Callable[[], object], Callable[[], object]]]


def raw_paho(port: int, tls: dict[str, str] | None) -> Sender:
    """Set up (untimed) a sender of ``total`` bytes: how many messages to expect, the timed send, the clean-up."""

    def setup(total: int) -> tuple[int, Callable[[], object], Callable[[], object]]:
        count, tx, block = total // CHUNK, paho_client("tx", port, tls), os.urandom(CHUNK)
        send = lambda: [info.wait_for_publish(60) for info in [tx.publish("bench/raw", block, qos=1) for _ in range(count)]]  # noqa: E731
        return count, send, lambda: (tx.loop_stop(), tx.disconnect())

    return setup


def ours(port: int, tls: dict[str, str] | None) -> Sender:
    def setup(total: int) -> tuple[int, Callable[[], object], Callable[[], object]]:
        tx, blob = edgesplit("tx", port, tls), os.urandom(BLOB_MB * 2**20)
        tx.connect()
        n = max(1, total // len(blob))
        # pipelined, as agents stream uploads
        return n, lambda: ([tx.publish("bench/ours", blob, wait=False) for _ in range(n)], tx.flush()), tx.close

    return setup


def paired(port: int, mb: int, repeats: int, tls: dict[str, str] | None, broker_pid: int,
           apart: bool = False) -> dict[str, list[tuple[float, float, float]]]:
    """Raw paho and the transport alternately, after one untimed warm-up of each (a pair measured back
    to back sees nearly the same load; CPU per MB depends on it less than wall time). ``apart``: each
    receiver in a process of its own. Each entry: (MB/s, client CPU ms / MB, broker CPU ms / MB)."""
    senders = {"raw": raw_paho(port, tls), "ours": ours(port, tls)}
    receivers = {who: Receiver(who, port, tls, apart) for who in senders}

    def once(who: str, megabytes: int) -> tuple[float, float, float]:
        count, send, close = senders[who](megabytes * 2**20)
        receivers[who].expect(count)
        clients0, broker0, start = cpu_s(), cpu_s(broker_pid), time.perf_counter()
        send()
        remote_s = receivers[who].done()
        elapsed, clients_s, broker_s = time.perf_counter() - start, cpu_s() - clients0 + remote_s, cpu_s(broker_pid) - broker0
        close()
        return megabytes / elapsed, 1000 * clients_s / megabytes, 1000 * broker_s / megabytes

    try:
        for who in senders:
            once(who, BLOB_MB)
        out: dict[str, list[tuple[float, float, float]]] = {"raw": [], "ours": []}
        for _ in range(repeats):
            for who in senders:
                out[who].append(once(who, mb))
        return out
    finally:
        for receiver in receivers.values():
            receiver.close()


def measure(mb: int, repeats: int) -> dict[str, Any]:
    # mosquitto reads its TLS files as the mosquitto user: a directory of its own, readable on the way to it.
    with tempfile.TemporaryDirectory(prefix="edgesplit-bench-") as name:
        (work := Path(name)).chmod(0o755)
        return measure_in(mb, repeats, work)


def measure_in(mb: int, repeats: int, work: Path) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"tcp_socket": [mb / tcp_copy(mb * 2**20) for _ in range(repeats)]}
    pairs = {}

    def both(mode: str, broker: LocalBroker, port: int, tls: dict[str, str] | None) -> None:
        try:  # in one process, then each receiver apart
            pairs[mode], pairs[f"{mode}_procs"] = (paired(port, mb, repeats, tls, broker.proc.pid, apart) for apart in (False, True))
        finally:
            broker.stop()

    port = free_port()
    conf = work / "plain.conf"  # mosquitto's in-flight default, no log file
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 100000\n")
    both("plain", LocalBroker(work / "plain", port, config_file=conf).start(), port, None)
    port, keys = free_port(), work / "keys"
    init_keys(KeysConfig(keys, ("bench",), port=port, bind="127.0.0.1"))
    conf = keys / "mosquitto.conf"
    conf.write_text(conf.read_text().replace("max_queued_messages 10000", "max_queued_messages 100000"))
    acl = keys / "acl"
    acl.write_text(acl.read_text() + "\nuser bench\ntopic readwrite bench/#\n")
    tls = {"user": "bench", "password": (keys / "secrets" / "bench.password").read_text().strip(), "ca": str(keys / "ca.crt")}
    both("tls", LocalBroker(work / "tls", port, config_file=conf).start(), port, tls)
    cpu: dict[str, dict[str, list[float]]] = {}
    for mode, both in pairs.items():
        for who, name in (("raw", f"paho_raw_{mode}"), ("ours", f"edgesplit_{mode}")):
            rates[name] = [r[0] for r in both[who]]
            cpu[name] = {"clients": [r[1] for r in both[who]], "broker": [r[2] for r in both[who]]}
    return summary(rates, cpu)


def summary(rates: dict[str, list[float]], cpu: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The medians, the ratios and the targets' verdicts of the recorded MB/s and CPU per MB (the
    verdicts on one process; ``*_apart`` on separate receivers, where measured)."""
    modes = [mode for mode in (*MODES, *PROCESS_MODES) if f"paho_raw_{mode}" in rates]
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_cpu = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in cpu.items()}
    raw_cpu = {mode: sum(med_cpu[f"paho_raw_{mode}"].values()) for mode in modes}
    ratios = {f"paho_over_edgesplit_{mode}": med[f"paho_raw_{mode}"] / med[f"edgesplit_{mode}"] for mode in modes}
    pair_ratios = {mode: [r / e for r, e in zip(rates[f"paho_raw_{mode}"], rates[f"edgesplit_{mode}"])] for mode in modes}
    cpu_ratio = {mode: sum(med_cpu[f"edgesplit_{mode}"].values()) / raw_cpu[mode] for mode in modes}
    verdicts = {suffix: {f"within_time_target{suffix}": all(ratios[f"paho_over_edgesplit_{m}"] <= TARGET_TIME_RATIO for m in group),
                         f"within_cpu_target{suffix}": all(cpu_ratio[m] <= TARGET_CPU_RATIO for m in group)}
                for suffix, group in (("", MODES), ("_apart", PROCESS_MODES)) if set(group) <= set(modes)}
    return {
        "mb_per_s": rates, "cpu_ms_per_mb": cpu, "median_mb_per_s": med, "median_cpu_ms_per_mb": med_cpu, "ratios": ratios,
        "pair_ratios": pair_ratios, "median_pair_ratio": {mode: statistics.median(v) for mode, v in pair_ratios.items()},
        "cpu_ratio_edgesplit_over_paho": cpu_ratio,
        "targets": {"time_ratio_max": TARGET_TIME_RATIO, "cpu_ratio_max": TARGET_CPU_RATIO},
        **{k: v for verdict in verdicts.values() for k, v in verdict.items()}, "digest": DIGEST_NAME,
    }


def test_transport(benchmark: Any, quick: bool) -> None:
    mb, repeats = SIZES[quick]
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(measure(mb, repeats)), rounds=1, iterations=1)
    benchmark.extra_info.update(
        megabytes=mb, repeats=repeats, chunk_bytes=CHUNK, blob_megabytes=BLOB_MB,
        method="raw paho and EdgeSplit measured alternately (one untimed warm-up each); medians over the repeats; "
               "ratios are raw paho MB/s over EdgeSplit MB/s, per pair and of the medians", **result)
    assert all(len(v) == repeats and min(v) > 0 for v in result["mb_per_s"].values())


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), lambda: int(line) if (line := sys.stdin.readline().strip()) not in ("", "None") else None,
          lambda text: print(text, flush=True))

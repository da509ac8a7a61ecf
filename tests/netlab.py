"""Test network lab: a network namespace joined to the host by a veth pair, shaped
with tc tbf, and a TCP proxy that adds latency and can cut a connection once.

Only addresses inside namespaces these helpers create are used (10.200.x.0/30).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field


class NetlabUnavailable(RuntimeError):
    """The kernel or the user cannot make namespaces here."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetlabUnavailable(f"{' '.join(cmd)}: {result.stderr.strip()}")


@dataclass
class Namespace:
    """``ns`` reaches the host at ``host_ip``; its own address is ``ns_ip``."""

    name: str = field(default_factory=lambda: f"es-{uuid.uuid4().hex[:6]}")
    subnet: int = 200
    rate: str = "10mbit"
    host_if: str = ""
    ns_if: str = ""

    @property
    def host_ip(self) -> str:
        return f"10.{self.subnet}.0.1"

    @property
    def ns_ip(self) -> str:
        return f"10.{self.subnet}.0.2"

    def __enter__(self) -> "Namespace":
        if os.geteuid() != 0:
            raise NetlabUnavailable("network namespaces need root")
        suffix = self.name[-6:]
        self.host_if, self.ns_if = f"esh{suffix}", f"esn{suffix}"
        _ip("ip", "netns", "add", self.name)
        try:
            _ip("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("ip", "link", "set", self.ns_if, "netns", self.name)
            _ip("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("ip", "link", "set", self.host_if, "up")
            _ip("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, ns=self.name)
            _ip("ip", "link", "set", self.ns_if, "up", ns=self.name)
            _ip("ip", "link", "set", "lo", "up", ns=self.name)
            # Shape both directions: the namespace's uplink and the host side's downlink.
            for dev, ns in ((self.ns_if, self.name), (self.host_if, None)):
                _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "32kbit", "latency", "400ms", ns=ns)
        except NetlabUnavailable:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]


class DelayProxy:
    """TCP proxy: listens on (host, port), forwards to ``upstream``, delays every
    piece of data by ``delay_s`` each way, and cuts the first connection that has
    carried ``cut_after_bytes`` upstream (once)."""

    def __init__(self, listen_host: str, upstream: tuple[str, int], delay_s: float = 0.05, cut_after_bytes: int | None = None) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.cut_after_bytes = cut_after_bytes
        self.cuts = 0
        self.bytes_up = 0
        self._lock = threading.Lock()
        self._server = socket.create_server((listen_host, 0))
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            conn = {"open": True, "bytes": 0}
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, conn, client, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, conn: dict, client: socket.socket, upstream: socket.socket) -> None:
        pending: list[tuple[float, bytes]] = []
        try:
            while conn["open"] and not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.01)
                if ready:
                    data = src.recv(65536)
                    if not data:
                        break
                    pending.append((time.monotonic() + self.delay_s, data))
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, data = pending.pop(0)
                    dst.sendall(data)
                    if up:
                        with self._lock:
                            self.bytes_up += len(data)
                            conn["bytes"] += len(data)
                            cut = self.cut_after_bytes is not None and self.cuts == 0 and conn["bytes"] >= self.cut_after_bytes
                            if cut:
                                self.cuts += 1
                        if cut:
                            conn["open"] = False
                            break
        except OSError:
            pass
        finally:
            conn["open"] = False
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

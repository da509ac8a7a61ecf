"""A mosquitto of our own on this machine: for ``edgesplit local``, the benchmarks
and the integration tests.

One way to start one: on a loopback port (a free one unless given), from a
config written into a working directory (or a given config file, used as is),
ready once the port accepts connections, stopped by its PID (SIGTERM, then
SIGKILL after a grace period). Production brokers are configured from
``deploy/`` and never started from here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BrokerNotFoundError", "BrokerStartError", "LocalBroker", "find_mosquitto", "free_port", "wait_for_port"]

#: Where Debian's package puts the binary when /usr/sbin is not on PATH (a non-root shell).
DEBIAN_MOSQUITTO = Path("/usr/sbin/mosquitto")


class BrokerNotFoundError(FileNotFoundError):
    """No mosquitto binary on this machine."""


class BrokerStartError(RuntimeError):
    """mosquitto exited at start, or did not listen in time."""


def find_mosquitto() -> str:
    """The mosquitto binary; BrokerNotFoundError naming how to install it."""
    binary = shutil.which("mosquitto") or (str(DEBIAN_MOSQUITTO) if DEBIAN_MOSQUITTO.exists() else None)
    if binary is None:
        raise BrokerNotFoundError("mosquitto not found: install it (apt-get install mosquitto; `make test` does) "
                                  "or point at a running broker (edgesplit local --broker URL)")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """Return once ``host:port`` accepts a connection; TimeoutError after ``timeout_s``,
    BrokerStartError at once if ``proc`` (the process meant to listen) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise BrokerStartError(f"the process meant to listen on {host}:{port} exited with code {proc.returncode}") from None
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


@dataclass
class LocalBroker:
    """A mosquitto process we own: started from a temporary config, stopped by PID."""

    workdir: Path
    port: int = 0  # 0: a free loopback port, chosen at the first start (kept across restarts)
    extra_config: str = ""  # appended to the generated config (e.g. "max_packet_size 65536\n")
    host: str = "127.0.0.1"
    config_file: Path | None = None  # use this config as is (e.g. the production config the key tool writes)
    log_types: tuple[str, ...] = ("error", "warning", "notice", "information")
    start_timeout_s: float = 10.0
    stop_grace_s: float = 10.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        if self.config_file is not None and self.port == 0:
            raise ValueError("a LocalBroker with its own config_file needs the port that config listens on")

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """mosquitto's log (generated configs only; a given config_file logs where it says)."""
        return self.workdir / "mosquitto.log"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / "mosquitto.stderr"

    def config_text(self) -> str:
        # max_inflight_messages 0 (no limit) and a deep queue: a run's burst of feature-map chunks
        # must not be throttled or dropped by the broker, whose defaults suit many small clients.
        return (
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            f"log_dest file {self.log_path}\n"
            + "".join(f"log_type {t}\n" for t in self.log_types)
            + "max_inflight_messages 0\n"
            "max_queued_messages 100000\n"
            + self.extra_config
        )

    def start(self) -> "LocalBroker":
        binary = find_mosquitto()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.port == 0:
            self.port = free_port(self.host)
        conf = self.config_file
        if conf is None:
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(self.config_text())
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            wait_for_port(self.host, self.port, self.start_timeout_s, self.proc)
        except (TimeoutError, BrokerStartError) as exc:
            self.stop()
            raise BrokerStartError(f"mosquitto did not start with {conf} ({exc}); its output: {self._output_tail()}") from None
        return self

    def _output_tail(self, chars: int = 1000) -> str:
        texts = []
        for path in (self.stderr_path, self.log_path):
            try:
                texts.append(path.read_text(errors="replace")[-chars:].strip())
            except OSError:
                continue  # not written (yet): nothing to show from it
        return " | ".join(t for t in texts if t) or "(none)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> "LocalBroker":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

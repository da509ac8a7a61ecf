"""Shared fixtures. ``mosquitto`` starts a real broker on a free loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def require_tools(*tools: str) -> None:
    """Skip the calling test (or fixture) when a command-line tool it needs is not on PATH,
    naming it: e.g. ``edgesplit keys init`` needs openssl and mosquitto_passwd."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH, which this machine lacks")


@dataclass
class Broker:
    """A mosquitto process we own: started from a temporary config, stopped by PID."""

    workdir: Path
    port: int
    extra_config: str = ""
    host: str = "127.0.0.1"
    config_file: Path | None = None  # use this config as is (e.g. the production config the key tool writes)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def start(self) -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(binary).exists():
            pytest.fail("mosquitto is not installed: run `make test` (it installs it) or apt-get install mosquitto")
        if self.config_file is not None:
            self.proc = subprocess.Popen([binary, "-c", str(self.config_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                wait_for_port(self.host, self.port)
            except TimeoutError:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None and self.proc.stderr else ""
                self.stop()
                raise TimeoutError(f"mosquitto did not start with {self.config_file}: {err[-1000:]}") from None
            return
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            f"log_dest file {self.log_path}\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            "max_inflight_messages 0\n"
            "max_queued_messages 100000\n"
            + self.extra_config
        )
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_port(self.host, self.port)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path, free_port())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()

"""The one way mosquitto is started here (launcher, benches, the ``mosquitto`` fixture)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from shared_protocol import local_broker
from shared_protocol.local_broker import BrokerNotFoundError, BrokerStartError, LocalBroker, free_port, wait_for_port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_fixture_broker_listens_on_loopback_from_a_temporary_config(mosquitto: LocalBroker, tmp_path: Path) -> None:
    assert mosquitto.host == "127.0.0.1" and mosquitto.url == f"mqtt://127.0.0.1:{mosquitto.port}"
    conf = (tmp_path / "mosquitto.conf").read_text()
    assert f"listener {mosquitto.port} 127.0.0.1" in conf and "persistence false" in conf
    assert _listening(mosquitto.port)


def test_start_picks_a_free_port_restart_keeps_it_and_stop_ends_the_process(tmp_path: Path) -> None:
    with LocalBroker(tmp_path, extra_config="max_packet_size 65536\n") as broker:
        port, pid = broker.port, broker.proc.pid  # type: ignore[union-attr]
        assert port > 0 and _listening(port)
        assert "max_packet_size 65536" in (tmp_path / "mosquitto.conf").read_text()
        broker.restart()
        assert broker.port == port and broker.proc is not None and broker.proc.pid != pid and _listening(port)
        pid = broker.proc.pid
    assert broker.proc is None and not _listening(port)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: no such process any more


def test_a_broker_that_cannot_start_says_why(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("no_such_option 1\n")
    port = free_port()
    with pytest.raises(BrokerStartError, match="did not start with .*bad.conf"):
        LocalBroker(tmp_path, port, config_file=bad, start_timeout_s=5).start()
    assert not _listening(port)
    with pytest.raises(ValueError, match="needs the port"):
        LocalBroker(tmp_path, config_file=bad)


def test_missing_mosquitto_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_broker.shutil, "which", lambda name: None)
    monkeypatch.setattr(local_broker, "DEBIAN_MOSQUITTO", tmp_path / "nowhere")
    with pytest.raises(BrokerNotFoundError, match="apt-get install mosquitto"):
        LocalBroker(tmp_path).start()


def test_wait_for_port_times_out_on_a_closed_port() -> None:
    with pytest.raises(TimeoutError, match="nothing listening"):
        wait_for_port("127.0.0.1", free_port(), timeout_s=0.3)

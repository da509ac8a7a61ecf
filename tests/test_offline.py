"""Nothing hangs offline: an agent without its dataset exits at once and says how to
get it, downloads happen only when asked for and give up quickly, and
``edgesplit local`` reports an agent that dies at start instead of waiting out the
server's registration timeout."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fldata.downloads as downloads
import fldata.loaders as loaders
from cloud_server.config import ServerConfig
from fldata import DOWNLOAD_TIMEOUT_S, DownloadError, load_dataset
from shared_protocol.mqtt.config import TransportConfig
from shared_protocol.tomlio import write_toml

ROOT = Path(__file__).resolve().parents[1]
FIXES = ("apt-get install dataset-fashion-mnist", "--data-root", "download = true")


def _env() -> dict[str, str]:
    # No proxy and an unroutable one for good measure: nothing here may reach a network.
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")


def test_offline_agent_without_its_dataset_exits_before_trying_the_broker_naming_the_fix(tmp_path: Path) -> None:
    """It gives up on the data before it would have finished trying to connect (the transport's
    connect timeout): a bound no loaded machine comes near, unlike a fixed number of seconds."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    config = tmp_path / "agent.toml"
    write_toml(config, {
        "agent": {"agent_id": "pi-1", "run_id": "offline", "broker_url": "mqtt://127.0.0.1:9"},
        "data": {"dataset": "fashion-mnist", "root": str(empty)},
    })
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config), "--no-progress"],
                            capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert elapsed < TransportConfig.connect_timeout_s, f"the agent took {elapsed:.1f} s to give up"
    for fix in FIXES:
        assert fix in output, f"{fix!r} missing from:\n{output}"


def test_data_root_flag_overrides_the_config(tmp_path: Path) -> None:
    from edge_agent.cli import build_parser, load_config

    config = tmp_path / "agent.toml"
    write_toml(config, {"agent": {"agent_id": "a"}, "data": {"root": "/nowhere"}})
    args = build_parser().parse_args(["run", "--config", str(config), "--data-root", str(tmp_path), "--download"])
    loaded = load_config(args)
    assert loaded.data.root == str(tmp_path)
    assert loaded.data.download is True
    plain = load_config(build_parser().parse_args(["run", "--config", str(config)]))
    assert plain.data.root == "/nowhere" and plain.data.download is False


def test_downloads_are_off_unless_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fetch(what: str, fetch: object) -> None:
        raise AssertionError(f"a download of {what} was attempted without download=True")

    monkeypatch.setattr(loaders, "_download", no_fetch)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", "train", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="download"):
        load_dataset("cifar10", "train", root=tmp_path)


def test_a_download_that_gets_no_answer_fails_quickly_with_its_own_error() -> None:
    seen: list[float | None] = []

    def stalled_fetch() -> None:
        seen.append(socket.getdefaulttimeout())
        raise socket.timeout("timed out")

    before = socket.getdefaulttimeout()
    with pytest.raises(DownloadError, match="apt-get install dataset-fashion-mnist"):
        downloads._download("Fashion-MNIST", stalled_fetch)
    assert seen == [DOWNLOAD_TIMEOUT_S]
    assert DOWNLOAD_TIMEOUT_S <= 30
    assert socket.getdefaulttimeout() == before


def test_watch_returns_at_once_with_the_log_tail_of_an_agent_that_died(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_server.launcher import _watch

    logs = tmp_path / "logs"
    logs.mkdir()
    # A server that would wait (for registrations) far longer than the test allows.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    with open(logs / "agent-0.log", "w") as f0, open(logs / "agent-1.log", "w") as f1:
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=f0, stderr=subprocess.STDOUT)
        dead = subprocess.Popen([sys.executable, "-c", "import sys; print('line 1'); print('FileNotFoundError: no data here'); sys.exit(2)"],
                                stdout=f1, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        code = _watch(server, [alive, dead], logs)
        elapsed = time.monotonic() - started
    finally:
        for p in (server, alive, dead):
            p.kill()
            p.wait()
    out = capsys.readouterr().out
    assert code == 2
    assert elapsed < 30  # the server and the live agent would run on for 60 s
    assert "agent-1 exited with code 2" in out
    assert "FileNotFoundError: no data here" in out
    assert "agent-0" not in out


@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(), reason="needs mosquitto")
def test_edgesplit_local_surfaces_an_agent_that_exits_at_start(tmp_path: Path) -> None:
    empty = tmp_path / "no-data"
    empty.mkdir()
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "cloud_server.launcher", "local", "--agents", "2", "--rounds", "1", "--data-root", str(empty),
         "--train-samples", "100", "--test-samples", "50", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=ServerConfig.registration_timeout_s + 60,
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "failed before the federation started" in output, output
    assert "apt-get install dataset-fashion-mnist" in output, output  # the agent's own words, from its log
    assert elapsed < ServerConfig.registration_timeout_s, f"took {elapsed:.0f} s: the server waited out its registration timeout"

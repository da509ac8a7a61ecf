"""A real deployment as docs/deploy.md describes it, on loopback: ``edgesplit keys init``
-> the TLS + password mosquitto it configures -> each device's bundle installed the way
deploy/edge/install.sh installs it (under a temporary root) -> ``edge-agent doctor`` ->
``cloud-server run`` and two ``edge-agent run`` with their own image folders (written by
``python -m fldata.export --format imagefolder``) -> a finished report. Then the three
mistakes a first deployment makes, each ending in a clear message and the configuration-error exit code:
a device with the wrong image size (refused at join, naming both shapes; the other device
completes; the report lists the refusal), a corrupt image file, a wrong password."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from shared_protocol.tomlio import read_toml, write_toml

from conftest import Broker, free_port, require_tools
from fedhelpers import FAST_GKT, child_pythonpath

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "deploy" / "edge" / "install.sh"
EXIT_CONFIG = 2
DEVICES = ("pi-a", "pi-b")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())


def _python(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(), cwd=cwd or ROOT, timeout=timeout)


class Deployment:
    """keys init's files, the broker they configure, and devices installed from bundles."""

    def __init__(self, base: Path, keys: Path, port: int) -> None:
        self.base, self.keys, self.port = base, keys, port

    def install(self, device: str, bundle: Path | None = None) -> Path:
        """install.sh --bundle into ``base/root-<device>``; returns the installed agent.toml."""
        root = self.base / f"root-{device}"
        root.mkdir(exist_ok=True)
        result = subprocess.run(["bash", str(INSTALL), "--config-only", "--root", str(root),
                                 "--bundle", str(bundle or self.keys / "bundles" / device)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        return root / "etc" / "edgesplit" / "agent.toml"

    def data_dir(self, device: str) -> Path:
        """Where install.sh made the device's data directory (/var/lib/edgesplit/data under its root)."""
        return self.base / f"root-{device}" / "var" / "lib" / "edgesplit" / "data"

    def agent(self, config: Path, device: str, log: Path) -> subprocess.Popen[bytes]:
        # The installed config as it is: install.sh --root pointed its /var/lib paths under the root.
        return subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(config), "--no-progress"],
                                stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), cwd=self.base)

    def server_toml(self, out: Path, **server: object) -> Path:
        """The generated server.toml with the edits docs/deploy.md asks for (rounds, the data
        contract), small settings for a test."""
        doc = read_toml(self.keys / "configs" / "server.toml")
        doc["server"].update({"rounds": 1, "out_dir": str(out), "registration_timeout_s": 60, "round_deadline_s": 120,
                              "device": "cpu", **server})
        doc["fedgkt"] = {**doc.get("fedgkt", {}), **FAST_GKT}
        path = out.parent / f"{out.name}-server.toml"
        write_toml(path, doc)
        return path


def _images(out: Path, **kw: str) -> None:
    """Two devices' image folders, as the docs make them."""
    args = {"--dataset": "synthetic", "--partition": "iid", "--agents": "2", "--names": ",".join(DEVICES),
            "--train-samples": "64", "--test-samples": "32", **kw}
    result = _python("-m", "fldata.export", "--format", "imagefolder", "--out", str(out), *[x for kv in args.items() for x in kv])
    assert result.returncode == 0, result.stderr


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    require_tools("openssl", "mosquitto_passwd")
    # mosquitto started as root reads its files as its own user: a traversable directory.
    base = Path(tempfile.mkdtemp(prefix="edgesplit-deploy-"))
    base.chmod(0o755)
    port = free_port()
    keys = base / "keys"
    made = _python("-m", "cloud_server.launcher", "keys", "init", "--agent-ids", ",".join(DEVICES), "--host", "localhost",
                   "--host", "127.0.0.1", "--port", str(port), "--run-id", "deploy", "--out", str(keys), timeout=120)
    assert made.returncode == 0, made.stderr
    broker = Broker(tmp_path, port, config_file=keys / "mosquitto.conf")
    broker.start()
    try:
        yield Deployment(base, keys, port)
    finally:
        broker.stop()
        shutil.rmtree(base, ignore_errors=True)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_documented_path_ends_in_a_finished_report(deployment: Deployment) -> None:
    d = deployment
    bundle = d.keys / "bundles" / "pi-a"
    assert sorted(p.name for p in bundle.iterdir()) == ["agent.password", "agent.toml", "ca.crt"]
    images = d.base / "images"
    _images(images)
    configs = {}
    for device in DEVICES:
        configs[device] = d.install(device)
        installed = configs[device].parent
        assert (installed / "agent.password").read_text() == (d.keys / "secrets" / f"{device}.password").read_text()
        shutil.copytree(images / device, d.data_dir(device), dirs_exist_ok=True)  # scp images to /var/lib/edgesplit/data
    # doctor against the real TLS broker, with the installed config as it is.
    state = d.base / "root-pi-a" / "var" / "lib" / "edgesplit" / "state"
    doctor = _python("-m", "edge_agent.cli", "doctor", "--config", str(configs["pi-a"]), cwd=d.base, timeout=120)
    lines = {line[7:].split()[0]: line for line in doctor.stdout.splitlines() if line.startswith("[")}
    for check in ("config", "credentials", "broker", "tls", "login", "data", "state"):
        assert lines[check].startswith("[ ok ]"), doctor.stdout
    assert str(state) in lines["state"], doctor.stdout  # the installed config's own state directory
    out = d.base / "run"
    server = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "run", "--config", str(d.server_toml(out)), "--no-progress"],
                              stdout=(d.base / "server.log").open("w"), stderr=subprocess.STDOUT, env=_env(), cwd=d.base)
    agents = [d.agent(configs[device], device, d.base / f"{device}.log") for device in DEVICES]
    try:
        assert _wait(server, 420) == 0, (d.base / "server.log").read_text()[-3000:]
        codes = [_wait(a, 60) for a in agents]
    finally:
        for p in (server, *agents):
            if p.poll() is None:
                p.kill()
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished", report["status"]
    assert report["rounds"][0]["status"] == "ok" and sorted(report["rounds"][0]["completed"]) == list(DEVICES)
    assert report["refused_agents"] == [] and report["totals"]["rejected_messages"] == 0
    assert codes == [0, 0], [(d.base / f"{x}.log").read_text()[-2000:] for x in DEVICES]


def test_mis_sized_device_is_refused_at_join_and_the_other_completes(deployment: Deployment) -> None:
    d = deployment
    _images(d.base / "images")
    _images(d.base / "big", **{"--dataset": "synthetic"})
    configs = {device: d.install(device) for device in DEVICES}
    shutil.copytree(d.base / "images" / "pi-a", d.data_dir("pi-a"), dirs_exist_ok=True)
    # pi-b's images are 48x48: enlarge the exported ones.
    from PIL import Image

    for path in (d.base / "big" / "pi-b").rglob("*.png"):
        target = d.data_dir("pi-b") / path.relative_to(d.base / "big" / "pi-b")
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as im:
            im.resize((48, 48)).save(target)
    out = d.base / "run"
    server = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "run", "--no-progress",
                               "--config", str(d.server_toml(out, min_agents=1, registration_timeout_s=25))],
                              stdout=(d.base / "server.log").open("w"), stderr=subprocess.STDOUT, env=_env(), cwd=d.base)
    bad = d.agent(configs["pi-b"], "pi-b", d.base / "pi-b.log")
    good = d.agent(configs["pi-a"], "pi-a", d.base / "pi-a.log")
    try:
        bad_code = _wait(bad, 240)
        assert _wait(server, 420) == 0, (d.base / "server.log").read_text()[-3000:]
        good_code = _wait(good, 60)
    finally:
        for p in (server, bad, good):
            if p.poll() is None:
                p.kill()
    bad_log = (d.base / "pi-b.log").read_text()
    assert bad_code == EXIT_CONFIG, bad_log[-3000:]
    assert "(3, 48, 48)" in bad_log and "(3, 32, 32)" in bad_log and "image_size" in bad_log, bad_log[-3000:]
    assert "Traceback" not in bad_log
    assert good_code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and report["rounds"][0]["completed"] == ["pi-a"]
    (refusal,) = report["refused_agents"]
    assert refusal["agent"] == "pi-b" and refusal["code"] == "data_mismatch" and "(3, 48, 48)" in refusal["reason"]


def test_corrupt_image_is_named_with_its_fix_and_the_configuration_error_code(deployment: Deployment) -> None:
    d = deployment
    _images(d.base / "images")
    config = d.install("pi-a")
    shutil.copytree(d.base / "images" / "pi-a", d.data_dir("pi-a"), dirs_exist_ok=True)
    victim = sorted((d.data_dir("pi-a") / "train").rglob("*.png"))[3]
    victim.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 10)
    agent = d.agent(config, "pi-a", d.base / "pi-a.log")
    code = _wait(agent, 120)
    output = (d.base / "pi-a.log").read_text()
    assert code == EXIT_CONFIG, output
    assert str(victim) in output and "delete it or replace it" in output and "Traceback" not in output, output
    doctor = _python("-m", "edge_agent.cli", "doctor", "--config", str(config), cwd=d.base, timeout=120)
    assert doctor.returncode == 1 and str(victim) in doctor.stdout, doctor.stdout


def test_wrong_password_missing_ca_and_wrong_port_name_their_fix(deployment: Deployment) -> None:
    d = deployment
    _images(d.base / "images")
    bundle = d.base / "bundle"
    shutil.copytree(d.keys / "bundles" / "pi-a", bundle)
    (bundle / "agent.password").write_text("not-the-password\n")
    config = d.install("pi-a", bundle)
    shutil.copytree(d.base / "images" / "pi-a", d.data_dir("pi-a"), dirs_exist_ok=True)

    def run(path: Path) -> tuple[int, str]:
        agent = d.agent(path, "pi-a", d.base / "pi-a.log")
        return _wait(agent, 120), (d.base / "pi-a.log").read_text()

    code, output = run(config)
    assert code == EXIT_CONFIG, output
    assert "Not authorized" in output and "password_file" in output and "secrets/<agent>.password" in output, output
    assert str(config) in output and "Traceback" not in output

    doc = read_toml(config)
    doc["agent"].pop("ca_file")
    no_ca = config.with_name("no-ca.toml")
    write_toml(no_ca, doc)
    code, output = run(no_ca)
    assert code == EXIT_CONFIG and "certificate verify failed" in output and "set ca_file" in output, output

    doc = read_toml(config)
    doc["agent"]["broker_url"] = f"mqtts://localhost:{free_port()}"
    wrong_port = config.with_name("wrong-port.toml")
    write_toml(wrong_port, doc)
    code, output = run(wrong_port)
    assert code == 1 and "nothing listens on that port" in output and "broker_url" in output, output

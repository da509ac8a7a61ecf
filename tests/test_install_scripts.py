"""deploy/edge/install.sh and deploy/server/install.sh: shellcheck-clean, and their
--dry-run plans pick the right wheels for the machine; the systemd units say what
the deployment guide promises."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EDGE = ROOT / "deploy" / "edge" / "install.sh"
SERVER = ROOT / "deploy" / "server" / "install.sh"


def plan(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "--dry-run", *args], capture_output=True, text=True, timeout=60)


def test_shellcheck_passes() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; `make test` installs it)")
    result = subprocess.run([shellcheck, "--severity=style", str(EDGE), str(SERVER)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", [EDGE, SERVER])
def test_scripts_are_executable_bash(script: Path) -> None:
    assert script.stat().st_mode & 0o111
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_edge_plan_on_a_pi_uses_the_pinned_torch_pair() -> None:
    result = plan(EDGE, "--arch", "aarch64")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "torch==2.3.1 torchvision==0.18.1 numpy\\<2" in out  # known to run on a Pi 4 (see the script's header)
    assert "download.pytorch.org" not in out  # PyPI's aarch64 wheels are CPU-only already
    assert "[edge]" in out.replace("\\[", "[").replace("\\]", "]")
    assert "useradd --system" in out and "/etc/systemd/system/edge-agent.service" in out
    assert "edge-agent doctor" in out


def test_edge_plan_on_x86_uses_the_cpu_wheel_index() -> None:
    out = plan(EDGE, "--arch", "x86_64").stdout
    assert "--index-url https://download.pytorch.org/whl/cpu" in out
    assert "torch torchvision" in out


def test_edge_plan_on_x86_offers_the_cuda_build_only_when_asked() -> None:
    default = plan(EDGE, "--arch", "x86_64")
    assert default.returncode == 0, default.stderr
    assert "torch (cpu build)" in default.stdout and "--index-url https://download.pytorch.org/whl/cpu" in default.stdout
    cuda = plan(EDGE, "--arch", "x86_64", "--torch-build", "cuda")
    assert cuda.returncode == 0, cuda.stderr
    assert "torch (cuda build)" in cuda.stdout
    assert "download.pytorch.org" not in cuda.stdout and "install -q torch torchvision" in cuda.stdout  # PyPI's default wheel
    assert "--torch-build cpu|cuda" in subprocess.run(["bash", str(EDGE), "--help"], capture_output=True, text=True).stdout


def test_edge_plan_refuses_a_cuda_build_on_a_pi_or_an_unknown_build() -> None:
    pi = plan(EDGE, "--arch", "aarch64", "--torch-build", "cuda")
    assert pi.returncode == 1 and "--torch-build cuda is for x86_64" in pi.stderr
    bad = plan(EDGE, "--arch", "x86_64", "--torch-build", "rocm")
    assert bad.returncode == 1 and "--torch-build must be cpu or cuda, got 'rocm'" in bad.stderr


def test_arm64_verification_script_is_shellcheck_clean_and_refuses_non_root() -> None:
    script = ROOT / "deploy" / "edge" / "verify-arm64.sh"
    assert script.stat().st_mode & 0o111 and script.read_text().startswith("#!/usr/bin/env bash\n")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:
        result = subprocess.run([shellcheck, "--severity=style", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    assert "deploy/edge/install.sh" in script.read_text()  # installs as on a Pi, with the same script
    help_text = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "--root DIR" in help_text.stdout


def test_edge_plan_for_the_lite_backend_installs_no_torch() -> None:
    result = plan(EDGE, "--arch", "x86_64", "--backend", "ort")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "install -q --no-deps onnxruntime-training-cpu==1.19.2" in out  # lean: no onnx/sympy/h5py on the device
    assert "torch" not in out.replace("no torch", "") and "download.pytorch.org" not in out
    assert "--backend ort" in out


def test_edge_plan_refuses_what_cannot_work() -> None:
    ort_on_pi = plan(EDGE, "--arch", "aarch64", "--backend", "ort")
    assert ort_on_pi.returncode == 1 and "no Linux aarch64 build" in ort_on_pi.stderr
    armv7 = plan(EDGE, "--arch", "armv7l")
    assert armv7.returncode == 1 and "64-bit" in armv7.stderr
    bad = plan(EDGE, "--backend", "tensorflow")
    assert bad.returncode == 1 and "torch or ort" in bad.stderr


def test_edge_plan_installs_given_credentials(tmp_path: Path) -> None:
    out = plan(EDGE, "--arch", "aarch64", "--config", "a.toml", "--password-file", "pi.password", "--ca-file", "ca.crt").stdout
    assert "install -m 0640 -o root -g edgesplit a.toml /etc/edgesplit/agent.toml" in out
    assert "install -m 0640 -o root -g edgesplit pi.password /etc/edgesplit/agent.password" in out
    assert "/etc/edgesplit/ca.crt" in out


def test_server_plan_cpu_and_gpu() -> None:
    cpu = plan(SERVER, "--host", "broker.example.org", "--agents", "pi-1,pi-2", "--gpu", "no")
    assert cpu.returncode == 0, cpu.stderr
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu.stdout
    assert "keys init --agent-ids pi-1\\,pi-2 --host broker.example.org --port 8883" in cpu.stdout
    assert "mosquitto.service.d/edgesplit.conf" in cpu.stdout and "cloud-server.service" in cpu.stdout
    gray = plan(SERVER, "--host", "b.example.org", "--agents", "pi-1", "--gpu", "no", "--in-channels", "1", "--image-size", "32x32")
    assert "--run-id default --in-channels 1 --image-size 32x32 --out /etc/edgesplit/broker" in gray.stdout, gray.stdout
    gpu = plan(SERVER, "--host", "broker.example.org", "--agents", "pi-1", "--gpu", "yes")
    assert "GPU yes" in gpu.stdout and "CUDA build" in gpu.stdout and "download.pytorch.org" not in gpu.stdout


def test_server_plan_needs_a_host_and_agents() -> None:
    no_host = plan(SERVER, "--agents", "pi-1")
    assert no_host.returncode == 1 and "--host is required" in no_host.stderr
    no_agents = plan(SERVER, "--host", "b.example.org")
    assert no_agents.returncode == 1 and "--agents is required" in no_agents.stderr


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


def test_edge_unit() -> None:
    u = unit(ROOT / "deploy" / "edge" / "edge-agent.service")
    service = u["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] == "edgesplit" and service["User"] != "root"
    assert "--config /etc/edgesplit/agent.toml" in service["ExecStart"]
    assert service["ReadOnlyPaths"] == "/etc/edgesplit" and service["NoNewPrivileges"] == "yes"
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_server_unit() -> None:
    service = unit(ROOT / "deploy" / "server" / "cloud-server.service")["Service"]
    assert service["Restart"] == "on-failure" and service["User"] == "edgesplit"
    assert "--config /etc/edgesplit/server.toml" in service["ExecStart"] and "--resume-if-checkpoint" in service["ExecStart"]


def test_units_verify_with_systemd_analyze_when_available(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    for path in (ROOT / "deploy" / "edge" / "edge-agent.service", ROOT / "deploy" / "server" / "cloud-server.service"):
        result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
        # Only syntax errors count: binaries and users of the target system do not exist here.
        bad = [line for line in result.stderr.splitlines() if "Unknown key" in line or "Invalid" in line or "Failed to parse" in line]
        assert not bad, bad


def test_edge_plan_installs_a_keys_init_bundle_as_it_is(tmp_path: Path) -> None:
    bundle = tmp_path / "pi-1"
    bundle.mkdir()
    for name in ("agent.toml", "agent.password", "ca.crt"):
        (bundle / name).write_text("x\n")
    out = plan(EDGE, "--arch", "aarch64", "--bundle", str(bundle)).stdout
    assert f"-g edgesplit {bundle}/agent.toml /etc/edgesplit/agent.toml" in out
    assert f"{bundle}/agent.password /etc/edgesplit/agent.password" in out and f"{bundle}/ca.crt /etc/edgesplit/ca.crt" in out
    (bundle / "ca.crt").unlink()
    missing = plan(EDGE, "--bundle", str(bundle))
    assert missing.returncode == 1 and "ca.crt is missing" in missing.stderr
    whole = plan(EDGE, "--root", str(tmp_path))
    assert whole.returncode == 1 and "--config-only" in whole.stderr


def test_edge_unit_does_not_restart_a_configuration_error() -> None:
    service = unit(ROOT / "deploy" / "edge" / "edge-agent.service")["Service"]
    assert set(service["RestartPreventExitStatus"].split()) == {"2", "3"}


def test_config_only_root_makes_the_root_and_points_the_installed_config_into_it(tmp_path: Path) -> None:
    """docs/deploy.md's trial: `install.sh --config-only --root /tmp/try --bundle pi-kitchen/`, then doctor
    and run with the installed config as it is: /tmp/try need not exist, and the config's data and state
    directories are the ones made under it (not the machine's /var/lib/edgesplit)."""
    from shared_protocol.tomlio import read_toml

    bundle = tmp_path / "pi-1"
    bundle.mkdir()
    (bundle / "agent.toml").write_text(
        '[agent]\nagent_id = "pi-1"\nbroker_url = "mqtts://localhost:8883"\npassword_file = "agent.password"\n'
        'ca_file = "ca.crt"\nstate_dir = "/var/lib/edgesplit/state"\n\n'
        '[data]\ndataset = "imagefolder"\nroot = "/var/lib/edgesplit/data"\npartition = "none"\n')
    (bundle / "agent.password").write_text("secret\n")
    (bundle / "ca.crt").write_text("x\n")
    root = tmp_path / "try" / "here"  # not there yet
    result = subprocess.run(["bash", str(EDGE), "--config-only", "--root", str(root), "--bundle", str(bundle)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    installed = read_toml(root / "etc" / "edgesplit" / "agent.toml")
    assert installed["agent"]["state_dir"] == str(root / "var" / "lib" / "edgesplit" / "state")
    assert installed["data"]["root"] == str(root / "var" / "lib" / "edgesplit" / "data")
    assert Path(installed["agent"]["state_dir"]).is_dir() and Path(installed["data"]["root"]).is_dir()
    assert installed["agent"]["password_file"] == "agent.password"  # credentials stay next to the config
    assert (root / "etc" / "edgesplit" / "agent.password").read_text() == "secret\n"
    # The real install (no --root) installs the bundle's config unchanged.
    out = plan(EDGE, "--arch", "aarch64", "--bundle", str(bundle)).stdout
    assert "sed -i" not in out

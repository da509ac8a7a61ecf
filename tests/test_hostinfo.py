"""One reading of the machine for agents, server, reports and benchmarks."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shared_protocol import hostinfo
from shared_protocol.hostinfo import HostInfo, cpu_model, host_info

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n"
# 64-bit Raspberry Pi OS: no "model name"; the SoC before the board.
PI_64 = "processor\t: 0\nBogoMIPS\t: 108.00\nCPU part\t: 0xd08\n\nHardware\t: BCM2835\nRevision\t: c03111\nModel\t\t: Raspberry Pi 4 Model B Rev 1.1\n"
PI_HARDWARE_ONLY = "processor\t: 0\nHardware\t: BCM2835\n"
# 32-bit kernels write "model name" per core as well as the board.
PI_32 = "processor\t: 0\nmodel name\t: ARMv7 Processor rev 3 (v7l)\n\nHardware\t: BCM2711\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n"


@pytest.mark.parametrize(("text", "expected"), [
    (X86, "Intel(R) Xeon(R) CPU @ 2.20GHz"),
    (PI_64, "Raspberry Pi 4 Model B Rev 1.1"),
    (PI_HARDWARE_ONLY, "BCM2835"),
    (PI_32, "ARMv7 Processor rev 3 (v7l)"),
])
def test_cpu_model_takes_the_best_name_cpuinfo_has(tmp_path: Path, text: str, expected: str) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert cpu_model(cpuinfo) == expected


def test_cpu_model_without_cpuinfo_falls_back_to_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostinfo.platform, "processor", lambda: "arm")
    assert cpu_model(tmp_path / "missing") == "arm"
    (tmp_path / "empty").write_text("processor\t: 0\nmodel name\t:\n")
    monkeypatch.setattr(hostinfo.platform, "processor", lambda: "")
    assert cpu_model(tmp_path / "empty") == (platform.machine() or "unknown")


def test_host_info_describes_this_machine() -> None:
    info = host_info()
    assert isinstance(info, HostInfo) and info.cpu_model == cpu_model()
    assert info.arch == platform.machine() and info.cores >= 1 and info.memory_bytes >= 0
    assert set(info.to_dict()) == {"cpu_model", "arch", "cores", "memory_bytes"}


def test_every_side_reads_the_same_helper() -> None:
    from cloud_server import device_meter, recorder

    # The coordinator and the centralized trainer describe their host through recorder.server_info.
    assert device_meter.cpu_model is cpu_model and recorder.cpu_model is cpu_model


def test_host_info_imports_no_torch() -> None:
    code = "import sys, shared_protocol.hostinfo as h; h.host_info(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"

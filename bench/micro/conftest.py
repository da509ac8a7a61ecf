"""The micro-benchmarks' shared options and fixtures: ``--quick`` (the small sizes that prove a
benchmark runs), what the machine was doing (recorded with every JSON), the workers' Python paths
and the agents' onnxruntime-training artifacts."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="the micro-benchmarks at small sizes (proves they run)")


@pytest.fixture(scope="session")
def quick(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--quick"))


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    import numpy
    import torch

    from cloud_server.experiments.results import machine

    # The machine is often shared: timings are read next to its load.
    machine_info.get("cpu", {}).pop("flags", None)  # a hundred CPU flags say nothing about these timings
    machine_info.update(machine(), load_average=list(os.getloadavg()), torch_threads=torch.get_num_threads(),
                        numpy=numpy.__version__, quick=bool(config.getoption("--quick")))


@pytest.fixture(scope="session")
def worker_envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The workers' PYTHONPATH: ``torch``: this venv's torch, or the CPU-only one that
    ``EDGESPLIT_TORCH_CPU_DIR`` names (e.g. its wheel unpacked; triton hidden, as in a CPU-only
    install); ``ort``: torch hidden, as on an ``edge-lite`` install."""
    sys.path.insert(0, str(ROOT / "tests"))
    from no_torch import write_blocker

    work = tmp_path_factory.mktemp("worker-envs")
    torch_path = [str(ROOT)]
    if os.environ.get("EDGESPLIT_TORCH_CPU_DIR"):
        torch_path = [str(write_blocker(work / "no_triton", ("triton",))), str(Path(os.environ["EDGESPLIT_TORCH_CPU_DIR"]).resolve()),
                      str(ROOT)]
    no_torch = str(write_blocker(work / "no_torch"))
    return {"torch": {"PYTHONPATH": os.pathsep.join(torch_path)}, "ort": {"PYTHONPATH": os.pathsep.join([no_torch, str(ROOT)])}}


@pytest.fixture(scope="session")
def ort_reply() -> Callable[[int], Any]:
    """The server's ``fedgkt.ort_artifacts`` message for images of ``in_channels`` channels
    (cloud_server/ort_artifacts.py, the default round config's edge model)."""
    server: list[Any] = []

    def reply(in_channels: int) -> Any:
        pytest.importorskip("onnxruntime.training", reason="the ort agent needs onnxruntime-training (the [edge-lite] extra)")
        from cloud_server.ort_artifacts import OrtArtifactServer
        from shared_protocol.methods.fedgkt_ort import GktOrtArtifacts, GktOrtArtifactsRequest

        server[:] = server or [OrtArtifactServer("bench", "resnet8", 10)]  # it caches what it generated
        msg = server[0].reply(GktOrtArtifactsRequest(run="bench", round=0, sender="bench", edge_model="resnet8",
                                                     in_channels=in_channels, image_size=32, num_classes=10))
        if not isinstance(msg, GktOrtArtifacts):
            raise RuntimeError(f"the server could not generate the ort artifacts: {msg.reason}")
        return msg

    return reply


@pytest.fixture(scope="session")
def ort_artifacts(tmp_path_factory: pytest.TempPathFactory, ort_reply: Callable[[int], Any]) -> Callable[[int], Path]:
    """Those artifacts as files, as an agent keeps them, with a ``meta.json``."""
    made: dict[int, Path] = {}

    def artifacts(in_channels: int) -> Path:
        if in_channels not in made:
            reply, directory = ort_reply(in_channels), tmp_path_factory.mktemp(f"artifacts-{in_channels}ch")
            for name, blob in reply.blobs().items():
                (directory / (name if name == "checkpoint" else f"{name}.onnx")).write_bytes(blob)
            (directory / "meta.json").write_text(json.dumps(reply.meta))
            made[in_channels] = directory
        return made[in_channels]

    return artifacts

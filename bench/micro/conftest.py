"""The micro-benchmarks' shared options: ``--quick`` (the small sizes that prove a benchmark
runs) and what the machine was doing, recorded with every JSON."""

from __future__ import annotations

import os
import sys
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

    from shared_protocol.hostinfo import cpu_model

    # The machine is often shared: timings are read next to its load.
    machine_info.get("cpu", {}).pop("flags", None)  # a hundred CPU flags say nothing about these timings
    machine_info.update(cpu_model=cpu_model(), cores=os.cpu_count(), load_average=list(os.getloadavg()),
                        torch=torch.__version__, torch_threads=torch.get_num_threads(), numpy=numpy.__version__,
                        quick=bool(config.getoption("--quick")))

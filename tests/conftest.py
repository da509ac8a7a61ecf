"""Shared fixtures. ``mosquitto`` starts a real broker on a free loopback port."""

from __future__ import annotations

import os
import shutil
import sys

# numpy's OpenBLAS on one thread, as each agent process of `edgesplit local` has (OMP_NUM_THREADS=1):
# here the agents are threads of the test process, and OpenBLAS's own threads spin while they wait
# for a core (FedKD's SVD codec was many times slower on two threads than on one, on a loaded
# machine). Set before anything imports numpy (a value already set is kept).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Under pytest-xdist (`make test`) several worker processes share the cores: one torch thread each
# (and for the processes they start), as `edgesplit local` gives each of its processes, rather than
# every worker spinning a thread per core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The broker every integration test talks to is the one edgesplit local and the benches start;
# tests import these three names from here.
from shared_protocol.local_broker import LocalBroker as Broker  # noqa: E402
from shared_protocol.local_broker import free_port, wait_for_port  # noqa: E402,F401


def require_tools(*tools: str) -> None:
    """Skip the calling test (or fixture) when a command-line tool it needs is not on PATH,
    naming it: e.g. ``edgesplit keys init`` needs openssl and mosquitto_passwd."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH, which this machine lacks")


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path).start()  # a free loopback port
    try:
        yield broker
    finally:
        broker.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most slow tests first. Under pytest-xdist (``make test``) a file runs in one
    worker, and files are handed out in this order: a long file left for last would keep one
    worker busy while the others idle."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's own order is kept

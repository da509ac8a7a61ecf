"""Shared helpers for the benchmark scripts: machine facts and atomic JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def machine() -> dict[str, Any]:
    """The runner's description of the machine, with what a timing is read next to: its load, the
    date, and torch's threads where the script uses torch."""
    import numpy

    from cloud_server.experiments.results import machine as runner_machine

    info = {**runner_machine(), "arch": platform.machine(), "numpy": numpy.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": os.getloadavg()}
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    return info


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")

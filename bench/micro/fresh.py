"""Measuring in fresh processes (peak RSS is a process's own): ``/proc`` figures, a worker script
run by a given Python with its ``PYTHONPATH``, its last stdout line read back as JSON. Imports
only the standard library, so that a worker of the ort agent runs without torch."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` figure (``VmHWM``, ``VmRSS``, ``RssFile``...) in bytes; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def run_worker(script: Path, argv: list[str], env: dict[str, str], python: str = sys.executable) -> dict[str, Any]:
    result = subprocess.run([python, str(script), *argv], capture_output=True, text=True, cwd="/",
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(argv)[:300]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def in_fresh_processes(benchmark: Any, rounds: int, script: Path, argv: list[str], env: dict[str, str],
                       python: str = sys.executable) -> list[dict[str, Any]]:
    """Time ``rounds`` fresh worker processes; their reports, summed up, in extra_info."""
    runs: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: runs.append(run_worker(script, argv, env, python)), rounds=rounds, iterations=1)
    benchmark.extra_info.update(runs=runs, **{f"{k}_max": max(r[k] for r in runs) for k in runs[0] if k.endswith("_bytes")})
    if "step_ms_median" in runs[0]:
        benchmark.extra_info["step_ms_median"] = statistics.median(r["step_ms_median"] for r in runs)
    return runs

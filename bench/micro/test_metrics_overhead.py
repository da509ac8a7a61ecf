"""What watching a run costs: ``make demo``'s run with metrics off and with ``edgesplit local
--metrics``, each round of a case one whole run (one mosquitto, one server and four agent
processes, one torch thread each). While a run is on, a thread here fetches the server's
/metrics, every agent's /metrics and the status page every 5 s (Prometheus's default is 15 s).

Per run, in ``extra_info["runs"]``: each round's wall time and server training seconds (from
the run's report), the CPU seconds of the whole process tree (``getrusage(RUSAGE_CHILDREN)``
around the launcher: exact), the load average before and after, and for an on run what every
endpoint says its metrics cost its process (``edgesplit_metrics_cpu_seconds_total``, thread CPU
time of serving and of the hooks; shared_protocol/metrics_http.py): their sum over the round time
bounds what the metrics can add to the rounds. ``micro_docs.metrics_verdict`` weighs the two
against the 2 % target. That nothing of the metrics code is imported when off is
``OFF_CHECK``'s to show.

    make bench-micro MICRO=metrics_overhead     # or: pytest bench/micro/test_metrics_overhead.py [--quick]
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: make demo's setting (the Makefile's demo target), and --quick's.
DEMO = {"method": "fedgkt", "agents": 4, "rounds": 6, "train_samples": 3000, "test_samples": 1000,
        "dataset": "fashion-mnist", "partition": "dirichlet:0.5", "seed": 0}
QUICK = {**DEMO, "agents": 2, "rounds": 1, "train_samples": 64, "test_samples": 32, "dataset": "synthetic", "partition": "iid"}
#: Runs per condition and seconds between two scrapes of every endpoint, full and --quick.
RUNS, SCRAPE_INTERVAL_S = {False: 3, True: 1}, {False: 5.0, True: 1.0}
OFF_CHECK = "tests/test_metrics.py::test_metrics_code_is_imported_only_when_on"
BANNER = "edgesplit: status page on "
SELF_COST_LINE = re.compile(r'^edgesplit_metrics_(cpu_seconds_total|requests_total)\{([^}]*)\} (\S+)$', re.M)


def command(setting: dict[str, Any], condition: str, run_id: str, out: Path) -> list[str]:
    """The ``edgesplit local`` command line of one run: make demo's, with --metrics when on."""
    cmd = [sys.executable, "-m", "cloud_server.launcher", "local", "--method", setting["method"], "--agents", str(setting["agents"]),
           "--rounds", str(setting["rounds"]), "--train-samples", str(setting["train_samples"]),
           "--test-samples", str(setting["test_samples"]), "--dataset", setting["dataset"], "--partition", setting["partition"],
           "--seed", str(setting["seed"]), "--run-id", run_id, "--out", str(out)]
    return cmd + (["--metrics"] if condition == "on" else [])


def endpoints(banner: str) -> dict[str, str]:
    """The URLs the launcher's --metrics banner names: the status page, the server's /metrics, each agent's /metrics."""
    urls = re.findall(r"status page on (\S+/) \(Prometheus metrics at (\S+)\)", banner)
    if not urls:
        raise ValueError(f"not a --metrics banner: {banner!r}")
    page, server_metrics = urls[0]
    return {"status_page": page, "server": server_metrics, **dict(re.findall(r"(agent-\d+) (\S+/metrics)", banner))}


def self_cost_of(text: str) -> dict[str, float]:
    """What one endpoint says its metrics cost its process so far: CPU seconds serving requests
    and updating metrics (by ``part``), and requests served."""
    out: dict[str, float] = {}
    for name, labels, number in SELF_COST_LINE.findall(text):
        part = re.search(r'part="(\w+)"', labels)
        if name == "requests_total":
            out["requests"] = float(number)
        elif part:
            out[f"{part.group(1)}_cpu_s"] = float(number)
    return out


def direct_cost(by_endpoint: dict[str, dict[str, float]], round_s: list[float]) -> dict[str, Any]:
    """The metrics code's own CPU seconds in every process (each endpoint's last scrape: the
    seconds after it, at most one interval, are missed) and their share of the summed round time."""
    cpu = {name: c.get("serve_cpu_s", 0.0) + c.get("update_cpu_s", 0.0) for name, c in by_endpoint.items()}
    total, rounds_total = sum(cpu.values()), sum(round_s)
    return {"by_endpoint": by_endpoint, "cpu_s_by_endpoint": cpu, "cpu_s_total": total, "round_time_total_s": rounds_total,
            "share_of_round_time": total / rounds_total if rounds_total > 0 and by_endpoint else None}


class Scraper(threading.Thread):
    """Every ``interval_s``: GET every endpoint once; each one's last self-reported cost kept."""

    def __init__(self, urls: dict[str, str], interval_s: float) -> None:
        super().__init__(name="scraper", daemon=True)
        self.urls, self.interval_s, self.stopped = urls, interval_s, threading.Event()
        self.counts = {name: {"ok": 0, "failed": 0, "bytes": 0} for name in urls}
        self.self_cost: dict[str, dict[str, float]] = {}

    def run(self) -> None:
        while not self.stopped.is_set():
            for name, url in self.urls.items():
                try:
                    with urllib.request.urlopen(url, timeout=10) as response:
                        body = response.read()
                except (urllib.error.URLError, OSError):  # not up yet (an agent loads its data first) or gone
                    self.counts[name]["failed"] += 1
                    continue
                self.counts[name]["ok"] += 1
                self.counts[name]["bytes"] += len(body)
                if name != "status_page":
                    self.self_cost[name] = self_cost_of(body.decode(errors="replace"))
            self.stopped.wait(self.interval_s)


def one_run(setting: dict[str, Any], condition: str, run_id: str, out: Path, interval_s: float) -> dict[str, Any]:
    """One ``edgesplit local`` run, scraped while it runs when on."""
    load_before, children_before = list(os.getloadavg()), resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = time.monotonic()
    proc = subprocess.Popen(command(setting, condition, run_id, out), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    scraper, tail = None, []
    for line in proc.stdout or []:
        tail = (tail + [line.rstrip()])[-20:]
        if condition == "on" and scraper is None and line.startswith(BANNER):
            scraper = Scraper(endpoints(line.strip()), interval_s)
            scraper.start()
    code, wall = proc.wait(), time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if scraper is not None:
        scraper.stopped.set()
        scraper.join(15)
    if code != 0 or not (out / "report.json").exists():
        raise RuntimeError(f"{run_id}: exit {code}\n" + "\n".join(tail))
    report = json.loads((out / "report.json").read_text())
    record: dict[str, Any] = {
        "run_id": run_id, "condition": condition, "status": report["status"],
        "round_s": [float(r["time_s"]["round"]) for r in report["rounds"]],
        "server_train_s": [float(r["time_s"]["server_train"]) for r in report["rounds"]],
        "run_wall_time_s": wall, "final_accuracy": report["totals"]["final_accuracy"],
        "cpu_s": {"tree_total": children.ru_utime - children_before.ru_utime + children.ru_stime - children_before.ru_stime},
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
    }
    if condition == "on":
        record["scrapes"] = {"endpoints": scraper.urls if scraper else {}, "per_endpoint": scraper.counts if scraper else {}}
        record["self_cost"] = direct_cost(scraper.self_cost if scraper else {}, record["round_s"])
    return record


@pytest.mark.parametrize("condition", ["off", "on"])
def test_demo(benchmark: Any, quick: bool, tmp_path: Path, condition: str) -> None:
    setting, interval, runs = QUICK if quick else DEMO, SCRAPE_INTERVAL_S[quick], []
    benchmark.pedantic(lambda: runs.append(one_run(setting, condition, f"overhead-{condition}-{len(runs)}",
                                                   tmp_path / f"run-{len(runs)}", interval)),
                       rounds=RUNS[quick], iterations=1)
    benchmark.extra_info.update(setting=setting, scrape_interval_s=interval, off_not_imported_checked_by=OFF_CHECK, runs=runs)

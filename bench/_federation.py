"""Run a federation (or a centralized reference) for a benchmark, in this process.

A real mosquitto on a free loopback port (as ``edgesplit local`` starts it),
the coordinator in a thread, and the agents as :class:`edge_agent.agent.EdgeAgent`
instances, each with its own MQTT connection, talking only through the broker.
Unlike ``edgesplit local`` the agents share one process and one compute lock
(as ``edge-agent simulate`` does): on a 2-core machine eight agent processes
would each start torch and fight for the cores, while here one agent trains at
a time with both cores. Bytes, FLOPs and accuracy are unaffected; per-agent
wall times are those of agents that take turns on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from cloud_server.assemble import build_server  # noqa: E402
from cloud_server.centralized import CentralizedTrainer  # noqa: E402
from cloud_server.config import ServerConfig  # noqa: E402
from edge_agent.agent import EdgeAgent, agent_data_spec  # noqa: E402
from edge_agent.config import DataConfig, EdgeConfig, MemoryConfig  # noqa: E402
from edge_agent.simulate import shards  # noqa: E402
from shared_protocol.hostinfo import host_info  # noqa: E402
from shared_protocol.local_broker import LocalBroker  # noqa: E402


@dataclass(frozen=True)
class DataSpec:
    """The data of every run in a benchmark: the same subset and partition for every method."""

    dataset: str = "fashion-mnist"
    partition: str = "iid"
    agents: int = 4
    train_samples: int = 1000
    test_samples: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.train_samples < self.agents or self.test_samples < 1:
            raise ValueError("need agents >= 1, train_samples >= agents and test_samples >= 1")


@dataclass(frozen=True)
class RunSpec:
    name: str  # a label for tables, e.g. "fedgkt-u8"
    method: str  # fedgkt | fedavg | splitnn | centralized
    method_config: dict[str, Any] = field(default_factory=dict)
    rounds: int = 5
    eval_every: int = 1
    target_accuracy: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # every agent's [memory] settings (edge_agent.config.MemoryConfig)
    server: dict[str, Any] = field(default_factory=dict)  # [server] keys set for this run (e.g. client_fraction)


def machine() -> dict[str, Any]:
    import torch

    host = host_info()
    return {"cpu_model": host.cpu_model, "arch": host.arch, "cores": host.cores, "python": platform.python_version(),
            "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_at_start": list(os.getloadavg())}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}", flush=True)


def _server_config(run: RunSpec, data: DataSpec, out: Path, broker_url: str) -> ServerConfig:
    # Every method of a run is scored on the same balanced held-out set: a seeded stratified
    # subset of the test split as large as the data's test subset (servers that predate the
    # field score on the agents' test shards instead).
    evaluation = {"eval_samples": data.test_samples} if "eval_samples" in ServerConfig.__dataclass_fields__ else {}
    settings: dict[str, Any] = dict(
        run_id=run.name, method=run.method, broker_url=broker_url, out_dir=str(out), expected_agents=data.agents,
        rounds=run.rounds, round_deadline_s=1800.0, registration_timeout_s=120.0, min_agents=1, min_fraction=0.5,
        eval_every=run.eval_every, target_accuracy=run.target_accuracy, dataset=data.dataset, seed=data.seed,
        progress=False, method_config=dict(run.method_config), **evaluation,
    )
    return ServerConfig(**{**settings, **run.server})


def run_centralized(run: RunSpec, data: DataSpec, out: Path) -> dict[str, Any]:
    config = dataclasses.replace(
        _server_config(run, data, out, "mqtt://127.0.0.1:1883"),  # no broker: the URL is never used
        method_config={**run.method_config, "train_samples": data.train_samples, "test_samples": data.test_samples},
    )
    return CentralizedTrainer(config).run()


def run_federation(run: RunSpec, data: DataSpec, out: Path, threads: int = 2, test_share: str = "own",
                   on_done: Any = None) -> dict[str, Any]:
    """One run over a fresh broker; returns the run report (also written to ``out``).

    ``test_share = "balanced"``: every agent's test share is the whole seeded test subset
    (label-balanced) instead of its partition's share, training shares unchanged; the run's
    accuracies are then those of each agent's pipeline on the balanced set. ``on_done(agents)``,
    if given, is called with the stopped :class:`EdgeAgent` instances (e.g. to keep their models)."""
    if test_share not in ("own", "balanced"):
        raise ValueError(f"test_share must be 'own' or 'balanced', got {test_share!r}")
    if run.method == "centralized":
        return run_centralized(run, data, out)
    broker = LocalBroker(out / "broker").start()
    url = broker.url
    try:
        config = _server_config(run, data, out, url)
        coordinator = build_server(config, device="cpu")
        base = DataConfig(dataset=data.dataset, partition=data.partition, num_agents=data.agents, seed=data.seed,
                          train_samples=data.train_samples, test_samples=data.test_samples)
        lock = threading.Lock()
        agents = []
        agent_shards = shards(base, data.agents)
        if test_share == "balanced":
            whole_test = agent_data_spec(base).subset()[1]
            agent_shards = [(train, whole_test) for train, _test in agent_shards]
        for i, shard in enumerate(agent_shards):
            cfg = EdgeConfig(agent_id=f"agent-{i}", run_id=run.name, broker_url=url, progress=False, threads=threads,
                             data=dataclasses.replace(base, agent_index=i), memory=MemoryConfig(**run.memory))
            agents.append(EdgeAgent(cfg, data=shard, compute_lock=lock))
        result: dict[str, Any] = {}
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                result.update(coordinator.run())
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors.append(exc)

        server = threading.Thread(target=serve, name="server", daemon=True)
        server.start()
        workers = [threading.Thread(target=a.run, name=a.config.agent_id, daemon=True) for a in agents]
        for t in workers:
            t.start()
        server.join()
        for a in agents:
            a.stop()
        for t in workers:
            t.join(30)
        if on_done is not None and not errors:
            on_done(agents)
        if errors:
            raise errors[0]
        return result
    finally:
        broker.stop()


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def round_series(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per round: accuracies (global on the balanced evaluation set, local on the agents' own
    test shards, and the edge models' where they differ from the deployed one; absent from
    reports that predate them), wire and payload bytes (server's connection, training), cumulative
    wire bytes, and the evaluation's own figures by label."""
    out, cumulative = [], 0
    for r in report["rounds"]:
        wire = r["bytes"]["up_wire"] + r["bytes"]["down_wire"]
        cumulative += wire
        evaluation = r.get("evaluation") or {}
        out.append({
            "round": r["round"], "status": r["status"], "accuracy": r["accuracy"], "local_accuracy": r.get("local_accuracy"),
            "edge_accuracy": r["edge_accuracy"], "edge_local_accuracy": r.get("edge_local_accuracy"),
            # The record's per-label accuracies (cloud_server/records.py: "accuracy" on the global
            # set, "local_accuracy" on the shards), named here by where they were measured.
            "evaluation": {mine: evaluation[theirs] for mine, theirs in (("global", "accuracy"), ("local", "local_accuracy"))
                           if theirs in evaluation},
            "up_wire": r["bytes"]["up_wire"], "down_wire": r["bytes"]["down_wire"],
            "up_payload": r["bytes"]["up_payload"], "down_payload": r["bytes"]["down_payload"],
            "wire": wire, "cumulative_wire": cumulative, "edge_train_flops": r["edge_train_flops"],
            "round_s": r["time_s"]["round"],
        })
    return out


# -- the seeded runs of the KD benches: keys, seeds, their evaluation set, wall time and budget -- #

#: The baselines' batch and partitions (the FedGKT paper's Table 1 setting, bench/experiments/table1.toml).
BATCH = 32
PARTITIONS = {"iid": "iid", "noniid": "dirichlet:0.5"}


def run_key(name: str, seed: int) -> str:
    """A run's key in the JSON and its directory: the run's name and its seed."""
    return f"{name}-seed{seed}"


def parse_seeds(text: str) -> list[int]:
    seeds = sorted({int(s) for s in text.replace(" ", "").split(",") if s != ""})
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds: a comma-separated list of seeds >= 0, got {text!r}")
    return seeds


def eval_set_of(results: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """The evaluation set the runs were scored on, and whether it is the same set for every
    run (by its ids' hash). None for runs that predate it."""
    sets = [r.get("eval_set") for r in results.values()]
    if not sets or any(s is None for s in sets):
        return None, False
    same = len({(s.get("ids_sha256"), s.get("images_sha256")) for s in sets}) == 1
    return sets[0], same


def budget(elapsed_s: float, minutes: float, complete: bool, named_scale: bool) -> dict[str, Any]:
    """The budget check: over budget as soon as the runs' total wall time exceeds it."""
    over = elapsed_s / 60 > minutes
    verdict = "over budget" if over else ("within budget" if complete else "incomplete (within budget so far)")
    return {"minutes": minutes, "wall_time_min": elapsed_s / 60, "complete": complete,
            "verdict": verdict if named_scale else f"{verdict} (custom scale: the budget is the named scale's)",
            "within_budget": (not over) if complete and named_scale else (False if over and named_scale else None)}


def elapsed_s(results: dict[str, Any]) -> tuple[float, str]:
    """The benchmark's wall time and what it is: the union of the runs' [start, end] intervals
    when every run recorded when it finished (runs of invocations made at the same time are
    counted once, not twice), else the sum of the runs' wall times."""
    if not results:
        return 0.0, "no runs"
    if any(r.get("finished_at") is None for r in results.values()):
        return sum(r["run_wall_time_s"] for r in results.values()), "the sum of the runs' wall times"
    intervals = sorted((r["finished_at"] - r["run_wall_time_s"], r["finished_at"]) for r in results.values())
    total, (start, end) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            total, start = total + (end - start), a
        end = max(end, b)
    total += end - start
    overlapped = total < sum(r["run_wall_time_s"] for r in results.values()) - 1.0
    return total, ("the time during which runs were going, the union of their intervals: runs made at the same time, "
                   "each slower for it, counted once" if overlapped else "the sum of the runs' wall times")

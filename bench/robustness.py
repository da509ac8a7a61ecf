"""One bad device of five: what it does to each method, with and without the defences
(cloud_server/robust.py), and what each aggregation rule costs on clean data.

Five agents on Fashion-MNIST (iid), one of which (``agent-4``) sends finite garbage: its
upload tensors are overwritten just before encoding (a hook on its ``send``; frames stay
well-formed), as the issue measured it:

* FedAvg: weights x 1e3; FedKD: SVD factors 1e10; FedGKT: feature maps 6e4, logits 1e30;
* per run: the defences on (the defaults: plausibility checks, quarantine) or off
  (``plausibility_checks = false``: what the aggregation rule alone does);
* FedAvg also for every ``[server] aggregation`` rule (f = 1), on clean data (the rule's
  cost in accuracy) and with the bad agent, checks off (the rule's own robustness).

Every figure comes from the run reports: final and per-round global accuracy (FedKD: the
global mentee), round statuses, refusals by reason, and the checkpoint's largest |weight|.

    python bench/robustness.py            # the whole table; about an hour on 2 shared cores
    python bench/robustness.py --quick    # FedAvg, mean, clean and x1e3 with the checks on: a smoke run

Writes ``bench/results/robustness.json`` (``--quick``: ``robustness_quick.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import RESULTS, machine, quiet_logs, write_json  # noqa: E402
from cloud_server.assemble import build_server  # noqa: E402
from cloud_server.config import ServerConfig  # noqa: E402
from edge_agent.agent import EdgeAgent  # noqa: E402
from edge_agent.config import DataConfig, EdgeConfig  # noqa: E402
from shared_protocol.local_broker import LocalBroker  # noqa: E402
from shared_protocol.messages import Message  # noqa: E402
from shared_protocol.methods.fedavg import FedAvgUpdate  # noqa: E402
from shared_protocol.methods.fedgkt import GktFeatures  # noqa: E402
from shared_protocol.methods.fedkd import FedKdUpdate  # noqa: E402

AGENTS = 5
BAD = f"agent-{AGENTS - 1}"
Corrupt = Callable[[Message], Message]


def _weights_x1e3(msg: Message) -> Message:
    if isinstance(msg, FedAvgUpdate):
        return dataclasses.replace(msg, weights={k: (v * 1e3).astype(v.dtype) for k, v in msg.weights.items()})
    return msg


def _factors_1e10(msg: Message) -> Message:
    return dataclasses.replace(msg, factors=np.full_like(msg.factors, 1e10)) if isinstance(msg, FedKdUpdate) else msg


def _maps_6e4(msg: Message) -> Message:
    if isinstance(msg, GktFeatures):
        return dataclasses.replace(msg, features=np.full_like(msg.features, 6e4))
    return msg


def _logits_1e30(msg: Message) -> Message:
    return dataclasses.replace(msg, logits=np.full_like(msg.logits, 1e30)) if isinstance(msg, GktFeatures) else msg


ATTACKS: dict[str, Corrupt | None] = {"none": None, "weights_x1e3": _weights_x1e3, "factors_1e10": _factors_1e10,
                                      "maps_6e4": _maps_6e4, "logits_1e30": _logits_1e30}
TABLES = {
    "fedavg": {"model": "resnet8", "batch_size": 32},
    "fedkd": {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32},
    "fedgkt": {"server_epochs": 1, "edge_epochs": 1, "server_batch_size": 32, "edge_batch_size": 32},
}
LABEL = {"fedavg": "model", "fedkd": "mentee", "fedgkt": "model"}


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    attack: str
    checks: bool = True
    aggregation: str = "mean"

    @property
    def name(self) -> str:
        return f"{self.method}-{self.attack}-{self.aggregation}-{'checks' if self.checks else 'nochecks'}"


def run_case(case: Case, rounds: int, train_samples: int, test_samples: int, work: Path) -> dict[str, Any]:
    out = work / case.name
    broker = LocalBroker(out / "broker").start()
    try:
        robust: dict[str, Any] = {"plausibility_checks": case.checks, "aggregation": case.aggregation}
        if case.aggregation != "mean":
            robust["aggregation_tolerate"] = 1
        config = ServerConfig(run_id=case.name[:60], method=case.method, broker_url=broker.url, out_dir=str(out / "run"),
                              expected_agents=AGENTS, rounds=rounds, round_deadline_s=1800.0, registration_timeout_s=120.0,
                              min_agents=1, dataset="fashion-mnist", eval_samples=test_samples, progress=False,
                              method_config=dict(TABLES[case.method]), **robust)
        coordinator = build_server(config, device="cpu")
        lock = threading.Lock()
        agents = []
        for i in range(AGENTS):
            data = DataConfig(dataset="fashion-mnist", partition="iid", num_agents=AGENTS, agent_index=i, seed=0,
                              train_samples=train_samples, test_samples=test_samples)
            agent = EdgeAgent(EdgeConfig(agent_id=f"agent-{i}", run_id=config.run_id, broker_url=broker.url, data=data,
                                         progress=False, threads=2), compute_lock=lock)
            corrupt = ATTACKS[case.attack]
            if corrupt is not None and agent.config.agent_id == BAD:
                honest_send = agent.send

                def send(msg: Message, *args: Any, _send: Any = honest_send, _corrupt: Corrupt = corrupt, **kw: Any) -> Any:
                    return _send(_corrupt(msg), *args, **kw)

                agent.send = send  # type: ignore[method-assign]
            agents.append(agent)
        report: dict[str, Any] = {}
        server = threading.Thread(target=lambda: report.update(coordinator.run()), daemon=True)
        server.start()
        workers = [threading.Thread(target=a.run, daemon=True) for a in agents]
        for t in workers:
            t.start()
        server.join()
        for a in agents:
            a.stop()
        for t in workers:
            t.join(30)
    finally:
        broker.stop()
    largest = None
    checkpoint = out / "run" / "checkpoint" / "method.npz"
    if checkpoint.exists():
        with np.load(checkpoint, allow_pickle=False) as npz:
            largest = max(float(np.max(np.abs(npz[k]))) for k in npz.files if npz[k].dtype.kind == "f" and npz[k].size)
    rounds_out = []
    for r in report.get("rounds", []):
        rounds_out.append({"round": r["round"], "status": r["status"],
                           "accuracy": (r.get("evaluation") or {}).get("accuracy", {}).get(LABEL[case.method]),
                           "refused": {a: {why: v["count"] for why, v in rs.items()}
                                       for a, rs in r.get("robustness", {}).get("refused", {}).items()},
                           "warnings": r.get("warnings", [])})
    return {**dataclasses.asdict(case), "status": report.get("status"), "rounds": rounds_out,
            "final_accuracy": rounds_out[-1]["accuracy"] if rounds_out else None, "largest_weight": largest}


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("fedavg", "none"), Case("fedavg", "weights_x1e3")]
    out = [Case("fedavg", a, checks) for a in ("none", "weights_x1e3") for checks in (True, False)]
    out += [Case("fedavg", a, False, rule) for rule in ("trimmed_mean", "median", "krum", "multi_krum")
            for a in ("none", "weights_x1e3")]
    out += [Case("fedkd", a, checks) for a in ("none", "factors_1e10") for checks in (True, False)]
    out += [Case("fedgkt", a, checks) for a in ("none", "maps_6e4", "logits_1e30") for checks in (True, False)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="FedAvg clean and x1e3, 2 rounds, few images: a smoke run")
    args = parser.parse_args(argv)
    quiet_logs()
    rounds, train, test = (2, 500, 200) if args.quick else (5, 3000, 500)
    work = Path(tempfile.mkdtemp(prefix="robustness-"))
    try:
        results = []
        for case in cases(args.quick):
            print(f"running {case.name}", flush=True)
            results.append(run_case(case, rounds, train, test, work))
            print(f"  final accuracy {results[-1]['final_accuracy']}, largest weight {results[-1]['largest_weight']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(RESULTS / ("robustness_quick.json" if args.quick else "robustness.json"), {
        "machine": machine(), "agents": AGENTS, "bad_agent": BAD, "rounds": rounds, "train_samples": train,
        "test_samples": test, "dataset": "fashion-mnist", "partition": "iid", "runs": results,
    })


if __name__ == "__main__":
    main()

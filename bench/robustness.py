"""One bad device of five: what it does to each method, with and without the defences
(cloud_server/robust.py), and what each aggregation rule costs on clean data.

Five agents on Fashion-MNIST (iid), one of which (``agent-4``) sends finite garbage: its
upload tensors are overwritten just before encoding (a hook on its ``send``; frames stay
well-formed):

* FedAvg (and FedGKD, the FedAvg family's aggregation): weights x 1e3; FedKD: SVD factors
  1e10; FedGKT: feature maps 6e4, logits 1e30;
* sign-flipped updates (FedAvg, FedGKD): the bad agent trains honestly, then sends
  ``global - SIGN_FLIP_SCALE x (w - global)``, its update negated and scaled (the
  sign-flipping attack of the Byzantine-robustness literature, e.g. Li et al. 2019, RSA);
  ``sign_flip`` flips every float tensor, BatchNorm's running statistics too (a negative
  variance: the model's loss is NaN); ``sign_flip_weights`` only the trainable parameters,
  the statistics as the agent trained them (the model is finite, only its weights are wrong);
* random labels (every method): the bad agent trains on its own shard with the labels
  shuffled (a seeded permutation; a hook on its data, not on its sends), and sends what it
  learnt honestly;
* per run: the defences on (the defaults: plausibility checks, quarantine) or off
  (``plausibility_checks = false``: what the aggregation rule alone does); FedAvg and FedGKD
  also with the direction check, off by default, turned on (``plausible_min_cosine = 0``),
  against the sign flip and on clean data;
* FedAvg also for every ``[server] aggregation`` rule (f = 1): on clean data (the rule's
  cost in accuracy next to the mean's), with each attack and the checks on, and with
  weights x1e3 and the checks off (the rule's own robustness).

Every figure comes from the run reports: final and per-round global accuracy (FedKD: the
global mentee; FedGKT: the server model), round statuses, refusals by reason, quarantine,
and the checkpoint's largest |weight|.

    python bench/robustness.py            # the whole table; about two hours on 2 shared cores
    python bench/robustness.py --resume   # go on after an interruption: skips the runs recorded
    python bench/robustness.py --quick    # FedAvg, mean, clean / x1e3 / sign flip / random labels: a smoke run

Writes ``bench/results/robustness.json`` (``--quick``: ``robustness_quick.json``; ``--out``
elsewhere) after every run, so an interrupted bench keeps what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import RESULTS, quiet_logs  # noqa: E402
from bench._runs import add_grid_arguments, run_grid  # noqa: E402
from cloud_server.assemble import build_server  # noqa: E402
from cloud_server.config import ServerConfig  # noqa: E402
from cloud_server.evaluation import EvalSet  # noqa: E402
from edge_agent.agent import EdgeAgent, load_agent_data  # noqa: E402
from edge_agent.config import DataConfig, EdgeConfig  # noqa: E402
from shared_protocol.local_broker import LocalBroker  # noqa: E402
from shared_protocol.messages import Message  # noqa: E402
from shared_protocol.methods.fedavg import FedAvgUpdate  # noqa: E402
from shared_protocol.methods.fedgkt import GktFeatures  # noqa: E402
from shared_protocol.methods.fedkd import FedKdUpdate  # noqa: E402

AGENTS = 5
BAD = f"agent-{AGENTS - 1}"
SIGN_FLIP_SCALE = 4.0  # the bad agent sends global - 4 (w - global): the mean of 4 honest updates and it is ~0
LABEL_SEED = 12345  # the permutation of the bad agent's labels (random_labels)
Corrupt = Callable[[EdgeAgent, Message], Message]


def _weights_x1e3(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, FedAvgUpdate):
        return dataclasses.replace(msg, weights={k: (v * 1e3).astype(v.dtype) for k, v in msg.weights.items()})
    return msg


def _held_global(agent: EdgeAgent, msg: FedAvgUpdate, attack: str) -> dict[str, np.ndarray]:
    """The global model the agent trained from (its method holds it: ``global_state``)."""
    method = agent.method
    base = getattr(method, "global_state", None)
    if base is None or getattr(method, "global_version", None) != msg.model_version:
        raise RuntimeError(f"{attack}: {agent.config.agent_id} does not hold global version {msg.model_version}")
    return base


def _flipped(base: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return (base - SIGN_FLIP_SCALE * (trained.astype(np.float64) - base)).astype(trained.dtype)


def _sign_flip(agent: EdgeAgent, msg: Message) -> Message:
    """The update (w - global) negated and scaled by SIGN_FLIP_SCALE, from the global model
    the agent trained from. Every float tensor, BatchNorm's running statistics too: a running
    variance goes negative, and the model's loss is NaN."""
    if not isinstance(msg, FedAvgUpdate):
        return msg
    base = _held_global(agent, msg, "sign_flip")
    return dataclasses.replace(msg, weights={k: _flipped(base[k], v) for k, v in msg.weights.items()})


def _sign_flip_weights(agent: EdgeAgent, msg: Message) -> Message:
    """As :func:`_sign_flip`, on the trainable parameters only (the agent's model's
    ``named_parameters``): BatchNorm's buffers (``running_mean``, ``running_var``; the integer
    ``num_batches_tracked``) are sent as the agent trained them, so the model it sends has a
    finite loss, and a check sees the flip, not a NaN."""
    if not isinstance(msg, FedAvgUpdate):
        return msg
    base = _held_global(agent, msg, "sign_flip_weights")
    model = getattr(agent.method, "model", None)
    if model is None:
        raise RuntimeError(f"sign_flip_weights: {agent.config.agent_id}'s method has no model to name its parameters")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if not trainable <= set(msg.weights):
        raise RuntimeError(f"sign_flip_weights: the update lacks parameters {sorted(trainable - set(msg.weights))[:5]}")
    return dataclasses.replace(msg, weights={k: _flipped(base[k], v) if k in trainable else v for k, v in msg.weights.items()})


def _factors_1e10(agent: EdgeAgent, msg: Message) -> Message:
    return dataclasses.replace(msg, factors=np.full_like(msg.factors, 1e10)) if isinstance(msg, FedKdUpdate) else msg


def _maps_6e4(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, GktFeatures):
        return dataclasses.replace(msg, features=np.full_like(msg.features, 6e4))
    return msg


def _logits_1e30(agent: EdgeAgent, msg: Message) -> Message:
    return dataclasses.replace(msg, logits=np.full_like(msg.logits, 1e30)) if isinstance(msg, GktFeatures) else msg


@dataclasses.dataclass(frozen=True)
class Attack:
    what: str  # for the table
    corrupt: Corrupt | None = None  # applied to every message the bad agent sends
    shuffle_labels: bool = False  # the bad agent trains on its shard with the labels permuted


ATTACKS: dict[str, Attack] = {
    "none": Attack("no bad agent (all five honest)"),
    "weights_x1e3": Attack("weights x 1e3", _weights_x1e3),
    "sign_flip": Attack(f"update negated and scaled x{SIGN_FLIP_SCALE:g}", _sign_flip),
    "sign_flip_weights": Attack(f"weights' update negated and scaled x{SIGN_FLIP_SCALE:g} (BatchNorm statistics honest)",
                                _sign_flip_weights),
    "random_labels": Attack("trains on shuffled labels", shuffle_labels=True),
    "factors_1e10": Attack("SVD factors 1e10", _factors_1e10),
    "maps_6e4": Attack("feature maps 6e4", _maps_6e4),
    "logits_1e30": Attack("logits 1e30", _logits_1e30),
}
TABLES = {
    "fedavg": {"model": "resnet8", "batch_size": 32},
    "fedgkd": {"model": "resnet8", "batch_size": 32},
    "fedkd": {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32},
    "fedgkt": {"server_epochs": 1, "edge_epochs": 1, "server_batch_size": 32, "edge_batch_size": 32},
}
LABEL = {"fedavg": "model", "fedgkd": "model", "fedkd": "mentee", "fedgkt": "model"}
RULES = ("mean", "trimmed_mean", "median", "krum", "multi_krum")


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    attack: str
    checks: bool = True
    aggregation: str = "mean"
    min_cosine: float | None = None  # [server] plausible_min_cosine for this run (None: the default)

    @property
    def name(self) -> str:
        direction = "" if self.min_cosine is None else f"-cos{self.min_cosine:g}"
        return f"{self.method}-{self.attack}-{self.aggregation}-{'checks' if self.checks else 'nochecks'}{direction}"

    @classmethod
    def of(cls, run: dict[str, Any]) -> "Case":
        """The case a recorded run ran (runs recorded before ``min_cosine`` existed ran the default)."""
        return cls(run["method"], run["attack"], run["checks"], run["aggregation"], run.get("min_cosine"))


def shuffled_labels(config: EdgeConfig) -> tuple[Any, Any]:
    """The agent's own train and test shards, the train labels permuted (seeded)."""
    train, test = load_agent_data(config)
    labels = np.random.default_rng(LABEL_SEED).permutation(train.labels)
    return dataclasses.replace(train, labels=labels), test


def run_case(case: Case, rounds: int, train_samples: int, test_samples: int, work: Path, partition: str = "iid",
             seed: int = 0, server: dict[str, Any] | None = None, name: str = "", threads: int = 2) -> dict[str, Any]:
    """One run of ``case``: its figures from the report and the checkpoint. ``partition`` and
    ``seed`` (the data's and the server's) and ``server`` (more ``[server]`` keys) are for the
    other benches that run this federation (bench/update_directions.py); ``threads``: torch's, for
    benches whose figures are not timings, on a shared machine."""
    out = work / (name or case.name)
    attack = ATTACKS[case.attack]
    started = time.monotonic()
    broker = LocalBroker(out / "broker").start()
    try:
        robust: dict[str, Any] = {"plausibility_checks": case.checks, "aggregation": case.aggregation}
        if case.aggregation != "mean":
            robust["aggregation_tolerate"] = 1
        if case.min_cosine is not None:
            robust["plausible_min_cosine"] = case.min_cosine
        robust.update(server or {})
        config = ServerConfig(run_id=(name or case.name)[:60], method=case.method, broker_url=broker.url, out_dir=str(out / "run"),
                              expected_agents=AGENTS, rounds=rounds, round_deadline_s=1800.0, registration_timeout_s=120.0,
                              min_agents=1, dataset="fashion-mnist", eval_samples=test_samples, progress=False,
                              seed=seed, method_config=dict(TABLES[case.method]), **robust)
        coordinator = build_server(config, device="cpu")
        lock = threading.Lock()
        agents = []
        for i in range(AGENTS):
            data = DataConfig(dataset="fashion-mnist", partition=partition, num_agents=AGENTS, agent_index=i, seed=seed,
                              train_samples=train_samples, test_samples=test_samples)
            edge = EdgeConfig(agent_id=f"agent-{i}", run_id=config.run_id, broker_url=broker.url, data=data,
                              progress=False, threads=threads)
            bad = edge.agent_id == BAD
            agent = EdgeAgent(edge, data=shuffled_labels(edge) if bad and attack.shuffle_labels else None,
                              compute_lock=lock)
            if bad and attack.corrupt is not None:
                honest_send = agent.send

                def send(msg: Message, *args: Any, _send: Any = honest_send, _agent: EdgeAgent = agent,
                         _corrupt: Corrupt = attack.corrupt, **kw: Any) -> Any:
                    return _send(_corrupt(_agent, msg), *args, **kw)

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
        robustness = r.get("robustness", {})
        rounds_out.append({"round": r["round"], "status": r["status"],
                           "accuracy": (r.get("evaluation") or {}).get("accuracy", {}).get(LABEL[case.method]),
                           "completed": sorted(r.get("completed", [])),
                           "excluded": sorted(r.get("excluded", {})),
                           "refused": {a: {why: v["count"] for why, v in rs.items()}
                                       for a, rs in robustness.get("refused", {}).items()},
                           "quarantine_excluded": robustness.get("quarantine_excluded", []),
                           "skipped_steps": robustness.get("skipped_steps", {}),
                           "clipped": robustness.get("clipped", {}),
                           "aggregation_used": (robustness.get("aggregation") or {}).get("used"),
                           # What the plausibility checks judged (every agent, refused or not).
                           "update_norms": (robustness.get("update_norms") or {}).get("agents", {}),
                           "update_cosines": (robustness.get("update_directions") or {}).get("agents", {}),
                           # The server's own judgement (cloud_server/robust_validation.py), when on.
                           "update_validation": robustness.get("update_validation"),
                           "label_agreement": robustness.get("label_agreement"),
                           "warnings": r.get("warnings", [])})
    return {**dataclasses.asdict(case), "status": report.get("status"), "eval_set": report.get("eval_set"), "rounds": rounds_out,
            "final_accuracy": rounds_out[-1]["accuracy"] if rounds_out else None, "largest_weight": largest,
            **summarise(rounds_out), "wall_s": round(time.monotonic() - started, 1)}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """What the table shows of a run's rounds: how many were ``ok``, refusals by agent and
    reason (summed over the rounds), the rounds the bad agent's upload was not used in
    (refused, quarantined or excluded), and whether every honest agent completed every round."""
    refusals: dict[str, dict[str, int]] = {}
    for r in rounds:
        for agent, reasons in r["refused"].items():
            for why, n in reasons.items():
                refusals.setdefault(agent, {})[why] = refusals.setdefault(agent, {}).get(why, 0) + n
    honest = [f"agent-{i}" for i in range(AGENTS) if f"agent-{i}" != BAD]
    return {"rounds_ok": sum(r["status"] == "ok" for r in rounds), "refusals": refusals,
            "bad_agent_unused_rounds": [r["round"] for r in rounds
                                        if BAD in r["excluded"] or BAD in r["quarantine_excluded"]],
            "honest_completed_every_round": bool(rounds) and all(set(honest) <= set(r["completed"]) for r in rounds)}


def cases(quick: bool) -> list[Case]:
    """The grid, clean runs first for each method, so a stopped bench has baselines for what it did."""
    if quick:
        return [Case("fedavg", a) for a in ("none", "weights_x1e3", "sign_flip", "random_labels")]
    out = [Case("fedavg", a, checks) for a in ("none", "weights_x1e3", "sign_flip", "random_labels")
           for checks in (True, False)]
    out += [Case("fedkd", a, checks) for a in ("none", "factors_1e10") for checks in (True, False)]
    out += [Case("fedgkt", "none")]
    out += [Case("fedavg", "none", True, rule) for rule in RULES[1:]]  # each rule's cost on clean data
    out += [Case("fedavg", "sign_flip", True, rule) for rule in RULES[1:]]
    out += [Case("fedgkt", a) for a in ("maps_6e4", "logits_1e30")]
    out += [Case("fedgkd", "none"), Case("fedgkd", "weights_x1e3"), Case("fedgkd", "sign_flip"),
            Case("fedgkd", "sign_flip", True, "median"), Case("fedgkd", "none", True, "median")]
    out += [Case("fedgkt", a, False) for a in ("maps_6e4", "logits_1e30")]
    out += [Case("fedgkd", "weights_x1e3", False), Case("fedgkt", "random_labels"), Case("fedkd", "random_labels")]
    out += [Case("fedavg", "random_labels", True, rule) for rule in RULES[1:]]
    out += [Case("fedavg", "weights_x1e3", False, rule) for rule in RULES[1:]]  # a rule alone, no checks
    out += [Case("fedgkt", "none", False)]  # the clean run with the checks off (FedAvg's and FedKD's: identical)
    # The direction check, off by default (bench/results/update_directions.json), turned on at
    # 0, as a fleet whose data is close to IID may: against the sign flip, and its clean runs.
    out += [Case(m, a, True, "mean", 0.0) for m in ("fedavg", "fedgkd") for a in ("none", "sign_flip")]
    # The weights-only flip: what the defaults, the median and the direction check do when the
    # flipped model is finite (its scores on a validation set: bench/defence_scores.py).
    out += [Case("fedavg", "sign_flip_weights"), Case("fedavg", "sign_flip_weights", True, "median"),
            Case("fedavg", "sign_flip_weights", True, "mean", 0.0)]
    return out


def _resumed_machine(previous: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The machine as the first invocation found it; the date its runs started."""
    first = previous.get("machine", {})
    return {**previous.get("machine", now), "runs_started_utc": first.get("runs_started_utc") or first.get("date_utc")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="FedAvg clean, x1e3, sign flip, random labels; 2 rounds, few images: a smoke run")
    add_grid_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/robustness.json (--quick: robustness_quick.json)")
    args = parser.parse_args(argv)
    quiet_logs()
    rounds, train, test = (2, 500, 200) if args.quick else (5, 3000, 500)
    out_path = args.out or RESULTS / ("robustness_quick.json" if args.quick else "robustness.json")
    scale = {"agents": AGENTS, "bad_agent": BAD, "rounds": rounds, "train_samples": train, "test_samples": test,
             "dataset": "fashion-mnist", "partition": "iid", "seed": 0}

    # The server's global test set, as every run's report describes it (the same spec for all).
    spec = ServerConfig(run_id="robustness", method="fedavg", dataset=scale["dataset"], eval_samples=test).eval_set_spec()
    loaded = EvalSet.load(spec)
    eval_set = loaded.describe() if loaded is not None else None

    def head(started: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"benchmark": "robustness", "generated_by": "bench/robustness.py" + (" --quick" if args.quick else ""),
                "machine": started, **scale, "sign_flip_scale": SIGN_FLIP_SCALE, "label_seed": LABEL_SEED,
                "method_config": TABLES, "attacks": {k: a.what for k, a in ATTACKS.items()},
                "eval_set": eval_set, "eval_set_same_for_every_run": all(r.get("eval_set") in (None, eval_set) for r in runs)}

    def run_one(case: Case, work: Path) -> dict[str, Any]:
        r = run_case(case, rounds, train, test, work)
        print(f"  final accuracy {r['final_accuracy']}, rounds ok {r['rounds_ok']}/{rounds}, refusals {r['refusals']}, "
              f"largest weight {r['largest_weight']}, {r['wall_s']} s", flush=True)
        return r

    run_grid(cases(args.quick), run_one, out_path, scale, head, resume=args.resume, only=args.only,
             recorded_name=lambda r: Case.of(r).name, resumed_machine=_resumed_machine, work_prefix="robustness-")

if __name__ == "__main__":
    main()

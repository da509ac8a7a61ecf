"""Pilots for the KD-methods bench's regime (bench/kd_methods.py): which model
and which scale let FedAvg learn at Dirichlet(0.1) on 2 CPU cores?

The bench's first full scale (GroupNorm ResNet-8, 20 agents, 4 a round, 5,000 Fashion-MNIST
images, 2 local epochs, SGD 0.05, 20 rounds) left FedAvg's global model at chance on the
balanced set at Dir(0.1) in every evaluated round, predicting one class, while its agents'
local figures rose (the ``base`` row of bench/results/kd_pilots.json). Each pilot here is one
run of ``kd_methods`` (FedAvg unless it names another) at the bench's full scale of the day with named changes (model, local epochs,
learning rate, training images, rounds; each row's ``scale`` says what ran), so what the
regime needs is measured, not guessed: FedGKD's Sec. 5.1 tunes FedAvg's learning rate in
{0.1, 0.05, 0.01}, and the papers train 10-20 local epochs on 500-4,000 images a client for
40-100 rounds (FedDistill Table I, FedGKD Sec. 5.1, FedBE Sec. 5.1 / B.1).

``--centralized`` runs the same model on the union of the agents' images instead (one
process, no broker; a "round" is one epoch), scored on the same balanced evaluation set:
how fast the model itself learns here, apart from federation.

    python bench/kd_pilots.py e10-lr0.05:local_epochs=10,lr=0.05
    python bench/kd_pilots.py cnn-e10:model=simplecnn,local_epochs=10 --partition iid
    python bench/kd_pilots.py --centralized central-cnn:model=simplecnn,rounds=3
    python bench/kd_pilots.py time-fedkd:method=fedkd
    python bench/kd_pilots.py --partition dir0.1 --seed 0 NAME:KEY=VALUE,... [...]

Keys: ``local_epochs``, ``rounds``, ``train_samples``, ``eval_every`` (the scale's), ``lr``
(the shared local training's), ``model`` (a registry name; default: the bench's ``MODEL``)
and ``method`` (a run of the bench, ``kd_methods.METHODS``: default ``fedavg``; the other
runs' pilots time them at a scale). Each finished pilot is added to ``bench/results/kd_pilots.json`` (name, kind,
model, changes, per-round global and local accuracy, wall and CPU seconds, load average),
replacing a pilot of the same name, kind, partition and seed. ``--quick`` runs on the bench's
quick scale (synthetic data; the test suite's check of this pipeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import kd_methods
from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, round_series, run_federation, write_json

from models import list_models

SCALE_KEYS = ("local_epochs", "rounds", "train_samples", "eval_every")
LOCAL_KEYS = ("lr",)
MODEL_KEY = "model"
METHOD_KEY = "method"
KEYS = SCALE_KEYS + LOCAL_KEYS + (MODEL_KEY, METHOD_KEY)
KINDS = ("federated", "centralized")


def parse_pilot(text: str) -> tuple[str, dict[str, float | str]]:
    """``"name:key=value,key=value"`` -> (name, {key: value}); unknown keys, non-numbers and
    unregistered models are refused."""
    name, _, changes = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"a pilot is NAME:KEY=VALUE,...; got {text!r}")
    out: dict[str, float | str] = {}
    for item in filter(None, changes.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            raise argparse.ArgumentTypeError(f"pilot {name!r}: {item!r} is not KEY=VALUE with KEY in {KEYS}")
        if key == MODEL_KEY:
            if value not in list_models():
                raise argparse.ArgumentTypeError(f"pilot {name!r}: model {value!r} is not registered; the models are {list_models()}")
            out[key] = value
            continue
        if key == METHOD_KEY:
            if value not in kd_methods.METHODS:
                raise argparse.ArgumentTypeError(f"pilot {name!r}: method {value!r} is not a run of the bench; the runs are {list(kd_methods.METHODS)}")
            out[key] = value
            continue
        try:
            out[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"pilot {name!r}: {key} needs a number, got {value!r}") from None
    return name, out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pilot_run(changes: dict[str, float | str], partition: str, kind: str, scale_name: str = "full") -> tuple[kd_methods.Scale, RunSpec, dict[str, Any]]:
    """(scale, run, local training) of one pilot: ``kd_methods``' run ``method`` (default
    FedAvg) of ``partition`` at the scale with ``changes`` (FedKD: ``model`` is the mentee,
    ``lr`` both models'); centralized: the model and optimiser on the union of the agents'
    images, one epoch a round."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    method = str(changes.get(METHOD_KEY, "fedavg"))
    if kind == "centralized" and method != "fedavg":
        raise ValueError(f"a centralized pilot trains one model with the bench's local training; method={method!r} is a federated run")
    scale = dataclasses.replace(kd_methods.SCALES[scale_name], **{k: int(v) for k, v in changes.items() if k in SCALE_KEYS})
    local = {**kd_methods.LOCAL, **{k: float(v) for k, v in changes.items() if k in LOCAL_KEYS}}
    _, _, run = next(p for p in kd_methods.plan(scale) if p[0] == partition and p[1] == method)
    if kind == "centralized":
        config = {"model": str(changes.get(MODEL_KEY, run.method_config["model"])), "epochs_per_round": 1, "augment": False,
                  **{k: local[k] for k in ("optimizer", "lr", "momentum", "weight_decay", "batch_size")}}
        return scale, RunSpec(run.name.replace("fedavg", "centralized"), "centralized", config, scale.rounds, eval_every=scale.eval_every), local
    config = dict(run.method_config)
    if MODEL_KEY in changes:
        config["mentee_model" if method == "fedkd" else "model"] = str(changes[MODEL_KEY])
    if "lr" in changes:
        config.update({"mentor_lr": local["lr"], "mentee_lr": local["lr"]} if method == "fedkd" else {"lr": local["lr"]})
    return scale, dataclasses.replace(run, method_config=config), local


def run_pilot(name: str, changes: dict[str, float | str], partition: str, seed: int, run_dir: Path,
              kind: str = "federated", scale_name: str = "full") -> dict[str, Any]:
    scale, run, local = pilot_run(changes, partition, kind, scale_name)
    data = DataSpec(scale.dataset, kd_methods.PARTITIONS[partition], scale.agents, scale.train_samples, scale.test_samples, seed=seed)
    load_before, started, cpu = list(os.getloadavg()), time.monotonic(), _cpu_s()
    report = run_federation(run, data, run_dir / f"{name}-{kind}-{partition}-seed{seed}")
    series = round_series(report)
    return {
        "name": name, "kind": kind, "changes": changes, "partition": partition if kind == "federated" else None, "seed": seed,
        "run": str(changes.get(METHOD_KEY, "fedavg")) if kind == "federated" else "centralized", "method": run.method,
        "model": run.method_config.get("model", run.method_config.get("mentee_model")), "method_config": run.method_config,
        "scale": {**{k: getattr(scale, k) for k in ("dataset", "agents", "client_fraction", "train_samples", "test_samples", "rounds",
                                                     "eval_every", "local_epochs")}, "local_training": {**local, "local_epochs": scale.local_epochs}},
        "status": report["status"], "final_accuracy": report["totals"]["final_accuracy"],
        "best_accuracy": report["totals"].get("best_accuracy"),
        "accuracy_by_round": [[r["round"], r["accuracy"]] for r in series if r["accuracy"] is not None],
        "local_accuracy_by_round": [[r["round"], r["local_accuracy"]] for r in series if r["local_accuracy"] is not None],
        "edge_train_flops": report["totals"].get("edge_train_flops"), "wire_total_bytes": report["totals"].get("wire_total"),
        "wall_s": time.monotonic() - started, "cpu_s": _cpu_s() - cpu,
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pilots", nargs="+", type=parse_pilot, help="NAME:KEY=VALUE,... (keys: %s)" % ", ".join(KEYS))
    parser.add_argument("--partition", default="dir0.1", choices=list(kd_methods.PARTITIONS))
    parser.add_argument("--centralized", action="store_true", help="train the model on the union of the agents' images instead")
    parser.add_argument("--quick", action="store_true", help="the bench's quick scale (synthetic data): the pipeline check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kd_pilots.json")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "kd_pilots")
    args = parser.parse_args(argv)
    quiet_logs()
    kind = "centralized" if args.centralized else "federated"
    for name, changes in args.pilots:
        print(f"== pilot {name} ({kind}) {changes} ({args.partition}, seed {args.seed})", flush=True)
        done = run_pilot(name, changes, args.partition, args.seed, args.run_dir, kind, "quick" if args.quick else "full")
        doc = json.loads(args.out.read_text()) if args.out.exists() else {
            "benchmark": "kd_pilots", "description": __doc__.splitlines()[0], "base": "bench/kd_methods.py's full scale, FedAvg",
            "pilots": []}
        doc["description"] = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's first paragraph
        doc["base"] = "bench/kd_methods.py's full scale and runs (FedAvg unless a pilot names its method), with each pilot's changes"
        for p in doc["pilots"]:
            p.setdefault("kind", "federated")  # the pilots recorded before there were centralized ones
        same = (name, kind, done["partition"], args.seed)
        doc["pilots"] = [p for p in doc["pilots"] if (p["name"], p["kind"], p["partition"], p["seed"]) != same]
        doc["pilots"].append(done)
        doc["machine"] = machine()
        write_json(args.out, doc)
        print(f"   final {done['final_accuracy']}, best {done['best_accuracy']}, {done['wall_s']:.0f} s: "
              f"{[a for _, a in done['accuracy_by_round']]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

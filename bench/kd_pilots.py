"""Pilots for the KD-methods bench's regime (bench/kd_methods.py, issue 24): does FedAvg's
GroupNorm ResNet-8 leave chance at Dirichlet(0.1) at a scale 2 CPU cores can run?

The bench's full scale (20 agents, 4 a round, 5,000 Fashion-MNIST images, 2 local epochs,
SGD 0.05, 20 rounds) left FedAvg's global model at 10.0 % on the balanced set at Dir(0.1)
in every evaluated round, predicting one class, while its agents' local figures rose. Each
pilot here is one run of ``kd_methods``' FedAvg at that scale with named changes (local
epochs, learning rate, training images, rounds), so what the regime needs is measured, not
guessed: FedGKD's Sec. 5.1 tunes FedAvg's learning rate in {0.1, 0.05, 0.01}, and the papers
train 20 local epochs on 2,500 images a client for 100 rounds, which 2 cores cannot.

    python bench/kd_pilots.py e10-lr0.05:local_epochs=10,lr=0.05
    python bench/kd_pilots.py --partition dir0.1 --seed 0 NAME:KEY=VALUE,... [...]

Keys: ``local_epochs``, ``rounds``, ``train_samples``, ``eval_every`` (the scale's) and ``lr``
(the shared local training's). Each finished pilot is added to
``bench/results/kd_pilots.json`` (name, changes, per-round global and local accuracy, wall
and CPU seconds, load average), replacing a pilot of the same name, partition and seed.
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
from _federation import REPO_ROOT, RESULTS, DataSpec, machine, quiet_logs, round_series, run_federation, write_json

SCALE_KEYS = ("local_epochs", "rounds", "train_samples", "eval_every")
LOCAL_KEYS = ("lr",)


def parse_pilot(text: str) -> tuple[str, dict[str, float]]:
    """``"name:key=value,key=value"`` -> (name, {key: value}); unknown keys are refused."""
    name, _, changes = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"a pilot is NAME:KEY=VALUE,...; got {text!r}")
    out: dict[str, float] = {}
    for item in filter(None, changes.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in SCALE_KEYS + LOCAL_KEYS:
            raise argparse.ArgumentTypeError(f"pilot {name!r}: {item!r} is not KEY=VALUE with KEY in {SCALE_KEYS + LOCAL_KEYS}")
        out[key] = float(value)
    return name, out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_pilot(name: str, changes: dict[str, float], partition: str, seed: int, run_dir: Path) -> dict[str, Any]:
    scale = dataclasses.replace(kd_methods.SCALES["full"], **{k: int(v) for k, v in changes.items() if k in SCALE_KEYS})
    local = {**kd_methods.LOCAL, **{k: v for k, v in changes.items() if k in LOCAL_KEYS}}
    _, _, run = next(p for p in kd_methods.plan(scale) if p[0] == partition and p[1] == "fedavg")
    run = dataclasses.replace(run, method_config={**run.method_config, **{k: local[k] for k in LOCAL_KEYS}})
    data = DataSpec(scale.dataset, kd_methods.PARTITIONS[partition], scale.agents, scale.train_samples, scale.test_samples, seed=seed)
    load_before, started, cpu = list(os.getloadavg()), time.monotonic(), _cpu_s()
    report = run_federation(run, data, run_dir / f"{name}-{partition}-seed{seed}")
    series = round_series(report)
    return {
        "name": name, "changes": changes, "partition": partition, "seed": seed, "method": "fedavg", "model": kd_methods.MODEL,
        "scale": {**{k: getattr(scale, k) for k in ("agents", "client_fraction", "train_samples", "test_samples", "rounds",
                                                     "eval_every", "local_epochs")}, "local_training": {**local, "local_epochs": scale.local_epochs}},
        "status": report["status"], "final_accuracy": report["totals"]["final_accuracy"],
        "best_accuracy": report["totals"].get("best_accuracy"),
        "accuracy_by_round": [[r["round"], r["accuracy"]] for r in series if r["accuracy"] is not None],
        "local_accuracy_by_round": [[r["round"], r["local_accuracy"]] for r in series if r["local_accuracy"] is not None],
        "wall_s": time.monotonic() - started, "cpu_s": _cpu_s() - cpu,
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pilots", nargs="+", type=parse_pilot, help="NAME:KEY=VALUE,... (keys: %s)" % ", ".join(SCALE_KEYS + LOCAL_KEYS))
    parser.add_argument("--partition", default="dir0.1", choices=list(kd_methods.PARTITIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kd_pilots.json")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "kd_pilots")
    args = parser.parse_args(argv)
    quiet_logs()
    for name, changes in args.pilots:
        print(f"== pilot {name} {changes} ({args.partition}, seed {args.seed})", flush=True)
        done = run_pilot(name, changes, args.partition, args.seed, args.run_dir)
        doc = json.loads(args.out.read_text()) if args.out.exists() else {
            "benchmark": "kd_pilots", "description": __doc__.splitlines()[0], "base": "bench/kd_methods.py's full scale, FedAvg",
            "pilots": []}
        doc["pilots"] = [p for p in doc["pilots"] if (p["name"], p["partition"], p["seed"]) != (name, args.partition, args.seed)]
        doc["pilots"].append(done)
        doc["machine"] = machine()
        write_json(args.out, doc)
        print(f"   final {done['final_accuracy']}, best {done['best_accuracy']}, {done['wall_s']:.0f} s: "
              f"{[a for _, a in done['accuracy_by_round']]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FedBE's server-side distillation against its paper's, one factor at a time.

bench/kd_methods.py's grid first ran FedBE with 64 unlabeled images and 16 distillation steps of
batch 32 a round (SWA warm-up 8, cycle 4), sized for 2 cores, and found it within noise of FedAvg
at every partition, where its paper claims a gain (most under non-i.i.d. data). The paper (Sec.
5.1 and Appendix C): the unlabeled set is split off the training data (10K of CIFAR-10's 50K;
Fig. 5: "FedBE outperforms FedAvg even with 1K unlabeled" images), distillation runs 20 epochs a
round at batch 128 ("We follow other settings of v-Distillation (e.g., distill for 20 epochs per
round)"), SWA collects every 25 steps after the 250th (of the ~1,580 steps 20 epochs of 10K make).

The variants, each at Dirichlet(0.1) (the grid's strongest skew) and Dirichlet(0.5) (where the
grid's FedBE, at 1,000 images, ends half a point below FedAvg in every seed) with the grid's
seeds, data, agents, rounds and local training, so each pairs seed by seed with the grid's FedAvg
and FedBE:

* ``u64-steps16``: the grid's first setting, 64 unlabeled images and 16 steps;
* ``u1000-steps16``: 1,000 unlabeled images, the same 16 steps (the set's size alone): the
  grid's setting since this ablation (``kd_methods.FEDBE_SERVER``), so its runs are the grid's
  FedBE runs of the same seeds made again (``vs_grid_fedbe``: zero differences when they
  reproduce);
* ``u1000-paper``: 1,000 unlabeled images and the paper's schedule scaled to them: 20 epochs at
  batch 128 (160 steps), SWA warm-up 25 steps (the paper's 250 of 1,580, the same share) and a
  collection every 25 steps.

Writes ``bench/results/kd_ablation_fedbe.json``: per partition, variant and seed the final and best
global accuracy, the curve, FedBE's server TFLOPs and wall time, and the paired differences (the
grid's rule, bench/_stats.py) against the grid's FedAvg, the grid's FedBE and the first setting
(``u64-steps16``) on the same seeds; and what FedBE's distillation had to work with, round by
round on the server's unlabeled set: its teacher (the ensemble's pseudo-labels) and the distilled
model, each against the plain weight average w_bar (``teacher``).

    python bench/kd_ablation_fedbe.py --resume            # every variant and partition, seeds 0,1,2 (about 50 min)
    python bench/kd_ablation_fedbe.py --only u1000-paper --partitions dir0.5 --seeds 0 --resume
    python bench/kd_ablation_fedbe.py --resume --reports runs/bench/kd_ablation_fedbe   # summarise recorded runs again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import kd_methods as kd
from _common import RESULTS, machine, write_json
from _federation import DataSpec, quiet_logs, run_federation
from _stats import PAIRED_RULE, mean_sd, paired

#: Where the variants run: the grid's strongest skew, and the partition where the grid's FedBE
#: ends below FedAvg.
PARTITIONS = ("dir0.1", "dir0.5")
#: Each variant's FedBE server work: what it sets on top of the grid's (kd_methods.FEDBE_SERVER).
VARIANTS: dict[str, dict[str, int]] = {
    "u64-steps16": {"unlabeled_samples": 64},
    "u1000-steps16": {"unlabeled_samples": 1000},
    "u1000-paper": {"unlabeled_samples": 1000, "distill_steps": 160, "distill_batch_size": 128, "swa_warmup_steps": 25,
                    "swa_cycle_steps": 25},
}
LAST_ROUNDS = 5  # the teacher's margin over the last rounds too: the final model comes out of them


def variant_scale(name: str) -> kd.Scale:
    base = kd.SCALES["full"]
    return dataclasses.replace(base, fedbe_server={**kd.FEDBE_SERVER, **VARIANTS[name]})


def variant_run(variant: str, partition: str) -> kd.RunSpec:
    _, _, base = next(p for p in kd.plan(variant_scale(variant)) if p[1] == "fedbe" and p[0] == partition)
    return dataclasses.replace(base, name=f"fedbe-{variant}-{partition}")


def by_seed(grid: dict[str, Any], run: str) -> dict[str, float]:
    return {str(r["seed"]): r["final_accuracy"] for r in grid["runs"].values() if r["name"] == run}


def teacher(run: dict[str, Any]) -> dict[str, float | None]:
    """A FedBE run's rounds on the server's unlabeled set: the teacher (the ensemble's
    pseudo-labels) and the distilled model minus the weight average w_bar, in points of accuracy,
    the mean over every round and over the last ``LAST_ROUNDS``; None where the run did not record them."""
    rounds = [r["server_accuracy"] for r in run.get("rounds") or [] if r.get("server_accuracy")
              and None not in (r["server_accuracy"].get("weight_average_accuracy"), r["server_accuracy"].get("pseudo_label_accuracy"))]
    if not rounds:
        return {"teacher_minus_mean": None, "teacher_minus_mean_last": None, "distilled_minus_mean": None,
                "distilled_minus_mean_last": None, "rounds": 0}

    def mean(figure: str, rs: list[dict[str, Any]]) -> float | None:
        values = [r[figure] - r["weight_average_accuracy"] for r in rs if r.get(figure) is not None]
        return sum(values) / len(values) if values else None

    last = rounds[-LAST_ROUNDS:]
    return {"teacher_minus_mean": mean("pseudo_label_accuracy", rounds), "teacher_minus_mean_last": mean("pseudo_label_accuracy", last),
            "distilled_minus_mean": mean("distilled_accuracy", rounds), "distilled_minus_mean_last": mean("distilled_accuracy", last),
            "rounds": len(rounds)}


def teacher_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    per_run = [teacher(r) for r in runs]
    return {k: mean_sd([t[k] for t in per_run if t[k] is not None]) for k in per_run[0] if k != "rounds"} if per_run else {}


def migrate(runs: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """runs[variant][partition][seed]; the JSON written before the partitions held
    runs[variant][seed], all at Dirichlet(0.1)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, inner in runs.items():
        flat = inner and all(k.isdigit() for k in inner)
        out[variant] = {"dir0.1": dict(inner)} if flat else {p: dict(v) for p, v in inner.items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS))
    parser.add_argument("--partitions", nargs="*", choices=PARTITIONS, default=list(PARTITIONS))
    parser.add_argument("--seeds", type=kd.parse_seeds, default=[0, 1, 2])
    parser.add_argument("--resume", action="store_true", help="keep the variants' seeds already in --out")
    parser.add_argument("--reports", type=Path, action="append", default=[],
                        help="a folder of recorded runs (<run name>-seed<seed>/report.json): summarise the JSON's runs "
                             "found there again (figures added to the summary since they were recorded)")
    parser.add_argument("--grid", type=Path, default=RESULTS / "kd_methods.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "kd_ablation_fedbe.json")
    parser.add_argument("--run-dir", type=Path, default=kd.REPO_ROOT / "runs" / "bench" / "kd_ablation_fedbe")
    args = parser.parse_args()
    quiet_logs()
    grid = json.loads(args.grid.read_text())
    previous = json.loads(args.out.read_text()) if args.resume and args.out.exists() else {}
    runs = migrate(previous.get("runs") or {})
    for folder in args.reports:
        for variant, parts in runs.items():
            for partition, seeds in parts.items():
                run = variant_run(variant, partition)
                for seed, recorded in seeds.items():
                    report = folder / f"{run.name}-seed{seed}" / "report.json"
                    if report.exists():
                        kept = {k: recorded[k] for k in ("run_wall_time_s", "load_average_after") if k in recorded}
                        seeds[seed] = {**kd.summarize(partition, "fedbe", run, int(seed), json.loads(report.read_text())), **kept}
    for partition in args.partitions:
        for variant in args.only or list(VARIANTS):
            run = variant_run(variant, partition)
            scale = variant_scale(variant)
            for seed in args.seeds:
                if str(seed) in runs.get(variant, {}).get(partition, {}):
                    continue
                data = DataSpec(scale.dataset, kd.PARTITIONS[partition], scale.agents, scale.train_samples, scale.test_samples,
                                seed=seed)
                print(f"== {run.name} seed {seed}", flush=True)
                started = time.monotonic()
                report = run_federation(run, data, args.run_dir / f"{run.name}-seed{seed}")
                done = kd.summarize(partition, "fedbe", run, seed, report)
                done["run_wall_time_s"] = time.monotonic() - started
                done["load_average_after"] = list(os.getloadavg())
                runs.setdefault(variant, {}).setdefault(partition, {})[str(seed)] = done
                print(f"   global {done['final_accuracy']} (best {done['best_accuracy']}), {done['run_wall_time_s']:.0f} s", flush=True)
                write_json(args.out, document(grid, runs))
    write_json(args.out, document(grid, runs))
    return 0


def document(grid: dict[str, Any], runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for partition in PARTITIONS:
        fedavg, fedbe = by_seed(grid, f"fedavg-{partition}"), by_seed(grid, f"fedbe-{partition}")
        first = {s: r["final_accuracy"] for s, r in (runs.get("u64-steps16") or {}).get(partition, {}).items()}
        grid_fedbe = [r for r in grid["runs"].values() if r["name"] == f"fedbe-{partition}"]
        part: dict[str, Any] = {"grid": {"fedbe_server": kd.FEDBE_SERVER, "fedbe": mean_sd(list(fedbe.values())),
                                         "fedavg": mean_sd(list(fedavg.values())), "fedbe_vs_fedavg": paired(fedbe, fedavg),
                                         "teacher": teacher_summary(grid_fedbe)}}
        for variant in VARIANTS:
            seeds = (runs.get(variant) or {}).get(partition) or {}
            if not seeds:
                continue
            final = {s: r["final_accuracy"] for s, r in seeds.items()}
            part[variant] = {
                "fedbe_server": variant_scale(variant).fedbe_server, "seeds": sorted(seeds),
                "final_accuracy": mean_sd(list(final.values())),
                "best_accuracy": mean_sd([r["best_accuracy"] for r in seeds.values()]),
                "server_tflops": mean_sd([(r["server_flops_total"] or 0) / 1e12 for r in seeds.values()]),
                "wall_min": mean_sd([r["run_wall_time_s"] / 60 for r in seeds.values()]),
                "vs_fedavg": paired(final, fedavg), "vs_grid_fedbe": paired(final, fedbe),
                "vs_first_setting": paired(final, first),
                "teacher": teacher_summary(list(seeds.values())),
            }
        summary[partition] = part
    return {"benchmark": "kd_ablation_fedbe", "generated_by": "bench/kd_ablation_fedbe.py", "machine": machine(),
            "partitions": list(PARTITIONS), "grid": str(kd.SCALES["full"].key()), "grid_fedbe_server": kd.FEDBE_SERVER,
            "variants": VARIANTS, "last_rounds": LAST_ROUNDS, "paired_rule": PAIRED_RULE, "summary": summary, "runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())

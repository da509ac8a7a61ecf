"""FedBE's server-side distillation against its paper's, one factor at a time (issue 24).

bench/kd_methods.py's grid first ran FedBE with 64 unlabeled images and 16 distillation steps of
batch 32 a round (SWA warm-up 8, cycle 4), sized for 2 cores, and found it within noise of FedAvg
at every partition, where its paper claims a gain (most under non-i.i.d. data). The paper (Sec.
5.1 and Appendix C): the unlabeled set is split off the training data (10K of CIFAR-10's 50K;
Fig. 5: "FedBE outperforms FedAvg even with 1K unlabeled" images), distillation runs 20 epochs a
round at batch 128 ("We follow other settings of v-Distillation (e.g., distill for 20 epochs per
round)"), SWA collects every 25 steps after the 250th (of the ~1,580 steps 20 epochs of 10K make).

The variants, each at Dirichlet(0.1) (the grid's strongest skew) with the grid's seeds, data,
agents, rounds and local training, so each pairs seed by seed with the grid's FedAvg and FedBE:

* ``u64-steps16``: the grid's first setting, 64 unlabeled images and 16 steps;
* ``u1000-steps16``: 1,000 unlabeled images, the same 16 steps (the set's size alone): the
  grid's setting since this ablation (``kd_methods.FEDBE_SERVER``), so its runs are the grid's
  FedBE runs of the same seeds made again (``vs_grid_fedbe``: zero differences when they
  reproduce);
* ``u1000-paper``: 1,000 unlabeled images and the paper's schedule scaled to them: 20 epochs at
  batch 128 (160 steps), SWA warm-up 25 steps (the paper's 250 of 1,580, the same share) and a
  collection every 25 steps.

Writes ``bench/results/kd_ablation_fedbe.json``: per variant and seed the final and best global
accuracy, the curve, FedBE's server TFLOPs and wall time, and the paired differences (the grid's
rule, bench/_stats.py) against the grid's FedAvg, the grid's FedBE and the first setting
(``u64-steps16``) on the same seeds.

    python bench/kd_ablation_fedbe.py                     # every variant, seeds 0,1,2 (about 25 min)
    python bench/kd_ablation_fedbe.py --only u1000-paper --seeds 0 --resume
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

PARTITION = "dir0.1"
#: Each variant's FedBE server work: what it sets on top of the grid's (kd_methods.FEDBE_SERVER).
VARIANTS: dict[str, dict[str, int]] = {
    "u64-steps16": {"unlabeled_samples": 64},
    "u1000-steps16": {"unlabeled_samples": 1000},
    "u1000-paper": {"unlabeled_samples": 1000, "distill_steps": 160, "distill_batch_size": 128, "swa_warmup_steps": 25,
                    "swa_cycle_steps": 25},
}


def variant_scale(name: str) -> kd.Scale:
    base = kd.SCALES["full"]
    return dataclasses.replace(base, fedbe_server={**kd.FEDBE_SERVER, **VARIANTS[name]})


def by_seed(grid: dict[str, Any], run: str) -> dict[str, float]:
    return {str(r["seed"]): r["final_accuracy"] for r in grid["runs"].values() if r["name"] == run}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS))
    parser.add_argument("--seeds", type=kd.parse_seeds, default=[0, 1, 2])
    parser.add_argument("--resume", action="store_true", help="keep the variants' seeds already in --out")
    parser.add_argument("--grid", type=Path, default=RESULTS / "kd_methods.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "kd_ablation_fedbe.json")
    parser.add_argument("--run-dir", type=Path, default=kd.REPO_ROOT / "runs" / "bench" / "kd_ablation_fedbe")
    args = parser.parse_args()
    quiet_logs()
    grid = json.loads(args.grid.read_text())
    previous = json.loads(args.out.read_text()) if args.resume and args.out.exists() else {}
    runs: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (previous.get("runs") or {}).items()}
    for variant in args.only or list(VARIANTS):
        scale = variant_scale(variant)
        _, _, base = next(p for p in kd.plan(scale) if p[1] == "fedbe" and p[0] == PARTITION)
        run = dataclasses.replace(base, name=f"fedbe-{variant}-{PARTITION}")
        for seed in args.seeds:
            if str(seed) in runs.get(variant, {}):
                continue
            data = DataSpec(scale.dataset, kd.PARTITIONS[PARTITION], scale.agents, scale.train_samples, scale.test_samples,
                            seed=seed)
            print(f"== {run.name} seed {seed}", flush=True)
            started = time.monotonic()
            report = run_federation(run, data, args.run_dir / f"{run.name}-seed{seed}")
            done = kd.summarize(PARTITION, "fedbe", run, seed, report)
            done["run_wall_time_s"] = time.monotonic() - started
            done["load_average_after"] = list(os.getloadavg())
            runs.setdefault(variant, {})[str(seed)] = done
            print(f"   global {done['final_accuracy']} (best {done['best_accuracy']}), {done['run_wall_time_s']:.0f} s", flush=True)
            write_json(args.out, document(grid, runs))
    write_json(args.out, document(grid, runs))
    return 0


def document(grid: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    fedavg, fedbe = by_seed(grid, f"fedavg-{PARTITION}"), by_seed(grid, f"fedbe-{PARTITION}")
    first = {s: r["final_accuracy"] for s, r in (runs.get("u64-steps16") or {}).items()}
    summary: dict[str, Any] = {"grid": {"fedbe_server": kd.SCALES["full"].fedbe_server, "fedbe": mean_sd(list(fedbe.values())),
                                        "fedavg": mean_sd(list(fedavg.values())), "fedbe_vs_fedavg": paired(fedbe, fedavg)}}
    for variant, seeds in runs.items():
        final = {s: r["final_accuracy"] for s, r in seeds.items()}
        summary[variant] = {
            "fedbe_server": variant_scale(variant).fedbe_server, "seeds": sorted(seeds),
            "final_accuracy": mean_sd(list(final.values())),
            "best_accuracy": mean_sd([r["best_accuracy"] for r in seeds.values()]),
            "server_tflops": mean_sd([(r["server_flops_total"] or 0) / 1e12 for r in seeds.values()]),
            "wall_min": mean_sd([r["run_wall_time_s"] / 60 for r in seeds.values()]),
            "vs_fedavg": paired(final, fedavg), "vs_grid_fedbe": paired(final, fedbe),
            "vs_first_setting": paired(final, first),
        }
    return {"benchmark": "kd_ablation_fedbe", "generated_by": "bench/kd_ablation_fedbe.py", "machine": machine(),
            "partition": PARTITION, "grid": str(kd.SCALES["full"].key()), "grid_fedbe_server": kd.FEDBE_SERVER, "variants": VARIANTS,
            "paired_rule": PAIRED_RULE, "summary": summary, "runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())

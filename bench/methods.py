"""The other methods on Table 1's setting: every registered method that declares
runs here (``MethodSpec.bench`` in its registry entry: today the FedAvg family's
FedGKD, FedDistill and FedBE, all with ResNet-56, and FedKD), and the methods' own
tables (``BenchRun.results``: today FedGKT's knowledge-transfer ablation, the paper's
Table 2, declared as variants of its Table 1 run on the ablation partition), each
cell run once per seed and reported as mean ± sd. No run is written out here.

The data, agents, rounds, batch, optimiser and seeds are ``bench/accuracy.py``'s
(imported, not copied), so every cell here sits beside Table 1's FedAvg and
FedGKT cells of the same seeds and is scored on the same balanced test set.
The methods' own settings are the ones this repository has measured them with,
declared by each method beside its registry entry (``shared_protocol/methods/<name>.py``):

* FedGKD (not -Vote): the paper's CV defaults, gamma 0.2, a buffer of 5;
* FedDistill: read off the paper's sensitivity study (docs/methods/feddistill.md);
* FedBE: 10 sampled models plus the mean and the clients, distilled with SWA on a
  server-held unlabeled set (the training split minus the agents' subset), its
  server work sized per scale (``BenchRun.per_scale``, recorded in the JSON's scale);
* FedKD: a private ResNet-56 mentor and a shared ResNet-8 mentee per agent,
  Adam 0.001; its accuracy is the mentors' (its ``mentee`` label beside it);
* Table 2: FedGKT with no KD and with S->E only (``shared = "table1"``: Table 1's
  FedGKT table with ``kd`` changed); the S<->E row is Table 1's ``fedgkt-noniid``
  (``bench/results/accuracy.json``; declared with ``reuses_table1``, not run again). The
  paper's figures are the rows' (``ResultsRow.paper``), written to the JSON's ``paper``.

Not part of Table 1's budget, kept runnable here. At the full scale (4 agents x
1,000 images, 5 rounds) one seed takes over an hour on 2 idle cores (FedBE's
server work a round on top of FedAvg's cost; the runs' wall times are recorded in
``bench/results/methods.json``), three seeds a few hours; ``--seeds 0`` runs one.

    python bench/methods.py --quick               # the pipeline check (about 15 minutes)
    python bench/methods.py --seeds 0             # one seed of every method
    python bench/methods.py --only fedbe-resnet56-iid --seeds 1 --merge

Writes ``bench/results/methods.json`` (``--quick``: ``methods-quick.json``), in
``bench/accuracy.py``'s format (runs keyed by name and seed, cells, budget).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, run_federation, write_json
from _stats import DIFFERENCE_RULE
from accuracy import (AGENTS, BATCH, FEDAVG, PARTITIONS, SCALES, SEEDS, budget, cells, eval_set_of, parse_seeds,
                      previous_runs, run_key, scale_folder, scale_key, summarize)
from accuracy import runs as table1_runs

from shared_protocol.registry import BenchRun, registered_methods

#: The settings a method's runs here go on top of (``BenchRun.shared``): Table 1's ("table1":
#: the method's own table in Table 1's run of it, :func:`table1_table`).
SHARED: dict[str, dict[str, Any]] = {"whole_model": FEDAVG, "batch": {"batch_size": BATCH, "local_epochs": 1}, "": {}}
#: Minutes on 2 idle cores for all seeds of the scale (the estimate in the module's docstring).
BUDGET_MINUTES = {"full": 250, "quick": 15}


def method_runs() -> list[tuple[str, BenchRun]]:
    """(method, run) of every registered method's runs here, in their declared order."""
    declared = [(name, run) for name, spec in registered_methods().items() for run in spec.bench]
    return sorted(declared, key=lambda item: (item[1].order, item[1].name))


def table1_table(method: str) -> dict[str, Any]:
    """``method``'s ``[<method>]`` table in its Table 1 run (``bench/accuracy.py``)."""
    tables = {run.method: run.method_config for _, _, run in table1_runs(1)}
    if method not in tables:
        raise ValueError(f"a bench run of {method!r} goes on top of its Table 1 run (shared = 'table1'), "
                         f"but Table 1 runs only {sorted(tables)}")
    return dict(tables[method])


def method_table(method: str, run: BenchRun, scale: str, train_samples: int) -> dict[str, Any]:
    """The ``[<method>]`` table of one of a method's runs at ``scale``."""
    shared = table1_table(method) if run.shared == "table1" else SHARED[run.shared]
    table = {**shared, **run.table, **run.per_scale.get(scale, {})}
    if run.train_samples_key:
        table[run.train_samples_key] = train_samples
    return table


def paper_figures() -> dict[str, dict[str, float | str]]:
    """The papers' figures the methods declare beside their runs here (``ResultsRow.paper``), by
    results table and run name, for the JSON."""
    out: dict[str, dict[str, float | str]] = {}
    for _, run in method_runs():
        for row in run.rows:
            if row.paper is not None:
                out.setdefault(run.results, {})[run.name] = row.paper
    return out


def per_scale_settings(scale: str) -> dict[str, dict[str, Any]]:
    """``<method>_server``: the per-scale settings of the methods that have them, for the JSON's scale."""
    return {f"{method}_server": dict(run.per_scale[scale]) for method, run in method_runs() if scale in run.per_scale}


def runs(rounds: int, train_samples: int, ablation_partition: str = "noniid", scale: str = "full") -> list[tuple[str, str, RunSpec]]:
    """(table, partition key, run): every run of this benchmark, for one seed: per partition every
    declared run of the other methods' table, then the runs of the methods' own tables (an
    ablation: on ``ablation_partition`` only, unless declared for every partition)."""
    if ablation_partition not in PARTITIONS:
        raise ValueError(f"the ablation partition is one of {sorted(PARTITIONS)}, got {ablation_partition!r}")
    out: list[tuple[str, str, RunSpec]] = []
    declared = method_runs()
    table1_names = {run.name for _, _, run in table1_runs(1)}
    for method, run in declared:
        if run.reuses_table1 and not {f"{run.name}-{key}" for key in PARTITIONS} <= table1_names:
            raise ValueError(f"{method}'s bench run {run.name!r} reuses Table 1's run, but Table 1 runs no "
                             f"{run.name}-<partition>: it runs {sorted(table1_names)}")
    declared = [(method, run) for method, run in declared if not run.reuses_table1]  # Table 1's cells serve it
    for results in ["methods", *sorted({run.results for _, run in declared} - {"methods"})]:
        for key in PARTITIONS:
            for method, run in declared:
                if run.results != results or (run.partitions == "ablation" and key != ablation_partition):
                    continue
                out.append((results, key, RunSpec(f"{run.name}-{key}", method, method_table(method, run, scale, train_samples), rounds)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the pipeline-check scale")
    parser.add_argument("--seeds", type=parse_seeds, default=list(SEEDS), help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--train-samples", type=int, help="override the scale's training subset")
    parser.add_argument("--test-samples", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--ablation-partition", choices=sorted(PARTITIONS), default="noniid")
    parser.add_argument("--only", nargs="*", help="run only these runs (names as in the output, every seed of --seeds)")
    parser.add_argument("--collect", action="store_true", help="run nothing: write the JSON from the runs recorded before (as --merge)")
    parser.add_argument("--merge", action="store_true", help="also keep the runs of the same scale recorded before")
    parser.add_argument("--out", type=Path, help="default: bench/results/methods.json (--quick: methods-quick.json)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "methods")
    args = parser.parse_args(argv)
    quiet_logs()
    if args.out is None:
        args.out = RESULTS / ("methods-quick.json" if args.quick else "methods.json")
    scale_name = "quick" if args.quick else "full"
    scale = SCALES[scale_name]
    recorded_as = scale_key(scale, args.train_samples, args.test_samples, args.rounds)
    train_samples, test_samples, rounds = (recorded_as[k] for k in ("train_samples", "test_samples", "rounds"))
    plan = runs(rounds, train_samples, args.ablation_partition, scale_name)
    names = {run.name for _, _, run in plan}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        parser.error(f"--only: no runs named {unknown}; the runs are {sorted(names)}")
    run_root = scale_folder(args.run_dir, recorded_as)
    results: dict[str, Any] = {}
    for seed in args.seeds:
        for table, key, run in plan:
            if args.collect or (args.only and run.name not in args.only):
                continue
            data = DataSpec("fashion-mnist", PARTITIONS[key], AGENTS, train_samples, test_samples, seed=seed)
            print(f"== {run.name} seed {seed} ({data.partition}, {train_samples} train / {test_samples} test, {rounds} rounds)", flush=True)
            started = time.monotonic()
            report = run_federation(run, data, run_root / run_key(run.name, seed))
            results[run_key(run.name, seed)] = {**summarize(table, key, run, seed, report), "run_wall_time_s": time.monotonic() - started,
                                                "load_average_after": list(os.getloadavg())}
            write_json(run_root / run_key(run.name, seed) / "summary.json", {"scale": recorded_as, "run": results[run_key(run.name, seed)]})
    if args.merge or args.collect:
        results = {**previous_runs(args.out, run_root, recorded_as), **results}
    if not results:
        parser.error("no runs made or recorded for this scale")
    seeds_recorded = sorted({r["seed"] for r in results.values()})
    complete = {run_key(n, s) for n in names for s in seeds_recorded} <= set(results) and len(seeds_recorded) >= len(SEEDS)
    elapsed = sum(r["run_wall_time_s"] for r in results.values())
    eval_set, same_set = eval_set_of(results)
    write_json(args.out, {
        "benchmark": "methods",
        "description": "Every registered method's runs here (FedGKD, FedDistill, FedBE with ResNet-56, FedKD) and "
                       "FedGKT's KD ablation on bench/accuracy.py's Table 1 setting, mean ± sd over seeds.",
        "scale": {**recorded_as, "dataset": "fashion-mnist (32x32 zero-padded, 1 channel)", "partitions": PARTITIONS,
                  "ablation_partition": PARTITIONS[args.ablation_partition], "batch_size": BATCH, "optimizer": "adam, lr 0.001",
                  "passes_over_the_data_per_round": 1, "seeds": seeds_recorded, **per_scale_settings(scale_name),
                  "budget_minutes_on_2_cores": BUDGET_MINUTES[scale_name], "wall_time_s": elapsed, "wall_time_min": elapsed / 60,
                  "complete": complete},
        "eval_set": eval_set,
        "eval_set_same_for_every_run": same_set,
        "budget": budget(elapsed, BUDGET_MINUTES[scale_name], complete, recorded_as["name"] != "custom"),
        "difference_rule": DIFFERENCE_RULE,
        "cells": cells(results),
        "paper": paper_figures(),
        "machine": machine(),
        "runs": results,
        "generated_by": "bench/methods.py" + (" --quick" if args.quick else "") + (" (runs merged with --merge / --collect)" if args.merge or args.collect else ""),
    })
    print(f"total {elapsed / 60:.1f} min for {len(results)} runs ({len(seeds_recorded)} seeds)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

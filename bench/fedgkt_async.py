"""FedGKT sync vs async (the paper's Table 3) on ``make demo``'s setting, mean ± sd over seeds.

``make demo``'s run exactly (``edgesplit local``: one mosquitto, one
``cloud-server`` process and four ``edge-agent`` processes with one torch
thread each, talking only through the broker; Fashion-MNIST, 3,000 training /
1,000 test images, Dirichlet(0.5), 6 rounds, FedGKT's defaults), once with
``--mode sync`` and once with ``--mode async`` per seed. The seed drives the
data subset, the partition, the models' initialisation and the shuffling.

Per mode: mean ± sd of the final global accuracy (each agent's extractor + the
server model with the server's running BatchNorm statistics on the balanced
evaluation set, mean over agents), the final local accuracy, and the agents'
idle share: the time an agent waited for the server between its rounds (its
``idle_s``) over the time from its first round's start to its last round's
end, mean over agents (also: over the run's wall time). The targets: async
within 2 points of sync (global accuracy, mean over seeds) and the agents'
idle share in async at most 20%.

Unlike ``bench/accuracy.py`` the agents are separate processes sharing 2 cores
with the server, as in ``make demo``: idle time is waiting for the server, not
for a compute lock. About 6 runs x 7-10 minutes on 2 idle cores: planned for
under 60 minutes.

    python bench/fedgkt_async.py                 # seeds 0,1,2, both modes
    python bench/fedgkt_async.py --quick         # a pipeline check (400 / 200 images, 2 rounds)
    python bench/fedgkt_async.py --seeds 3 --merge

Writes ``bench/results/fedgkt_async.json`` (``--quick``: ``fedgkt_async-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, RunSpec, machine, write_json
from _stats import DIFFERENCE_RULE, comparison, mean_sd
from accuracy import SEEDS, budget, cells, eval_set_of, parse_seeds, run_key, summarize

#: make demo's setting (the Makefile's demo target).
DEMO = {"method": "fedgkt", "agents": 4, "rounds": 6, "train_samples": 3000, "test_samples": 1000,
        "dataset": "fashion-mnist", "partition": "dirichlet:0.5"}
QUICK = {**DEMO, "rounds": 2, "train_samples": 400, "test_samples": 200}
MODES = ("sync", "async")
#: The runs of the table: name -> (--mode, extra --set options). ``async-noreplay`` is the
#: ablation: async as the reference code runs it, each arrival training on its agent's maps alone.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "sync": ("sync", []),
    "async": ("async", []),
    "async-noreplay": ("async", ["fedgkt.async_replay=false"]),
}
BUDGET_MINUTES = {"demo": 60, "quick": 10}
#: The targets: async within this many points of sync (mean over seeds), and the agents' idle share in async.
MAX_GAP_POINTS = 2.0
MAX_IDLE_SHARE = 0.20


def command(setting: dict[str, Any], variant: str, seed: int, out: Path, eval_samples: bool) -> list[str]:
    """The ``edgesplit local`` command line of one run (make demo's, plus mode, seed and run directory)."""
    mode, extra = VARIANTS[variant]
    cmd = [sys.executable, "-m", "cloud_server.launcher", "local", "--method", setting["method"], "--agents", str(setting["agents"]),
           "--rounds", str(setting["rounds"]), "--train-samples", str(setting["train_samples"]),
           "--test-samples", str(setting["test_samples"]), "--dataset", setting["dataset"], "--partition", setting["partition"],
           "--mode", mode, "--seed", str(seed), "--run-id", run_key(f"fedgkt-{variant}", seed), "--out", str(out)]
    for option in extra:
        cmd += ["--set", option]
    if eval_samples:  # the balanced evaluation set as large as the test subset, as bench/accuracy.py scores
        cmd += ["--set", f"server.eval_samples={setting['test_samples']}"]
    return cmd


def idle_share(report: dict[str, Any]) -> dict[str, Any]:
    """The agents' idle time (waiting for the server between their rounds) as a share of the
    time from their first round's start to their last round's end, and of the run's wall time."""
    per_agent: dict[str, dict[str, float]] = {}
    for r in report["rounds"]:
        for agent, costs in (r.get("per_agent") or {}).items():
            a = per_agent.setdefault(agent, {"idle_s": 0.0, "round_s": 0.0})
            a["idle_s"] += float(costs.get("idle_s") or 0.0)
            a["round_s"] += float(costs.get("round_s") or 0.0)
    wall = float(report["totals"]["wall_time_s"]) or None
    shares = {a: v["idle_s"] / (v["idle_s"] + v["round_s"]) if v["idle_s"] + v["round_s"] > 0 else None for a, v in per_agent.items()}
    of_wall = {a: v["idle_s"] / wall if wall else None for a, v in per_agent.items()}
    kept = [s for s in shares.values() if s is not None]
    kept_wall = [s for s in of_wall.values() if s is not None]
    return {"per_agent": shares, "mean": sum(kept) / len(kept) if kept else None, "max": max(kept) if kept else None,
            "of_wall_time_mean": sum(kept_wall) / len(kept_wall) if kept_wall else None,
            "agents_seconds": per_agent}


def verdicts(cell_table: dict[str, Any], idle: dict[str, Any]) -> dict[str, Any]:
    sync, asyn = cell_table.get("fedgkt-sync"), cell_table.get("fedgkt-async")
    out: dict[str, Any] = {"max_gap_points": MAX_GAP_POINTS, "max_idle_share": MAX_IDLE_SHARE}
    if sync and asyn:
        cmp = comparison(asyn["final_accuracy"], sync["final_accuracy"])
        gap = None if cmp["mean_difference"] is None else 100 * cmp["mean_difference"]
        out["async_minus_sync"] = {**cmp, "points": gap, "within_target": None if gap is None else abs(gap) <= MAX_GAP_POINTS}
    a = idle.get("async")
    if a and a["mean"] is not None:
        out["async_idle_share_within_target"] = a["mean"] <= MAX_IDLE_SHARE
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a pipeline check at 400 / 200 images, 2 rounds")
    parser.add_argument("--seeds", type=parse_seeds, default=list(SEEDS), help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--modes", nargs="+", choices=list(VARIANTS), default=list(MODES),
                        help="the runs to make (default: sync async; async-noreplay is the ablation)")
    parser.add_argument("--collect", action="store_true",
                        help="make no runs: rebuild the JSON from the run directories' report.json")
    parser.add_argument("--merge", action="store_true", help="keep the runs recorded before in --out (same setting)")
    parser.add_argument("--out", type=Path, help="default: bench/results/fedgkt_async.json (--quick: fedgkt_async-quick.json)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "fedgkt_async")
    args = parser.parse_args(argv)
    setting, scale_name = (QUICK, "quick") if args.quick else (DEMO, "demo")
    if args.out is None:
        args.out = RESULTS / ("fedgkt_async-quick.json" if args.quick else "fedgkt_async.json")
    from cloud_server.config import ServerConfig

    eval_samples = "eval_samples" in ServerConfig.__dataclass_fields__
    results: dict[str, Any] = {}
    if args.merge and args.out.exists():
        previous = json.loads(args.out.read_text())
        if previous.get("setting") == setting:
            results.update(previous["runs"])
    root = args.run_dir / "{}-{}x-{}-{}-{}".format(scale_name, setting["agents"], setting["train_samples"], setting["test_samples"], setting["rounds"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    def record(variant: str, seed: int, report: dict[str, Any], wall: float, load: list[float] | None) -> None:
        name = f"fedgkt-{variant}"
        mode, extra = VARIANTS[variant]
        run = RunSpec(name, "fedgkt", {"mode": mode, **dict(o.split(".", 1)[1].split("=", 1) for o in extra)}, setting["rounds"])
        results[run_key(name, seed)] = {**summarize("table3", "noniid", run, seed, report), "mode": mode, "variant": variant,
                                        "idle_share": idle_share(report), "run_wall_time_s": wall, "load_average_after": load}

    if args.collect:
        for variant in VARIANTS:
            for seed in args.seeds:
                path = root / run_key(f"fedgkt-{variant}", seed) / "report.json"
                if path.exists():
                    report = json.loads(path.read_text())
                    if report.get("status") == "finished":
                        record(variant, seed, report, float(report["totals"]["wall_time_s"]), None)
    for seed in [] if args.collect else args.seeds:
        for variant in args.modes:
            name = f"fedgkt-{variant}"
            out = root / run_key(name, seed)
            print(f"== {name} seed {seed}", flush=True)
            started = time.monotonic()
            done = subprocess.run(command(setting, variant, seed, out, eval_samples), cwd=REPO_ROOT, env=env,
                                  stdout=subprocess.DEVNULL, check=False)
            wall = time.monotonic() - started
            if done.returncode != 0 or not (out / "report.json").exists():
                print(f"   failed (exit {done.returncode}); logs in {out / 'logs'}", flush=True)
                continue
            record(variant, seed, json.loads((out / "report.json").read_text()), wall, list(os.getloadavg()))
    if not results:
        parser.error("no runs made or recorded")
    seeds_recorded = sorted({r["seed"] for r in results.values()})
    complete = {run_key(f"fedgkt-{m}", s) for m in MODES for s in seeds_recorded} <= set(results) and len(seeds_recorded) >= len(SEEDS)
    # Table 3's budget counts its own runs (sync and async); the ablation's are stated apart.
    elapsed = sum(r["run_wall_time_s"] for r in results.values() if r.get("variant", r["mode"]) in MODES)
    ablation_s = sum(r["run_wall_time_s"] for r in results.values() if r.get("variant", r["mode"]) not in MODES)
    cell_table = cells(results)
    idle = {v: mean_sd(r["idle_share"]["mean"] for r in results.values() if r.get("variant", r["mode"]) == v) for v in VARIANTS}
    eval_set, same_set = eval_set_of(results)
    write_json(args.out, {
        "benchmark": "fedgkt_async",
        "description": "FedGKT sync vs async on make demo's setting (4 agent processes, 3,000 / 1,000 Fashion-MNIST images, "
                       "Dirichlet(0.5), 6 rounds), mean ± sd over seeds: global accuracy and the agents' idle share.",
        "setting": setting,
        "scale": {"name": scale_name, **setting, "seeds": seeds_recorded, "complete": complete,
                  "process_layout": "edgesplit local: one server process, one process per agent (1 torch thread each), one mosquitto",
                  "budget_minutes_on_2_cores": BUDGET_MINUTES[scale_name], "wall_time_s": elapsed, "wall_time_min": elapsed / 60,
                  "ablation_wall_time_min": ablation_s / 60,
                  "runs_in_budget": sum(1 for r in results.values() if r.get("variant", r["mode"]) in MODES),
                  "idle_share_is": "per agent, the seconds it waited for the server between its rounds over the seconds from "
                                   "its first round's start to its last round's end; mean over agents, then mean ± sd over seeds"},
        "eval_set": eval_set,
        "eval_set_same_for_every_run": same_set,
        # edgesplit local draws the balanced set with the run's seed: sync and async of one seed share it.
        "eval_set_same_within_each_seed": all(
            len({(r["eval_set"] or {}).get("ids_sha256") for r in results.values() if r["seed"] == seed}) == 1
            for seed in seeds_recorded),
        "budget": budget(elapsed, BUDGET_MINUTES[scale_name], complete, True),
        "difference_rule": DIFFERENCE_RULE,
        "cells": cell_table,
        "idle_share": idle,
        "targets": verdicts(cell_table, idle),
        "paper": {"table3_cifar10": {"sync": 92.97, "async": 92.92}},
        "machine": machine(),
        "runs": results,
        "generated_by": "bench/fedgkt_async.py" + (" --quick" if args.quick else "") + (" (runs merged with --merge)" if args.merge else ""),
    })
    for mode in VARIANTS:
        cell = cell_table.get(f"fedgkt-{mode}")
        if cell and cell["final_accuracy"]["mean"] is not None:
            share = idle[mode]["mean"]
            print(f"{mode:14s} global {100 * cell['final_accuracy']['mean']:.1f}% (n={cell['n']}), idle share "
                  f"{'-' if share is None else f'{100 * share:.1f}%'}", flush=True)
    print(f"total {elapsed / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

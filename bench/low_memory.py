"""What ``--low-memory`` costs in accuracy: FedGKT with and without micro-batches.

``edge-agent run --low-memory`` (``[memory] micro_batch_samples = 16``) trains
each batch of the round as micro-batches of 16 samples whose gradients make one
optimiser step: the same gradient except that BatchNorm normalises every
micro-batch with its own statistics (ghost batches of 16 instead of the
round's batch). Whether that changes what FedGKT learns is measured here, not
assumed: the same federation (``make demo``'s setting: Fashion-MNIST, 4 agents,
a 3,000 / 1,000-image subset, Dirichlet(0.5), FedGKT's defaults with batch 64,
so 4 ghost batches per step) run with every agent in the default mode and with
every agent micro-batching, over the same seeds (data subset, partition and
models), and the server's and the agents' accuracy compared round by round and
at the end, per seed and as a mean.

    python bench/low_memory.py                    # 2 seeds x 2 modes x 5 rounds (about 30 min on 2 idle cores)
    python bench/low_memory.py --seeds 0 --rounds 2   # a quick look

Writes ``bench/results/low_memory.json``; ``bench/render_results.py`` puts
the table in ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _federation import RESULTS, DataSpec, RunSpec, machine, quiet_logs, round_series, run_federation, write_json

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    # --low-memory's training is one of these (its malloc pin changes no number)
    "micro-batch-16": {"micro_batch_samples": 16},
    "micro-batch-8": {"micro_batch_samples": 8},
}


def run_one(mode: str, seed: int, rounds: int, data: DataSpec, root: Path) -> dict[str, Any]:
    run = RunSpec(f"fedgkt-{mode}-seed{seed}", "fedgkt", {}, rounds, memory=MODES[mode])
    started = time.monotonic()
    report = run_federation(run, data, root / run.name)
    if report.get("status") != "finished":
        raise RuntimeError(f"{run.name} ended {report.get('status')!r}")
    series = round_series(report)
    return {
        "mode": mode, "seed": seed, "memory": MODES[mode],
        "accuracy": [r["accuracy"] for r in series], "edge_accuracy": [r["edge_accuracy"] for r in series],
        "final_accuracy": series[-1]["accuracy"], "final_edge_accuracy": series[-1]["edge_accuracy"],
        "wall_s": round(time.monotonic() - started, 1), "load_average": list(os.getloadavg()),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean final accuracies per mode and the per-seed differences (each micro-batch mode minus default)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[mode] = {"final_accuracy_mean": statistics.fmean(r["final_accuracy"] for r in mine),
                         "final_edge_accuracy_mean": statistics.fmean(r["final_edge_accuracy"] for r in mine),
                         "seeds": [r["seed"] for r in mine]}
    by_seed = {(r["mode"], r["seed"]): r for r in runs}
    diffs = [{"mode": mode, "seed": seed,
              "server_points": round(100 * (by_seed[(mode, seed)]["final_accuracy"] - by_seed[("default", seed)]["final_accuracy"]), 2),
              "edge_points": round(100 * (by_seed[(mode, seed)]["final_edge_accuracy"] - by_seed[("default", seed)]["final_edge_accuracy"]), 2)}
             for mode in MODES if mode != "default"
             for seed in sorted({r["seed"] for r in runs}) if (mode, seed) in by_seed and ("default", seed) in by_seed]
    out["micro_minus_default"] = diffs
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=3000)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--partition", default="dirichlet:0.5")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["default", "micro-batch-16"])
    parser.add_argument("--merge", action="store_true", help="keep the runs of --out (same setting) that this call does not redo")
    parser.add_argument("--out", default=str(RESULTS / "low_memory.json"))
    args = parser.parse_args()
    quiet_logs()
    started = machine()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="edgesplit-low-memory-") as tmp:
        for seed in args.seeds:
            data = DataSpec("fashion-mnist", args.partition, args.agents, args.train_samples, args.test_samples, seed=seed)
            for mode in args.modes:  # the modes of one seed back to back: the same machine state for all
                print(f"== {mode}, seed {seed}", flush=True)
                runs.append(run_one(mode, seed, args.rounds, data, Path(tmp)))
                print(f"   server {runs[-1]['accuracy']}  edges {runs[-1]['final_edge_accuracy']}  {runs[-1]['wall_s']} s", flush=True)
    setting = {"dataset": "fashion-mnist (32x32 zero-padded, 1 channel)", "agents": args.agents, "partition": args.partition,
                    "train_samples": args.train_samples, "test_samples": args.test_samples, "rounds": args.rounds,
                    "method": "fedgkt, defaults (batch 64, 1 edge and 1 server epoch, Adam)",
                    "seeds": "each seed is the data subset's, the partition's and the models' (server seed)",
                    "modes": {"default": "edge-agent run", "micro-batch-16": "edge-agent run --low-memory's training: micro-batches of 16, "
                              "gradients accumulated into each batch of 64 (ghost BatchNorm batches)",
                              "micro-batch-8": "the same with micro-batches of 8"}}
    out = Path(args.out)
    if args.merge and out.exists():
        previous = json.loads(out.read_text())
        if {k: v for k, v in previous["setting"].items() if k != "modes"} != {k: v for k, v in setting.items() if k != "modes"}:
            raise SystemExit(f"{out} holds another setting; run without --merge or with its setting")
        done = {(r["mode"], r["seed"]) for r in runs}
        runs = [r for r in previous["runs"] if (r["mode"], r["seed"]) not in done] + runs
        started = {**previous["machine"], "merged": started}
    write_json(out, {
        "benchmark": "low_memory", "generated_by": "python bench/low_memory.py",
        "machine": started, "setting": setting,
        "runs": sorted(runs, key=lambda r: (r["seed"], list(MODES).index(r["mode"]))),
        "summary": summarise(runs),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

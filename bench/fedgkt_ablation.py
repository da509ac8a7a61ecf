"""Why FedGKT's server model trailed its own edges: a one-factor-at-a-time ablation.

Every variant is the accuracy benchmark's FedGKT run (``bench/accuracy.py``'s
Table 1 setting and its seed 0: the same agents, training / test images,
rounds and edge training) with one setting changed from a base, so each
difference is that setting's effect. (``bench/results/fedgkt_ablation.json``
was measured at the benchmark's earlier setting, 8 agents x 250 images, and
scored on the agents' test shards: its JSON has no ``eval_set``.) The base,
``old``, is the defaults before this benchmark (every agent draws its own
ResNet-8 initialisation, server weight decay 5e-4, ...); every variant changes
one setting of it.

Each run records, per round, the server model's global accuracy (every agent's
extractor + server model on the run's global test set, the server's running
BatchNorm statistics: what report.json calls ``accuracy``), its local accuracy
(the agents' test shards), the agents' own ResNet-8 on the global set, the same
pipeline with each agent's own BatchNorm statistics (``personalised_bn``) and
(``fedgkt.eval_diagnostics``) the server's training accuracy in its last epoch.

    python bench/fedgkt_ablation.py                       # every variant, both partitions
    python bench/fedgkt_ablation.py --only old shared-init --partition iid --merge
    python bench/fedgkt_ablation.py --only --step-cost --merge    # the server step's cost per map by batch size

Writes ``bench/results/fedgkt_ablation.json`` (``--merge`` keeps the variants
recorded before at the same scale); ``bench/render_results.py`` puts the table
in ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, round_series, run_federation, write_json
from accuracy import AGENTS, GKT_SYNC, PARTITIONS, SCALES

# The defaults before this benchmark, as bench/accuracy.py ran them (batch 32 at this scale).
# server_order and train_extractor: as they were then (later defaults: "mixed", false).
OLD = {**GKT_SYNC, "edge_init": "per_agent", "server_weight_decay": 5e-4, "edge_weight_decay": 5e-4,
       "server_order": "shuffled", "train_extractor": True,
       "lr_schedule": "plateau", "eval_diagnostics": True}

# (name, base, change, what it tests). Each changes one thing from its base.
VARIANTS: list[tuple[str, str, dict[str, Any], str]] = [
    ("old", "old", {}, "the defaults before this benchmark"),
    ("shared-init", "old", {"edge_init": "shared"}, "every agent's ResNet-8 starts from the server's initial weights"),
    ("server-epochs-3", "old", {"server_epochs": 3}, "3 server epochs per round instead of 1 (the paper: 20 IID / 40 non-IID)"),
    ("server-kd-off", "old", {"kd": "s2e"}, "the server trains on CE only (no KD from the edges' logits)"),
    ("wd-1e-4", "old", {"server_weight_decay": 1e-4, "edge_weight_decay": 1e-4}, "weight decay 1e-4 (Table 10) instead of 5e-4"),
    ("no-lr-schedule", "old", {"lr_schedule": "none"}, "no ReduceLROnPlateau on the server"),
    ("server-batch-64", "old", {"server_batch_size": 64}, "server batch 64 instead of 32"),
]


def spec(name: str, key: str, rounds: int) -> RunSpec:
    _, base, change, _ = next(v for v in VARIANTS if v[0] == name)
    if base != "old":
        raise ValueError(f"variant {name!r}: unknown base {base!r} (the only base is 'old')")
    config = {**OLD, **change}
    return RunSpec(f"{name}-{key}", "fedgkt", config, rounds)


def step_cost(batches: tuple[int, ...] = (32, 64, 256), steps: int = 3) -> dict[str, Any]:
    """The server step's cost per map on this machine (ResNet-55, Adam, fp32, 16 x 32 x 32
    maps) at each batch size: the median of ``steps`` timed steps after one warm-up step.
    Why the CPU defaults use batch 64 and one server epoch rather than Table 10's 256 and 20."""
    import statistics

    import torch
    import torch.nn.functional as F

    from models import build_model

    torch.manual_seed(0)
    out: dict[str, Any] = {"model": "resnet55_server", "threads": torch.get_num_threads(), "by_batch": {}}
    for batch in batches:
        model = build_model("resnet55_server", 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4, amsgrad=True)
        x, y = torch.randn(batch, 16, 32, 32), torch.randint(0, 10, (batch,))
        times = []
        for i in range(steps + 1):
            started = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i:
                times.append(time.perf_counter() - started)
        step_s = statistics.median(times)
        out["by_batch"][str(batch)] = {"step_ms": 1000 * step_s, "ms_per_map": 1000 * step_s / batch}
    out["load_average_after"] = list(os.getloadavg())
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    rounds = []
    for r, series in zip(report["rounds"], round_series(report)):
        figures = r.get("method") or {}
        scored = (r.get("evaluation") or {}).get("accuracy", {})  # global test set, per labelled model
        rounds.append({
            "round": r["round"], "accuracy": r["accuracy"], "local_accuracy": r.get("local_accuracy"),
            "edge_accuracy": r["edge_accuracy"],
            # The headline uses the server's running statistics; "personalised_bn" each agent's own.
            "accuracy_global_bn": scored.get("model"),
            "accuracy_per_agent_bn": scored.get("personalised_bn"),
            "server_train_accuracy": figures.get("server_train_accuracy"),
            "server_train_s": r.get("server_train_s"), "cumulative_wire": series["cumulative_wire"],
        })
    totals = report["totals"]
    return {"final_accuracy": totals["final_accuracy"], "best_accuracy": totals["best_accuracy"],
            "final_edge_accuracy": totals["final_edge_accuracy"], "method_config": report["config"]["method_config"],
            "eval_set": report.get("eval_set"),
            "wall_time_s": totals["wall_time_s"], "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help=f"variants to run: {[v[0] for v in VARIANTS]}")
    parser.add_argument("--partition", nargs="*", choices=sorted(PARTITIONS), default=sorted(PARTITIONS))
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (the benchmark's); synthetic for a pipeline check")
    parser.add_argument("--train-samples", type=int, default=SCALES["full"].train_samples)
    parser.add_argument("--test-samples", type=int, default=SCALES["full"].test_samples)
    parser.add_argument("--rounds", type=int, default=SCALES["full"].rounds)
    parser.add_argument("--merge", action="store_true", help="keep the variants recorded before at the same scale")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: (re)summarize the finished runs' report.json files in --run-dir (with --merge)")
    parser.add_argument("--step-cost", action="store_true", help="also measure the server step's cost per map at batch 32 / 64 / 256")
    parser.add_argument("--out", type=Path, default=RESULTS / "fedgkt_ablation.json")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "fedgkt_ablation")
    args = parser.parse_args(argv)
    names = [v[0] for v in VARIANTS]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"--only: no variants named {unknown}; the variants are {names}")
    quiet_logs()
    scale = {"dataset": args.dataset, "agents": AGENTS, "train_samples": args.train_samples,
             "test_samples": args.test_samples, "rounds": args.rounds, "partitions": PARTITIONS}
    results: dict[str, Any] = {}
    cost: dict[str, Any] | None = None
    if args.merge and args.out.exists():
        previous = json.loads(args.out.read_text())
        if previous.get("scale") == scale:
            results.update(previous["runs"])
            cost = previous.get("server_step_cost")

    def write() -> None:
        write_json(args.out, {
            "benchmark": "fedgkt_ablation",
            "description": __doc__.split("\n\n")[0],
            "scale": scale,
            "variants": {v[0]: {"base": v[1], "change": v[2], "tests": v[3]} for v in VARIANTS},
            "base_config": OLD,
            "server_step_cost": cost,
            # The balanced set the accuracies were scored on (None from servers that predate it).
            "eval_set": next((r["eval_set"] for r in results.values() if r.get("eval_set")), None),
            "machine": machine(),
            "runs": results,
            "generated_by": "bench/fedgkt_ablation.py",
        })

    if args.collect:
        for path in sorted(args.run_dir.glob("*/report.json")):
            report = json.loads(path.read_text())
            name, _, key = path.parent.name.rpartition("-")
            if name in names and key in PARTITIONS and report["status"] == "finished":
                previous_run = results.get(path.parent.name, {})
                results[path.parent.name] = {"variant": name, "partition": key, **summarize(report),
                                             "run_wall_time_s": previous_run.get("run_wall_time_s", report["totals"]["wall_time_s"]),
                                             "load_average_after": previous_run.get("load_average_after")}
        write()
    if args.step_cost:
        cost = step_cost()
        print(f"server step: {json.dumps(cost['by_batch'])}", flush=True)
        write()
    for name in names:
        if args.collect or (args.only is not None and name not in args.only):
            continue
        for key in args.partition:
            run = spec(name, key, args.rounds)
            data = DataSpec(args.dataset, PARTITIONS[key], AGENTS, args.train_samples, args.test_samples, seed=0)
            print(f"== {run.name}", flush=True)
            started = time.monotonic()
            report = run_federation(run, data, args.run_dir / run.name)
            results[run.name] = {"variant": name, "partition": key, **summarize(report),
                                 "run_wall_time_s": time.monotonic() - started, "load_average_after": list(os.getloadavg())}
            r = results[run.name]
            print(f"   server {[round(100 * x['accuracy'], 1) for x in r['rounds']]}  edge {[round(100 * x['edge_accuracy'], 1) for x in r['rounds']]}"
                  f"  per-agent BN {[None if x['accuracy_per_agent_bn'] is None else round(100 * x['accuracy_per_agent_bn'], 1) for x in r['rounds']]}"
                  f"  ({r['run_wall_time_s']:.0f} s)", flush=True)
            write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

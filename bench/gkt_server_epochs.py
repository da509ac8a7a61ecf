"""FedGKT's server epochs per round: why the server model trails its edges here.

In ``bench/accuracy.py`` every method makes one pass over the data per round
(FedGKT: one edge and one server epoch; FedAvg: one local epoch). The paper
gives FedGKT's server 20 (IID) or 40 (non-IID) epochs per round and FedAvg 20
local epochs (its Table 10). With one server epoch the server sees each
round's feature maps once, while every agent's extractor -- its own "feature
language" -- keeps changing under it, and the server's accuracy trails what
its own agents' ResNet-8 reach. This benchmark asks whether more server epochs
per round close that gap, and what they cost on the server: the accuracy
benchmark's FedGKT IID run of seed 0 (same data, rounds, edge training and
uploads), with only the server's epochs per round changed. The edges'
compute and the bytes on the wire do not depend on it.

    python bench/gkt_server_epochs.py              # server epochs 1 (reused from bench/accuracy.py when it ran) and 3
    python bench/gkt_server_epochs.py --epochs 1 2 4

Writes ``bench/results/gkt_server_epochs.json``; ``bench/render_results.py``
puts it in ``docs/results.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, reusable, round_series, run_federation, write_json
from accuracy import AGENTS, GKT_SYNC, PARTITIONS, SCALES, recorded_run, scale_folder, scale_key  # the accuracy benchmark's setting


def spec(epochs: int, rounds: int) -> RunSpec:
    return RunSpec(f"fedgkt-iid-server-epochs-{epochs}", "fedgkt", {**GKT_SYNC, "server_epochs": epochs}, rounds)


def accuracy_bench_run(run: RunSpec, data: DataSpec, accuracy_dir: Path) -> dict[str, Any] | None:
    """bench/accuracy.py's fedgkt-iid report of this seed when it is this spec on this data (1 server epoch)."""
    found = recorded_run(accuracy_dir, data.train_samples, data.test_samples, run.rounds, "fedgkt-iid", data.seed)
    return None if found is None else reusable(found[0], run, data)


def summarize(epochs: int, report: dict[str, Any]) -> dict[str, Any]:
    totals = report["totals"]
    rounds = report["rounds"]
    server_s = [r["time_s"].get("server_train") for r in rounds]
    return {
        "server_epochs": epochs, "status": report["status"], "eval_set": report.get("eval_set"),
        "final_accuracy": totals["final_accuracy"], "best_accuracy": totals["best_accuracy"],
        "final_edge_accuracy": totals["final_edge_accuracy"],
        "accuracy_by_round": [r["accuracy"] for r in rounds], "edge_accuracy_by_round": [r["edge_accuracy"] for r in rounds],
        "server_train_s_by_round": server_s, "server_train_s_total": sum(s for s in server_s if s is not None),
        "edge_train_flops_total": totals["edge_train_flops"], "wire_total_bytes": totals["wire_total"],
        "wall_time_s": totals["wall_time_s"], "rounds": round_series(report),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 3], help="server epochs per round to compare")
    parser.add_argument("--train-samples", type=int, help="default: the accuracy benchmark's full scale")
    parser.add_argument("--test-samples", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--out", type=Path, default=RESULTS / "gkt_server_epochs.json")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "gkt_server_epochs")
    parser.add_argument("--accuracy-run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "accuracy",
                        help="bench/accuracy.py's --run-dir, for its 1-epoch run")
    args = parser.parse_args(argv)
    if any(e < 1 for e in args.epochs):
        parser.error("--epochs: every value must be >= 1")
    quiet_logs()
    key = scale_key(SCALES["full"], args.train_samples, args.test_samples, args.rounds)
    rounds = key["rounds"]
    data = DataSpec("fashion-mnist", PARTITIONS["iid"], AGENTS, key["train_samples"], key["test_samples"], seed=0)
    results: dict[str, Any] = {}
    for epochs in sorted(set(args.epochs)):
        run = spec(epochs, rounds)
        report = accuracy_bench_run(run, data, args.accuracy_run_dir)
        reused = report is not None
        print(f"== server epochs {epochs}{' (bench/accuracy.py fedgkt-iid, reused)' if reused else ''}", flush=True)
        if report is None:
            report = run_federation(run, data, scale_folder(args.run_dir, key) / run.name)
        results[str(epochs)] = {**summarize(epochs, report), "reused_from_accuracy_bench": reused}
    write_json(args.out, {
        "benchmark": "gkt_server_epochs",
        "description": "FedGKT (ResNet-8 + ResNet-55, IID) at bench/accuracy.py's setting with only the server's epochs per "
                       "round changed: server accuracy vs its agents' and the server's training time.",
        "scale": {**key, "dataset": data.dataset, "partition": data.partition, "agents": data.agents,
                  "paper_server_epochs": {"iid": 20, "noniid": 40}},
        # The balanced set the accuracies were scored on (None from servers that predate it).
        "eval_set": next((r["eval_set"] for r in results.values() if r.get("eval_set")), None),
        "machine": machine(),
        "runs": results,
        "generated_by": "bench/gkt_server_epochs.py",
    })
    for r in results.values():
        print(f"server epochs {r['server_epochs']}: server {r['final_accuracy']:.3f} (best {r['best_accuracy']:.3f}), "
              f"edges {r['final_edge_accuracy']:.3f}, server training {r['server_train_s_total']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

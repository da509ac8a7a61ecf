"""Communication cost: FedGKT vs split learning vs FedAvg(ResNet-56), measured.

The FedGKT paper's bandwidth claim (Fig. 5) compares FedGKT with split
learning using two formulas (Appendix B.2), without compression:

* Eq. 12, SL:     (feature map + gradient at the split) x samples x epochs
* Eq. 13, FedGKT: (feature map + soft labels from the server) x samples x rounds

This benchmark runs every method through the same pipeline -- the same data,
partition, agents and broker -- and reads the bytes the server's connection
carried on the wire (MQTT packets) each round, next to those formulas computed
for the same sizes:

* ``fedgkt`` with ``raw``, ``fp16-zstd`` and ``u8-zstd`` feature-map uploads;
* ``splitnn`` (ResNet-8 stem on the agents + ResNet-55 on the server, per-batch
  activations up and gradients down, fp32 as in vanilla SL);
* ``fedavg`` with ResNet-56 (lossless zstd weights both ways). The paper gives
  no formula for FedAvg; the analytic column is 2 x parameters x 4 bytes per
  agent and round (one model down, one up).

Measured bytes include what the formulas leave out: FedGKT's edge logits,
labels and sample ids, the test-set uploads of evaluation rounds (every round
here, since "bytes to reach the target" needs an accuracy every round), the
frame headers and the MQTT framing. Writes ``bench/results/comm_cost.json``;
``bench/render_results.py`` turns it into the table in ``docs/results.md``.

The default setting is ``bench/accuracy.py``'s full scale, its IID
partition and its first seed (4 agents, the same data subset, rounds, batch
and optimiser), with FedGKT and FedAvg configured exactly as there, and
``--reuse-runs`` takes the accuracy benchmark's ``fedgkt-iid`` and
``fedavg-resnet56-iid`` reports of seed 0 (same spec, same data) instead of
training them again. Accuracies are the reports' global accuracy (the
balanced evaluation set, ``eval_set`` in the JSON); the bytes are training's.

    python bench/comm_cost.py --reuse-runs          # the default scale; reuse finished runs of the same spec
    python bench/comm_cost.py --agents 8 --train-samples 8000 --rounds 20 --target 0.85
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, reusable, round_series, run_federation, write_json
from accuracy import AGENTS, BATCH, FEDAVG, GKT_SYNC, PARTITIONS, SCALES, recorded_run  # the accuracy benchmark's setting, not a copy
from accuracy import runs as accuracy_runs

FEATURE_CHANNELS, IMAGE_SIZE, FP32_BYTES = 16, 32, 4
# The paper's Fig. 5 (ResNet-56, GB) and the sizes behind it: CIFAR-10, 50,000 training images.
PAPER_FIG5 = {"dataset": "cifar10", "samples": 50_000, "num_classes": 10, "sl_gb": 249.6, "fedgkt_gb": 125.3}


def runs(rounds: int, batch_size: int) -> list[RunSpec]:
    """Every run does one pass over the data per round: one edge and one server epoch
    (FedGKT), one epoch per agent's turn (SL), one local epoch (FedAvg). FedGKT and
    FedAvg are set up as in bench/accuracy.py (its fp16-zstd FedGKT run and its FedAvg
    run are these, at the same batch size)."""
    gkt = {**GKT_SYNC, "edge_batch_size": batch_size, "server_batch_size": batch_size}
    return [
        RunSpec("fedgkt-raw", "fedgkt", {**gkt, "upload_codec": "raw"}, rounds),
        RunSpec("fedgkt-fp16-zstd", "fedgkt", {**gkt, "upload_codec": "fp16-zstd"}, rounds),
        RunSpec("fedgkt-u8-zstd", "fedgkt", {**gkt, "upload_codec": "u8-zstd"}, rounds),
        RunSpec("splitnn", "splitnn", {"server_model": gkt["server_model"], "local_epochs": 1, "batch_size": batch_size,
                                       "server_lr": gkt["server_lr"], "edge_lr": gkt["edge_lr"], "upload_codec": "raw"}, rounds),
        RunSpec("fedavg-resnet56", "fedavg", {**FEDAVG, "batch_size": batch_size}, rounds),
    ]


def analytic(method: str, samples: int, num_classes: int, agents: int, model_params: int | None) -> dict[str, Any]:
    """Bytes per round by the paper's formulas (FedAvg: ours), for these sizes."""
    feature_map = FEATURE_CHANNELS * IMAGE_SIZE * IMAGE_SIZE * FP32_BYTES
    if method == "splitnn":
        per_sample = feature_map + feature_map  # Eq. 12: activation up + gradient down, once per epoch
        return {"formula": "Eq. 12: (feature map + gradient) x samples x epochs", "per_sample_bytes": per_sample,
                "per_round_bytes": per_sample * samples}
    if method == "fedgkt":
        per_sample = feature_map + num_classes * FP32_BYTES  # Eq. 13: feature map up + soft labels down
        return {"formula": "Eq. 13: (feature map + soft labels) x samples x rounds", "per_sample_bytes": per_sample,
                "per_round_bytes": per_sample * samples}
    if method == "fedavg" and model_params is not None:
        return {"formula": "ours: 2 x parameters x 4 B x agents per round (model down and up)", "per_sample_bytes": None,
                "per_round_bytes": 2 * model_params * FP32_BYTES * agents}
    raise ValueError(f"no formula for {method}")


def paper_check() -> dict[str, Any]:
    """How many epochs/rounds Fig. 5's numbers imply with Eqs. 12-13 (the paper does not say)."""
    n, k = PAPER_FIG5["samples"], PAPER_FIG5["num_classes"]
    sl = analytic("splitnn", n, k, 0, None)["per_round_bytes"]
    gkt = analytic("fedgkt", n, k, 0, None)["per_round_bytes"]
    return {
        **PAPER_FIG5,
        "sl_bytes_per_epoch": sl, "fedgkt_bytes_per_round": gkt,
        "implied_sl_epochs_if_gb_is_1e9": PAPER_FIG5["sl_gb"] * 1e9 / sl,
        "implied_fedgkt_rounds_if_gb_is_1e9": PAPER_FIG5["fedgkt_gb"] * 1e9 / gkt,
        "implied_sl_epochs_if_gb_is_2pow30": PAPER_FIG5["sl_gb"] * 2**30 / sl,
        "implied_fedgkt_rounds_if_gb_is_2pow30": PAPER_FIG5["fedgkt_gb"] * 2**30 / gkt,
        "note": "Fig. 5 is consistent with both methods running the same number (about 38-41) of epochs/rounds; "
                "the SL/FedGKT ratio of ~2 is then just (map + gradient) / (map + soft labels).",
    }


def summarize(run: RunSpec, report: dict[str, Any], data: DataSpec, targets: list[float]) -> dict[str, Any]:
    series = round_series(report)
    target = targets[0]
    reached = next((r for r in series if r["accuracy"] is not None and r["accuracy"] >= target), None)
    edge = report["models"]["edge"]
    params = edge["params"] if run.method == "fedavg" else None
    formula = analytic(run.method, data.train_samples, report_num_classes(report), data.agents, params)
    totals = report["totals"]
    measured_per_round = totals["wire_total"] / max(len(series), 1)
    to_targets = []
    for t in targets:
        hit = next((r for r in series if r["accuracy"] is not None and r["accuracy"] >= t), None)
        to_targets.append({
            "target_accuracy": t, "rounds": None if hit is None else hit["round"],
            "wire_bytes": None if hit is None else hit["cumulative_wire"],
            "analytic_bytes": None if hit is None else formula["per_round_bytes"] * hit["round"],
        })
    return {
        "method": run.method,
        "codec": run.method_config.get("upload_codec", "zstd"),
        "method_config": report["config"]["method_config"],
        "models": report["models"],
        "status": report["status"],
        "rounds": series,
        "final_accuracy": totals["final_accuracy"],
        "best_accuracy": totals["best_accuracy"],
        "measured": {
            "wire_total_bytes": totals["wire_total"], "payload_total_bytes": totals["up_payload"] + totals["down_payload"],
            "wire_per_round_bytes": measured_per_round, "up_wire_bytes": totals["up_wire"], "down_wire_bytes": totals["down_wire"],
            "rounds_to_target": None if reached is None else reached["round"],
            "wire_bytes_to_target": None if reached is None else reached["cumulative_wire"],
            "edge_train_flops_total": totals["edge_train_flops"],
            "wall_time_s": totals["wall_time_s"],
        },
        "analytic": {
            **formula,
            "total_bytes": formula["per_round_bytes"] * len(series),
            "bytes_to_target": None if reached is None else formula["per_round_bytes"] * reached["round"],
            "measured_over_analytic": measured_per_round / formula["per_round_bytes"],
        },
        "to_targets": to_targets,
    }


def report_num_classes(report: dict[str, Any]) -> int:
    return int(report["config"]["num_classes"])


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def accuracy_bench_report(run: RunSpec, data: DataSpec, accuracy_dir: Path) -> Path | None:
    """Where bench/accuracy.py left its run of this spec on this data, if it made one
    (its summary.json says the partition)."""
    keys = [key for key, spec in PARTITIONS.items() if spec == data.partition]
    if data.agents != AGENTS or data.dataset != "fashion-mnist" or not keys:
        return None
    for _table, key, spec in accuracy_runs(run.rounds):
        if key == keys[0] and spec.method == run.method and spec.method_config == run.method_config and spec.eval_every == run.eval_every:
            found = recorded_run(accuracy_dir, data.train_samples, data.test_samples, run.rounds, spec.name, data.seed)
            if found is not None and found[1]["partition"] == key:
                return found[0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    full = SCALES["full"]
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default=PARTITIONS["iid"])
    parser.add_argument("--agents", type=int, default=AGENTS)
    parser.add_argument("--train-samples", type=int, default=full.train_samples)
    parser.add_argument("--test-samples", type=int, default=full.test_samples)
    parser.add_argument("--rounds", type=int, default=full.rounds)
    parser.add_argument("--seed", type=int, default=0, help="the data's and the models' seed (bench/accuracy.py's seeds)")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--target", type=float, nargs="+", default=[0.3, 0.25, 0.2],
                        help="target test accuracies for 'bytes to reach the target' (the first is the headline; the "
                             "default is one every method reaches at the default scale)")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="take finished runs of the same spec and data from --run-dir, or bench/accuracy.py's "
                             "(--accuracy-run-dir), instead of training again")
    parser.add_argument("--only", nargs="*", help="run only these runs (names as in the output)")
    parser.add_argument("--out", type=Path, default=RESULTS / "comm_cost.json")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "comm_cost")
    parser.add_argument("--accuracy-run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "accuracy",
                        help="bench/accuracy.py's --run-dir")
    args = parser.parse_args(argv)
    quiet_logs()
    data = DataSpec(args.dataset, args.partition, args.agents, args.train_samples, args.test_samples, seed=args.seed)
    started = time.monotonic()
    results: dict[str, Any] = {}
    reused: dict[str, str] = {}
    for run in runs(args.rounds, args.batch_size):
        if args.only and run.name not in args.only:
            continue
        report = None
        if args.reuse_runs:
            for path in (args.run_dir / run.name / "report.json", accuracy_bench_report(run, data, args.accuracy_run_dir)):
                if path is not None and (report := reusable(path, run, data)) is not None:
                    reused[run.name] = _shown(path.parent)
                    break
        print(f"== {run.name}{f' (reused: {reused[run.name]})' if report is not None else ''}", flush=True)
        if report is None:
            report = run_federation(run, data, args.run_dir / run.name)
            write_json(args.run_dir / run.name / "data.json", dataclasses.asdict(data))
        results[run.name] = {**summarize(run, report, data, args.target), "started_at": report["started_at"],
                             "eval_set": report.get("eval_set")}
    elapsed = time.monotonic() - started
    training_s = sum(r["measured"]["wall_time_s"] for r in results.values())
    fm = FEATURE_CHANNELS * IMAGE_SIZE * IMAGE_SIZE * FP32_BYTES
    write_json(args.out, {
        "benchmark": "comm_cost",
        "description": "Bytes on the wire per round and to a target accuracy: FedGKT (3 upload codecs), split learning, "
                       "FedAvg(ResNet-56), same data and partition, next to the paper's Eqs. 12-13.",
        "scale": {
            "dataset": data.dataset, "partition": data.partition, "agents": data.agents, "train_samples": data.train_samples,
            "test_samples": data.test_samples, "rounds": args.rounds, "batch_size": args.batch_size, "seed": data.seed,
            "target_accuracy": args.target[0],
            "targets": args.target,
            "evaluation": "every round (test-set uploads / evaluation downloads are in the measured bytes)",
            "wall_time_s": training_s, "script_wall_time_s": elapsed,
            "note": "a CPU-scale run (bench/accuracy.py's data and first seed when run with its defaults); the paper's CIFAR-10 setup "
                    "has 50,000 samples and 16 agents",
        },
        "sizes": {"feature_map_bytes_fp32": fm, "gradient_bytes_fp32": fm, "soft_labels_bytes": 10 * FP32_BYTES},
        "measured_where": "the server's MQTT connection: PUBLISH packets (header, topic, properties, payload) and PUBACKs, per round",
        "paper_fig5_check": paper_check(),
        "machine": {**machine(), "runs_started_utc": min(r["started_at"] for r in results.values()) if results else None},
        "reused_runs": reused,  # run -> the directory whose report was taken (--reuse-runs) instead of training again
        # The balanced set every run's accuracy was scored on (None from servers that predate it).
        "eval_set": next((r["eval_set"] for r in results.values() if r.get("eval_set")), None),
        "runs": results,
        "generated_by": "bench/comm_cost.py",
    })
    for name, r in results.items():
        m = r["measured"]
        to_target = "-" if m["wire_bytes_to_target"] is None else f"{m['wire_bytes_to_target'] / 1e6:.2f} MB"
        print(f"{name:18s} acc {r['final_accuracy'] or 0:.3f}  wire/round {m['wire_per_round_bytes'] / 1e6:8.2f} MB  "
              f"analytic/round {r['analytic']['per_round_bytes'] / 1e6:8.2f} MB  to target: round {m['rounds_to_target']}, {to_target}")
    print(f"total {elapsed / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FedKD at reduced scale on Fashion-MNIST: bytes against FedAvg of a mentor-sized
model, Eq. 8's ranks per tensor, and accuracy.

The setting is the baselines' quick scale as ``bench/results/fedkd.json`` was
measured with it (``bench/accuracy.py`` before Table 1 moved to 4 agents and
several seeds; pinned here, ``AGENTS``, ``QUICK`` and ``LEARNING``): 8 agents,
600 training / 200 test Fashion-MNIST images, iid and Dirichlet(0.5)
partitions (``bench/accuracy.py``'s), 2 rounds, one pass over each agent's data
per round, Adam with lr 0.001, ``bench/accuracy.py``'s batch size, seed 0.
FedKD runs with the ResNet-56 mentor (the model the baselines' FedAvg trains)
and the ResNet-8 mentee, T from 0.95 to 0.98 over the run's rounds (Eq. 9),
through the real pipeline (``bench/_federation.py``: a mosquitto on a free
loopback port, the coordinator and 8 ``EdgeAgent`` s with their own MQTT
connections, taking turns on the CPU).

Every figure comes from the run report: the generic per-round bytes (all
messages on the server's connection) and FedKD's own record per round
(``record["method"]``, ``FedKdServer.round_report``): T, Eq. 8's rank per
matrix, and float32 payload bytes per agent and round, both directions --
FedKD's factors vs the dense mentee update vs FedAvg of the mentor.

Communication is compared three ways, per agent and round:

* ``payload``: float32 tensor values, the paper's measure (FedKD's factors up
  and down vs the mentor's float state up and down);
* ``frames``: every byte of FedKD's round on the wire vs two zstd frames of the
  mentor's float state (what FedAvg sends each way);
* ``measured``: FedKD's wire bytes vs the wire bytes of the baselines' FedAvg
  ResNet-56 run on the same data in ``bench/results/accuracy.json`` (same
  agents, subsets, partition and batch; over the rounds both runs have), which
  also gives FedAvg's accuracy by round next to FedKD's.

Accuracy per round: the global mentee (the federated model) and the agents'
mentors (the model FedKD uses for inference), both on the union of the
agents' test shards. At the quick scale an agent takes a handful of optimiser
steps a round, too few for any model to learn; a third run
(``learning-iid``) uses the baselines' full-scale data (more images per agent)
and the cheaper ResNet-20 mentor to show FedKD learning within the time budget.

    python bench/fedkd.py            # the three runs; planned for at most ~15 minutes on 2 shared cores
    python bench/fedkd.py --quick    # iid at the quick scale only: a smoke run
    python bench/fedkd.py --refresh-fedavg   # after bench/accuracy.py ran again: re-read its FedAvg runs

Writes ``bench/results/fedkd.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _federation import RESULTS, DataSpec, RunSpec, machine, quiet_logs, round_series, run_federation, write_json
from _federation import BATCH, PARTITIONS  # the baselines' batch and partitions

# The baselines' scales as bench/results/fedkd.json was measured with them (bench/accuracy.py's
# quick and full scales before Table 1 moved to 4 agents x 1,000 images and three seeds).
AGENTS = 8
QUICK = {"train_samples": 600, "test_samples": 200, "rounds": 2}
LEARNING = {"train_samples": 2000, "test_samples": 500, "rounds": 4}

from models import build_model, state_dict_to_arrays
from shared_protocol.messages import RoundStart, encode_message


@dataclass(frozen=True)
class Run:
    key: str
    purpose: str
    partition: str  # a key of PARTITIONS
    train_samples: int
    test_samples: int
    rounds: int
    mentor: str = "resnet56"
    mentee: str = "resnet8"

    def method_config(self) -> dict[str, Any]:
        # schedule_rounds is left at 0: Eq. 9's horizon is the run's rounds.
        return {"mentor_model": self.mentor, "mentee_model": self.mentee, "threshold_start": 0.95, "threshold_end": 0.98,
                "local_epochs": 1, "batch_size": BATCH, "optimizer": "adam", "mentor_lr": 0.001, "mentee_lr": 0.001}


def plan(quick: bool, learning_run: bool) -> list[Run]:
    runs = [Run(key, "the baselines' quick scale (bench/accuracy.py --quick as fedkd.json was measured): same data, partition, "
                "rounds, passes, optimiser, batch", key, QUICK["train_samples"], QUICK["test_samples"], QUICK["rounds"])
            for key in (["iid"] if quick else list(PARTITIONS))]
    if learning_run and not quick:
        # 250 images per agent instead of 75: enough steps per round to learn something.
        runs.append(Run("learning-iid", "the baselines' full-scale data (bench/accuracy.py as fedkd.json was measured), 4 rounds, "
                        "ResNet-20 mentor: to show FedKD learning within the time budget", "iid", LEARNING["train_samples"],
                        LEARNING["test_samples"], LEARNING["rounds"], mentor="resnet20"))
    return runs


def float_values(model_name: str, in_channels: int = 1) -> int:
    state = state_dict_to_arrays(build_model(model_name, 10, in_channels))
    return int(sum(v.size for v in state.values() if v.dtype.kind == "f"))


def fedavg_frame_bytes(model_name: str, in_channels: int = 1) -> int:
    """One frame carrying a model's float state as FedAvg moves it (``zstd`` weights)."""
    state = {k: v for k, v in state_dict_to_arrays(build_model(model_name, 10, in_channels)).items() if v.dtype.kind == "f"}
    msg = RoundStart(run="bench", round=1, sender="server", method="fedavg", deadline_s=1.0, weights=state)
    return len(encode_message(msg, codecs={"weights": "zstd"}))


def reduction(ours: float, theirs: float) -> float | None:
    return round(1.0 - ours / theirs, 4) if theirs else None


def fedavg_baseline(run: Run, path: Path = RESULTS / "accuracy.json") -> dict[str, Any] | None:
    """The baselines' FedAvg ResNet-56 run on the same data (agents, subsets, partition, batch) in
    ``bench/results/accuracy.json``, over the rounds both runs have; None if there is none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    scale = data.get("scale", {}) if isinstance(data, dict) else {}
    same_data = (scale.get("agents"), scale.get("train_samples"), scale.get("test_samples"), scale.get("batch_size"))
    if same_data != (AGENTS, run.train_samples, run.test_samples, BATCH):
        return None
    found = data.get("runs", {}).get(f"fedavg-resnet56-{run.partition}")
    if not isinstance(found, dict) or found.get("status") not in ("finished", "stopped_target") or not found.get("rounds"):
        return None
    common = [r for r in found["rounds"] if r["round"] <= run.rounds]
    return {
        "source": f"bench/results/accuracy.json runs.fedavg-resnet56-{run.partition} (scale {scale.get('name')}, "
                  f"{scale.get('rounds')} rounds, made {data.get('machine', {}).get('date_utc')})",
        "rounds_compared": len(common),
        "accuracy_by_round": [r["accuracy"] for r in common],
        "accuracy_at_last_compared_round": common[-1]["accuracy"] if common else None,
        "final_accuracy_of_its_run": found.get("final_accuracy"),
        "wire_bytes_per_agent_round": [r["wire"] / AGENTS for r in common],
    }


def measured_comparison(rounds: list[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, Any] | None:
    """FedKD's wire bytes per agent vs the measured FedAvg run's, over the rounds both have."""
    if baseline is None or not baseline["rounds_compared"]:
        return None
    n = baseline["rounds_compared"]
    ours = sum(r.get("wire_bytes_per_agent", 0.0) for r in rounds[:n])
    theirs = sum(baseline["wire_bytes_per_agent_round"])
    return {"rounds": n, "fedkd_wire_bytes_per_agent": round(ours, 1), "fedavg_wire_bytes_per_agent": round(theirs, 1),
            "saved": reduction(ours, theirs)}


def summarize(run: Run, report: dict[str, Any], wall_s: float) -> dict[str, Any]:
    series = round_series(report)
    rounds, totals = [], {"fedkd_payload": 0.0, "dense_mentee_payload": 0.0, "fedavg_mentor_payload": 0.0,
                          "fedkd_frames": 0.0, "fedavg_mentor_frames": 0.0, "sync_payload": 0.0}
    frame = fedavg_frame_bytes(run.mentor)
    for record, wire in zip(report["rounds"], series):
        figures = record.get("method", {})
        if record["status"] != "ok" or "fedkd_bytes" not in figures:
            rounds.append({"round": record["round"], "status": record["status"]})
            continue
        frames = wire["wire"] / AGENTS
        totals["fedkd_payload"] += figures["fedkd_bytes"]
        totals["dense_mentee_payload"] += figures["dense_mentee_bytes"]
        totals["fedavg_mentor_payload"] += figures["fedavg_mentor_bytes"]
        totals["fedkd_frames"] += frames
        totals["fedavg_mentor_frames"] += 2 * frame
        totals["sync_payload"] += figures["sync_bytes"] / AGENTS
        ranks = figures["ranks"]
        rounds.append({
            "round": record["round"],
            "status": record["status"],
            "threshold": figures["threshold"],
            "global_mentee_accuracy": record["accuracy"],
            "mentor_accuracy": record["edge_accuracy"],
            "payload_bytes_per_agent": {k: figures[k] for k in (
                "up_svd_bytes", "down_svd_bytes", "fedkd_bytes", "dense_mentee_bytes", "fedavg_mentor_bytes")},
            "sync_bytes_per_agent": figures["sync_bytes"] / AGENTS,
            "wire_bytes_per_agent": frames,
            "saved": {
                "svd_vs_dense_mentee": figures["saved_vs_dense_mentee"],
                "payload_vs_fedavg_mentor": figures["saved_vs_fedavg_mentor"],
                "frames_vs_fedavg_mentor": reduction(frames, 2 * frame),
            },
            "ranks": ranks,
            "matrices_sent_factored": {
                "uploads_mean": round(len(ranks) - sum(r["up_dense"] for r in ranks.values()) / figures["agents_used"], 2),
                "aggregate": sum(1 for r in ranks.values() if not r["down_dense"]),
                "of": len(ranks),
            },
            "round_s": wire["round_s"],
        })
    # The measured FedAvg ResNet-56 run on the same data, where bench/accuracy.py made one.
    baseline = fedavg_baseline(run)
    measured = measured_comparison(rounds, baseline)
    ok = [r for r in rounds if r["status"] == "ok"]
    return {
        "status": report["status"],
        "wall_time_s": round(wall_s, 1),
        "final_global_mentee_accuracy": report["totals"]["final_accuracy"],
        "final_mentor_accuracy": report["totals"]["final_edge_accuracy"],
        "fedavg_resnet56_same_setting": baseline,
        "communication": {
            "per_agent_all_rounds_bytes": {k: round(v, 1) for k, v in totals.items()},
            "saved_vs_fedavg_mentor": {
                "payload": reduction(totals["fedkd_payload"], totals["fedavg_mentor_payload"]),
                "payload_with_sync": reduction(totals["fedkd_payload"] + totals["sync_payload"], totals["fedavg_mentor_payload"]),
                "frames": reduction(totals["fedkd_frames"], totals["fedavg_mentor_frames"]),
                "measured_fedavg_run": measured,
            },
            "saved_svd_vs_dense_mentee": reduction(totals["fedkd_payload"], totals["dense_mentee_payload"]),
            "mentee_float_values": float_values(run.mentee),
            "mentor_float_values": float_values(run.mentor),
            "fedavg_mentor_frame_bytes_zstd": frame,
        },
        "rounds": rounds,
        "rounds_ok": len(ok),
        "edge_train_flops_per_round": [r["edge_train_flops"] for r in series],
        "report_totals": {k: report["totals"][k] for k in ("wire_total", "up_wire", "down_wire", "rounds_completed")},
    }


def refresh_fedavg(out: Path) -> None:
    """Re-read bench/results/accuracy.json into an existing fedkd.json (after the baselines ran again)."""
    report = json.loads(out.read_text())
    for key, entry in report["runs"].items():
        setting = entry["setting"]
        run = Run(**{f: setting[f] for f in Run.__dataclass_fields__})
        baseline = fedavg_baseline(run)
        entry["fedavg_resnet56_same_setting"] = baseline
        entry["communication"]["saved_vs_fedavg_mentor"]["measured_fedavg_run"] = measured_comparison(entry["rounds"], baseline)
        print(f"{key}: FedAvg ResNet-56 of the same data: {'none in accuracy.json' if baseline is None else baseline['source']}")
    report["fedavg_refreshed_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(out, report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="iid at the quick scale only: a smoke run")
    parser.add_argument("--no-learning-run", action="store_true", help="skip the larger ResNet-20 run")
    parser.add_argument("--out", type=Path, default=RESULTS / "fedkd.json")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the runs' reports here (default: a temporary directory)")
    parser.add_argument("--refresh-fedavg", action="store_true",
                        help="run nothing: re-read bench/results/accuracy.json's FedAvg runs into the existing --out JSON")
    args = parser.parse_args(argv)
    if args.refresh_fedavg:
        refresh_fedavg(args.out)
        return 0
    quiet_logs()
    work = args.run_dir or Path(tempfile.mkdtemp(prefix="edgesplit-fedkd-"))
    machine_at_start = machine()  # the load average before the runs
    started = time.monotonic()
    results: dict[str, Any] = {}
    for run in plan(args.quick, not args.no_learning_run):
        data = DataSpec("fashion-mnist", PARTITIONS[run.partition], AGENTS, run.train_samples, run.test_samples, seed=0)
        print(f"== {run.key}: FedKD {run.mentor}/{run.mentee}, {data.partition}, {AGENTS} agents x {run.rounds} rounds, "
              f"{run.train_samples} / {run.test_samples} images", flush=True)
        run_started = time.monotonic()
        report = run_federation(RunSpec(f"fedkd-{run.key}", "fedkd", run.method_config(), run.rounds), data, work / run.key)
        wall = time.monotonic() - run_started
        results[run.key] = {"purpose": run.purpose, "setting": {**asdict(run), "dataset": data.dataset, "partition": data.partition,
                                                                "agents": AGENTS, "batch_size": BATCH, "seed": data.seed,
                                                                "per_round": "one pass over each agent's data (local_epochs = 1)"},
                            "method_config": report["config"]["method_config"], **summarize(run, report, wall)}
        r = results[run.key]
        print(f"   global mentee {r['final_global_mentee_accuracy']}, mentor {r['final_mentor_accuracy']}, saved vs FedAvg(mentor): "
              f"payload {r['communication']['saved_vs_fedavg_mentor']['payload']}, frames {r['communication']['saved_vs_fedavg_mentor']['frames']} "
              f"({wall:.0f} s)", flush=True)
    elapsed = time.monotonic() - started
    write_json(args.out, {
        "benchmark": "fedkd",
        "generated_by": "bench/fedkd.py" + (" --quick" if args.quick else "") + (" --no-learning-run" if args.no_learning_run else ""),
        "machine": machine_at_start,
        "load_average_at_end": list(os.getloadavg()),
        "wall_time_s": round(elapsed, 1),
        "wall_time_note": "2 cores shared with other jobs (see machine.load_average_at_start and load_average_at_end): wall "
                          "times are not comparable between runs; planned for at most ~15 minutes on this machine",
        "paper_claim": "communication reduced by up to about 95% vs FedAvg (Wu et al. 2022)",
        "definitions": {
            "payload": "float32 tensor values per agent and round, both directions: FedKD's factors (upload + aggregate) vs the "
                       "dense mentee update (up + down) vs FedAvg of the mentor (its float state up + down); from report.json "
                       "rounds[*].method (FedKdServer.round_report)",
            "frames": "FedKD: every byte of the round on the server's connection (MQTT packets, all messages incl. RoundStart, "
                      "RoundEnd, evaluation) / agents; FedAvg: 2 frames of the mentor's float state, zstd-coded",
            "measured_fedavg_run": "FedKD's wire bytes vs the wire bytes of the FedAvg ResNet-56 run of the same setting in "
                                   "bench/results/accuracy.json (absent if that file is at another scale)",
            "sync": "the whole mentee each agent gets when it does not hold the current one (round 1), not in 'payload'",
            "ranks": "per matrix of the mentee: Eq. 8's K of the aggregate (down) and of the uploads (up_min/max/mean); "
                     "*_dense when K > max_factored_rank, i.e. factors would not be smaller and the tensor went dense",
            "global_mentee_accuracy": "the shared mentee after each round's aggregate, on the union of the agents' test shards",
            "mentor_accuracy": "the agents' private mentors (FedKD's inference model) on the same shards",
        },
        "runs": results,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

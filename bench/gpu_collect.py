"""Turn what bench/gpu_checklist.sh brought back from a GPU machine into bench/results JSONs.

    python3 bench/gpu_collect.py RESULTS_DIR [--methods-dir DIR] [--tests-log FILE] [--note TEXT]

RESULTS_DIR is the unpacked ``gpu.tgz`` of one checklist call (``steps.csv``, ``smi.csv``,
``server_gpu_55.json``, ``fullscale/report.json``, ``methods/*/report.json``, ``tests.log``).
``--methods-dir`` / ``--tests-log`` take the every-method runs and the CUDA tests' log from
another call on the same machine instead (when the checklist's own attempt ran out of time).

Writes, each naming the device it ran on:

* ``server_gpu.json``: bench/server_gpu.py's figures, with the GPU utilisation nvidia-smi
  sampled while it ran, and each mode and model the call could not measure with the reason;
* ``fedgkt_fullscale.json``: the 16-agent full Fashion-MNIST FedGKT run, per round: global,
  local and edge accuracy, round and server-training seconds, the agents' compute and idle
  share, GPU memory and utilisation, and the server configuration it actually ran with;
* ``gpu_methods.json``: every method's 2-agent x 2-round run on CUDA (finished or not, the
  device its report names, accuracy per round) and the CUDA tests' outcome.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import RESULTS, write_json

from shared_protocol.registry import registered_methods


def steps(folder: Path) -> dict[str, tuple[float, float]]:
    """Each checklist step's (start, end) as Unix times, from steps.csv."""
    marks: dict[str, dict[str, float]] = {}
    for name, what, at in csv.reader((folder / "steps.csv").read_text().splitlines()):
        marks.setdefault(name, {})[what] = float(at)
    return {name: (m["start"], m["end"]) for name, m in marks.items() if "start" in m and "end" in m}


def smi_samples(folder: Path) -> list[tuple[float, float, float]]:
    """(Unix time, utilisation %, memory MiB) for each nvidia-smi sample."""
    out = []
    for row in csv.reader((folder / "smi.csv").read_text().splitlines()):
        if len(row) < 3:
            continue
        try:
            at = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            out.append((at, float(row[1].strip().rstrip(" %")), float(row[2].strip().split()[0])))
        except ValueError:
            continue
    return out


def utilisation(samples: list[tuple[float, float, float]], window: tuple[float, float]) -> dict[str, Any]:
    inside = [s for s in samples if window[0] <= s[0] <= window[1]]
    if not inside:
        return {"samples": 0}
    util = [s[1] for s in inside]
    return {"samples": len(inside), "mean_percent": statistics.fmean(util), "max_percent": max(util),
            "share_of_samples_above_50_percent": sum(u > 50 for u in util) / len(util),
            "max_memory_used_mib": max(s[2] for s in inside), "every_s": 0.5, "source": "nvidia-smi"}


def server_gpu(folder: Path, windows: dict[str, tuple[float, float]], samples: list[tuple[float, float, float]],
               note: str) -> dict[str, Any]:
    data = json.loads((folder / "server_gpu_55.json").read_text())
    data["gpu_utilization"] = utilisation(samples, windows["server55"]) if "server55" in windows else {"samples": 0}
    compiled_log = folder / "compiled.log"
    compiled = compiled_log.read_text() if compiled_log.exists() else ""
    compiled_json = folder / "server_gpu_55_compiled.json"
    if compiled_json.exists():
        for key, row in json.loads(compiled_json.read_text())["results"].items():
            data["results"].setdefault(key, {})["compiled"] = row["compiled"]
    else:
        seconds = (windows["compiled"][1] - windows["compiled"][0]) if "compiled" in windows else None
        why = ("not measured on this device: torch.compile of the ResNet-55 step had not finished after "
               f"{seconds:.0f} s, when the call's time ran out" if seconds else "not run")
        for row in data["results"].values():
            if not row.get("compiled", {}).get("measured"):
                row["compiled"] = {"measured": False, "why": why}
        eager = re.search(r"bs256/fp32 eager: ([\d,]+) samples/s, ([\d.]+) ms/step", compiled)
        if eager:
            data["repeat_of_eager_bs256_fp32_before_compiling"] = {
                "samples_per_s": float(eager.group(1).replace(",", "")), "step_ms": float(eager.group(2))}
    resnet109 = folder / "server_gpu_109.json"
    if resnet109.exists():
        data["results"].update(json.loads(resnet109.read_text())["results"])
    else:
        data["not_run_why"] = "ResNet-109: the call's time ran out before the checklist's last step"
    targets = {"bs256": 2.0, "bs64": 5.0}
    verdicts = {}
    for batch, limit in targets.items():
        row = data["results"].get(f"resnet55_server/{batch}/fp32", {})
        best = min((m for m in row.values() if m.get("measured") and "epoch_60k_s" in m), default=None,
                   key=lambda m: m["epoch_60k_s"])
        if best is not None:
            mode = next(k for k, m in row.items() if m is best)
            verdicts[batch] = {"target_epoch_s": limit, "best_epoch_s": best["epoch_60k_s"], "best_mode": mode,
                               "met": best["epoch_60k_s"] <= limit}
    data["targets"] = {"what": "one epoch over 60,000 16x32x32 maps, ResNet-55, fp32 (the issue's targets are for an H100)",
                       "verdicts": verdicts}
    data["note"] = note
    return data


def fullscale(folder: Path, windows: dict[str, tuple[float, float]], samples: list[tuple[float, float, float]],
              note: str) -> dict[str, Any]:
    report = json.loads((folder / "fullscale" / "report.json").read_text())
    method = report["config"]["method_config"]
    rounds = []
    for r in report["rounds"]:
        t = r["time_s"]
        agents = list(r["per_agent"].values())
        spent = [(a["idle_s"], a["compute_s"] + a["encode_s"] + a["network_s"] + a["idle_s"]) for a in agents]
        idle = [idle_s / total_s for idle_s, total_s in spent if total_s > 0]
        server = r["server"]
        rounds.append({
            "round": r["round"], "accuracy": r["accuracy"], "local_accuracy": r["local_accuracy"],
            "edge_accuracy": r["edge_accuracy"], "round_s": t["round"], "server_train_s": t["server_train"],
            "edge_compute_s_mean": t["edge_compute"], "edge_idle_s_mean": t["edge_idle"],
            "agents_idle_share_mean": statistics.fmean(idle) if idle else None,
            "up_wire_bytes": r["bytes"]["up_wire"] if isinstance(r.get("bytes"), dict) and "up_wire" in r["bytes"] else None,
            "gpu_peak_memory_bytes": server.get("peak_memory_bytes"),
            "gpu_utilization_percent": server.get("gpu_utilization_percent"),
            "gpu_utilization_samples": server.get("gpu_utilization_samples"),
            "participants": len(agents),
        })
    accuracies = [r["accuracy"] for r in rounds]
    return {
        "benchmark": "fedgkt_fullscale",
        "device": report["server"].get("device"),
        "device_name": rounds and report["rounds"][0]["server"].get("device_name"),
        "server": report["server"],
        "setup": {"agents": report["config"]["expected_agents"], "agent_processes": True,
                  "dataset": report["config"]["dataset"], "train_samples": "all (60,000)", "eval_set": report.get("eval_set"),
                  "partition": "iid", "rounds_planned": report["config"]["rounds"], "method_config": method,
                  "command": "edgesplit local --method fedgkt --agents 16 --rounds 10 --train-samples 0 "
                             "--test-samples 0 --partition iid --set fedgkt.preset=paper-iid"},
        "rounds": rounds,
        "rounds_completed": len(rounds),
        "status": report["status"] if len(rounds) >= report["config"]["rounds"] else
        f"stopped after {len(rounds)} of {report['config']['rounds']} rounds: the device call's time ran out",
        "target": {"what": "global accuracy >= 88 % by round 10", "best_so_far": max(accuracies) if accuracies else None,
                   "reached": any(a >= 0.88 for a in accuracies) or None},
        "gpu_utilization_nvidia_smi": utilisation(samples, windows["fullscale"]) if "fullscale" in windows else None,
        "totals": report["totals"],
        "note": note,
    }


def methods(methods_dir: Path, tests_log: Path | None, note: str) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for name in (*registered_methods(), "centralized"):
        path = methods_dir / name / "report.json"
        if not path.exists():
            runs[name] = {"finished": False, "why": "no report.json"}
            continue
        report = json.loads(path.read_text())
        runs[name] = {
            "finished": report["status"] == "finished", "status": report["status"],
            "device": report["server"].get("device"), "rounds": len(report["rounds"]),
            "accuracy": [r["accuracy"] for r in report["rounds"]],
            "round_s": [r["time_s"]["round"] for r in report["rounds"]],
        }
    tests: dict[str, Any] = {}
    if tests_log is not None and tests_log.exists():
        text = tests_log.read_text()
        summary = re.findall(r"^(\d+ passed.*?) in ([\d.]+)s", text, re.M)
        tests = {"file": "tests/test_server_step.py -k cuda", "summary": summary[-1][0] if summary else None,
                 "durations": re.findall(r"^\s*([\d.]+)s call\s+(\S+)", text, re.M), "failed": "failed" in text.lower()}
    return {"benchmark": "gpu_methods", "setup": "2 agents x 2 rounds, 1,000 training / 500 test images, IID, server on CUDA, "
            "the seven federated methods at once (and centralized on the GPU)", "runs": runs, "cuda_tests": tests,
            "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--methods-dir", type=Path)
    parser.add_argument("--tests-log", type=Path)
    parser.add_argument("--note", default="")
    parser.add_argument("--fullscale-note", default="")
    parser.add_argument("--methods-note", default="")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    windows, samples = steps(args.folder), smi_samples(args.folder)
    # A step the call skipped (gpu_checklist.sh's SKIP) leaves its recorded JSON as it is.
    if (args.folder / "server_gpu_55.json").exists():
        write_json(args.out / "server_gpu.json", server_gpu(args.folder, windows, samples, args.note))
    if (args.folder / "fullscale" / "report.json").exists():
        write_json(args.out / "fedgkt_fullscale.json", fullscale(args.folder, windows, samples, args.fullscale_note))
    methods_dir = args.methods_dir or args.folder / "methods"
    if methods_dir.exists():
        write_json(args.out / "gpu_methods.json", methods(methods_dir, args.tests_log or args.folder / "tests.log", args.methods_note))


if __name__ == "__main__":
    main()

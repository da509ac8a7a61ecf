"""Did a change keep the accuracy bench's numbers? Rerun some of its runs, compare with the record.

    python bench/accuracy.py --only fedgkt-iid --seeds 0 --out /tmp/rerun/gkt.json --run-dir /tmp/rerun/runs
    python bench/accuracy_rerun.py /tmp/rerun/*.json [--note TEXT]

For every run in the rerun JSONs that bench/results/accuracy.json also holds: per round, the
accuracies (global, local, edge), the edge training FLOPs and samples, and the bytes on the
wire, recorded vs rerun. ``same_figures`` is true when every accuracy, FLOP and sample count is
equal to the last digit; wire bytes are reported as differences (a message field added since the
record changes them by a few bytes per message without touching what was trained). Writes
``bench/results/accuracy_rerun.json``: a change that is meant to leave training alone must give
the accuracy bench's figures to the decimal before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from _common import RESULTS, machine, write_json

FIGURES = ("accuracy", "local_accuracy", "edge_accuracy", "edge_local_accuracy", "edge_train_flops", "samples")
WIRE = ("up_wire", "down_wire", "wire")


def compare(recorded: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    rounds = []
    for old, new in zip(recorded["rounds"], rerun["rounds"]):
        row: dict[str, Any] = {"round": old["round"]}
        for key in FIGURES:
            if key in old or key in new:
                row[key] = {"recorded": old.get(key), "rerun": new.get(key)}
        row["wire_delta_bytes"] = {key: new[key] - old[key] for key in WIRE if key in old and key in new}
        rounds.append(row)
    same = len(recorded["rounds"]) == len(rerun["rounds"]) and all(
        cell["recorded"] == cell["rerun"] for row in rounds for key, cell in row.items() if key in FIGURES)
    return {"rounds_recorded": len(recorded["rounds"]), "rounds_rerun": len(rerun["rounds"]), "same_figures": same,
            "final_accuracy": {"recorded": recorded.get("final_accuracy"), "rerun": rerun.get("final_accuracy")},
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reruns", nargs="+", type=Path)
    parser.add_argument("--recorded", type=Path, default=RESULTS / "accuracy.json")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=RESULTS / "accuracy_rerun.json")
    args = parser.parse_args()
    recorded = json.loads(args.recorded.read_text())
    runs: dict[str, Any] = {}
    for path in args.reruns:
        for name, run in json.loads(path.read_text())["runs"].items():
            if name not in recorded["runs"]:
                raise SystemExit(f"{path}: run {name!r} is not in {args.recorded}; its runs: {sorted(recorded['runs'])}")
            runs[name] = compare(recorded["runs"][name], run)
            print(f"{name}: {'same figures' if runs[name]['same_figures'] else 'FIGURES DIFFER'}")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    write_json(args.out, {"benchmark": "accuracy_rerun", "generated_by": "bench/accuracy_rerun.py", "machine": machine(),
                          "recorded": {"file": str(args.recorded.name), "date": recorded["machine"].get("date")},
                          "rerun_commit": head, "all_same_figures": all(r["same_figures"] for r in runs.values()),
                          "note": args.note, "runs": runs})


if __name__ == "__main__":
    main()

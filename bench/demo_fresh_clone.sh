#!/bin/bash
# `make demo` on a fresh clone of this repository, install included, timed on this machine:
# writes bench/results/demo_fresh_clone.json (the whole command's seconds, the run's own seconds
# from its report, the commit, the machine). Run it on idle cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git clone -q "$ROOT" "$WORK/edgesplit"
cd "$WORK/edgesplit"
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
START=$(date +%s.%N)
make demo > "$WORK/demo.log" 2>&1 || { tail -20 "$WORK/demo.log"; exit 1; }
END=$(date +%s.%N)
python3 - "$START" "$END" "$LOAD" "$ROOT/bench/results/demo_fresh_clone.json" <<'PY'
import json, os, platform, subprocess, sys
start, end, load, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
report = json.load(open("runs/demo/report.json"))
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
doc = {"benchmark": "demo_fresh_clone", "generated_by": "bench/demo_fresh_clone.sh",
       "command": "git clone REPO && cd CLONE && make demo", "seconds": end - start,
       "run_wall_s": report["totals"]["wall_time_s"], "final_accuracy": report["totals"]["final_accuracy"],
       "commit": subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip(),
       "machine": {"cpu_model": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                   "load_average_at_start": [float(x) for x in load.split()]}}
json.dump(doc, open(out, "w"), indent=1)
print(f"make demo on a fresh clone: {doc['seconds']:.0f} s (its run {doc['run_wall_s']:.0f} s)")
PY

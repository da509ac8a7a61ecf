"""FedGKT's server model on a balanced test set after non-IID training.

The demo's federation (``make demo``: Fashion-MNIST, 4 agents, 3,000 training /
1,000 test images, Dirichlet(0.5), 6 rounds) in one process over a real
mosquitto (``bench/_federation.py``), with every agent's TEST share replaced by
the whole seeded 1,000-image test subset (``--test-share balanced``), training
shares unchanged. Agent k's inference model is its extractor followed by the
server model, so the server's accuracy on those maps is the pipeline's accuracy
on a label-balanced set:

* ``accuracy_global_bn``: BatchNorm with the server's running statistics;
* ``accuracy_per_agent_bn``: each agent's statistics, recomputed on its training maps;
* ``edge_accuracy``: the agents' own ResNet-8s;
* ``server_train_accuracy``: the server's accuracy in its last training epoch.

    python bench/gkt_balanced.py --variant base --seed 0 --out runs-gkt/base-s0
    python bench/gkt_balanced.py --variant base --set kd=s2e --seed 0 --out runs-gkt/s2e-s0

Writes ``summary.json`` next to the run's ``report.json`` in ``--out``;

    python bench/gkt_balanced.py --collect runs-gkt

gathers every ``*/summary.json`` under a folder into ``bench/results/gkt_balanced.json``
and prints the table (docs/methods/fedgkt.md, "Non-IID agents and the balanced test set").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _federation import RESULTS, DataSpec, RunSpec, machine, quiet_logs, run_federation, write_json


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    rounds = []
    for r in report["rounds"]:
        m = r.get("method") or {}
        rounds.append({
            "round": r["round"], "status": r["status"], "accuracy": r["accuracy"],
            "accuracy_global_bn": m.get("accuracy_global_bn"), "accuracy_per_agent_bn": m.get("accuracy_per_agent_bn"),
            "edge_accuracy": r["edge_accuracy"], "server_train_accuracy": m.get("server_train_accuracy"),
            "round_s": r["time_s"]["round"], "server_train_s": (r.get("server") or {}).get("train_s"),
        })
    final = rounds[-1] if rounds else {}
    times = [r["round_s"] for r in rounds if r["round_s"] is not None]
    return {"final": final, "mean_round_s": sum(times) / len(times) if times else None,
            "total_round_s": sum(times), "rounds": rounds}


def collect(folder: Path) -> None:
    runs = []
    for path in sorted(folder.glob("*/summary.json")):
        s = json.loads(path.read_text())
        s.pop("machine", None)
        runs.append({"run": path.parent.name, **s})
    write_json(RESULTS / "gkt_balanced.json", {"what": __doc__.split("\n\n")[0], "runs": runs})
    print(f"{'run':28} {'seed':>4} {'global':>7} {'per-agent':>9} {'edge':>6} {'train':>6} {'round s':>8}  test share")
    for r in runs:
        f = r["final"]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
        print(f"{r['run']:28} {r['seed']:>4} {pct(f.get('accuracy_global_bn')):>7} {pct(f.get('accuracy_per_agent_bn')):>9} "
              f"{pct(f.get('edge_accuracy')):>6} {pct(f.get('server_train_accuracy')):>6} {r['mean_round_s']:>8.1f}  {r['test_share']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collect", type=Path, help="gather the runs under this folder into bench/results/gkt_balanced.json")
    p.add_argument("--variant", default="base", help="a label for the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--train-samples", type=int, default=3000)
    p.add_argument("--test-samples", type=int, default=1000)
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--eval-every", type=int, default=1, help="evaluation rounds (the last round always evaluates)")
    p.add_argument("--test-share", choices=("own", "balanced"), default="balanced")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a [fedgkt] key (JSON value or string)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.collect:
        collect(args.collect)
        return
    if args.out is None:
        p.error("--out is required")
    quiet_logs()
    config: dict[str, Any] = {"eval_diagnostics": True}
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = parse_value(value)
    data = DataSpec("fashion-mnist", args.partition, args.agents, args.train_samples, args.test_samples, args.seed)
    run = RunSpec(name=f"gkt-{args.variant}-s{args.seed}", method="fedgkt", method_config=config, rounds=args.rounds,
                  eval_every=args.eval_every)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    def keep_edges(agents: list) -> None:  # the agents' final ResNet-8s, for offline diagnosis
        import numpy as np

        arrays = {f"{a.config.agent_id}/{k}": v for a in agents if a.method is not None for k, v in a.method.state_arrays().items()}
        np.savez(args.out / "edges.npz", **arrays)

    report = run_federation(run, data, args.out, test_share=args.test_share, on_done=keep_edges)
    summary = {"variant": args.variant, "seed": args.seed, "test_share": args.test_share, "method_config": config,
               "data": data.__dict__, "wall_s": time.time() - started, "machine": machine(), **summarize(report)}
    write_json(args.out / "summary.json", summary)
    f = summary["final"]
    print(json.dumps({k: f.get(k) for k in ("accuracy_global_bn", "accuracy_per_agent_bn", "edge_accuracy", "server_train_accuracy")}
                     | {"mean_round_s": summary["mean_round_s"], "wall_s": summary["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()

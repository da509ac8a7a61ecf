"""Where honest updates point: the figures behind ``[server] plausible_min_cosine``'s default.

The direction check (cloud_server/robust.py) refuses an update whose cosine with the
coordinate-wise median of the round's updates (its own included; three or more agents) is
below ``plausible_min_cosine``. A threshold that refuses an honest agent under label skew
does more harm than the attack it stops, so the default is chosen from these runs: the
robustness bench's federation (bench/robustness.py: 5 agents, ResNet-8, 3,000 Fashion-MNIST
images, 5 rounds, 500 test images), for FedAvg and FedGKD, IID, Dirichlet(0.5) and
Dirichlet(0.1), seeds 0 and 1 (the data's split and the server's), with the check
recording but refusing nothing (``plausible_min_cosine = -1``):

* ``none``: five honest agents under the default ``mean``: every honest cosine, per round;
* ``sign_flip`` (seed 0): agent-4 sends ``global - 4 (w - global)`` (bench/robustness.py's attack);
  the run aggregates with the ``median`` (f = 1) so that the model trains as it would with the
  attacker kept out, and the flipped agent's cosine is measured on a healthy model in every
  round (under the ``mean`` the model is at chance after round 1); the four honest agents'
  cosines with an attacker in the median are recorded too;
* ``random_labels`` (FedAvg, seed 0): agent-4 trains on shuffled labels, under the ``mean``:
  whether the direction check sees it at all;
* ``rule_cost`` (FedAvg, Dirichlet(0.5) and (0.1), seeds 0 and 1, five honest agents):
  ``trimmed_mean`` (f = 1) next to the ``mean`` runs above: what a robust rule as default
  would cost on clean, label-skewed data.

    python bench/update_directions.py            # the whole grid; about an hour on 2 shared cores
    python bench/update_directions.py --resume   # go on after an interruption
    python bench/update_directions.py --only fedavg-none-dir0.1-s0   # these runs again (keeps the rest)

Writes ``bench/results/update_directions.json`` after every run: the runs (per round, every
agent's cosine and norm, accuracy), and the summary: per method, partition and seed, the
lowest honest cosine (and its round and agent), the flipped and shuffled agents' cosines; per
partition, the lowest honest cosine over methods and seeds; and the accuracy of each rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import RESULTS, quiet_logs  # noqa: E402
from bench._runs import add_grid_arguments, run_grid  # noqa: E402
from bench.robustness import AGENTS, BAD, LABEL_SEED, SIGN_FLIP_SCALE, TABLES, Case, run_case  # noqa: E402

PARTITIONS = {"iid": "iid", "dir0.5": "dirichlet:0.5", "dir0.1": "dirichlet:0.1"}
METHODS = ("fedavg", "fedgkd")
SEEDS = (0, 1)
ROUNDS, TRAIN, TEST = 5, 3000, 500  # bench/robustness.py's scale
RECORD_ONLY = {"plausible_min_cosine": -1.0}  # judged and recorded, never refused


@dataclasses.dataclass(frozen=True)
class Run:
    method: str
    attack: str  # none | sign_flip | random_labels
    partition: str  # a key of PARTITIONS
    seed: int
    aggregation: str = "mean"

    @property
    def name(self) -> str:
        rule = "" if self.aggregation == "mean" else f"-{self.aggregation}"
        return f"{self.method}-{self.attack}{rule}-{self.partition}-s{self.seed}"

    @property
    def purpose(self) -> str:
        if self.attack == "none":
            return "honest" if self.aggregation == "mean" else "rule_cost"
        return self.attack


def grid() -> list[Run]:
    """Clean runs first (the honest figures the default rests on), the strongest skew first;
    then the rule's cost (the decision when honest agents point away), then the attacks, seed 0 first."""
    skew_first = sorted(PARTITIONS, key=lambda p: ("dir0.1", "dir0.5", "iid").index(p))
    out = [Run(m, "none", p, s) for s in SEEDS for p in skew_first for m in METHODS]
    out += [Run("fedavg", "none", p, s, "trimmed_mean") for s in SEEDS for p in ("dir0.1", "dir0.5")]
    out += [Run(m, "sign_flip", p, 0, "median") for p in skew_first for m in METHODS]
    out += [Run("fedavg", "random_labels", p, 0) for p in skew_first]
    return out


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures: the lowest honest cosine (round, agent), the bad agent's per round."""
    honest: list[tuple[float, int, str]] = []
    bad: list[float | None] = []
    for r in run["rounds"]:
        cosines = r.get("update_cosines") or {}
        honest += [(c, r["round"], a) for a, c in cosines.items() if a != BAD or run["attack"] == "none"
                   if isinstance(c, (int, float))]
        if run["attack"] != "none":
            bad.append(cosines.get(BAD))
    low = min(honest) if honest else None
    return {
        "honest_cosines": len(honest),
        "honest_min": None if low is None else low[0],
        "honest_min_at": None if low is None else {"round": low[1], "agent": low[2]},
        "honest_min_per_round": [min(_finite([c for a, c in (r.get("update_cosines") or {}).items()
                                              if a != BAD or run["attack"] == "none"]), default=None)
                                 for r in run["rounds"]],
        "bad_agent_cosines": bad if run["attack"] != "none" else None,
        "bad_agent_max": max(_finite(bad), default=None) if run["attack"] != "none" else None,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per partition: the lowest honest cosine over methods, seeds and runs (clean runs, under
    either rule, and honest agents beside an attacker apart), the highest flipped / shuffled
    agent's cosine; and each rule's final accuracy on clean data."""
    out: dict[str, Any] = {}
    for part in PARTITIONS:
        mine = [r for r in runs if r["partition"] == part]
        clean = [r for r in mine if r["attack"] == "none"]
        beside = [r for r in mine if r["attack"] != "none"]
        entry: dict[str, Any] = {
            "honest_min_clean": min(_finite([r["figures"]["honest_min"] for r in clean]), default=None),
            "honest_min_beside_an_attacker": min(_finite([r["figures"]["honest_min"] for r in beside]), default=None),
            "per_run": {r["name"]: r["figures"]["honest_min"] for r in clean + beside},
        }
        for attack in ("sign_flip", "random_labels"):
            bad = [r for r in mine if r["attack"] == attack]
            if bad:
                entry[f"{attack}_cosine_max"] = max(_finite([r["figures"]["bad_agent_max"] for r in bad]), default=None)
                entry[f"{attack}_cosines"] = {r["name"]: r["figures"]["bad_agent_cosines"] for r in bad}
        out[part] = entry
    honest_all = _finite([e["honest_min_clean"] for e in out.values()] + [e["honest_min_beside_an_attacker"] for e in out.values()])
    rule_cost: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["attack"] == "none" and r["method"] == "fedavg":
            key = f"{r['partition']}-s{r['seed']}"
            rule_cost.setdefault(key, {})[r["aggregation"]] = r["final_accuracy"]
    for figures in rule_cost.values():
        if isinstance(figures.get("mean"), float) and isinstance(figures.get("trimmed_mean"), float):
            figures["trimmed_mean_minus_mean"] = round(figures["trimmed_mean"] - figures["mean"], 4)
    return {"by_partition": out, "honest_min_overall": min(honest_all, default=None),
            "fedavg_clean_accuracy_by_rule": dict(sorted(rule_cost.items()))}


def _run_one(run: Run, work: Path) -> dict[str, Any]:
    case = Case(run.method, run.attack, True, run.aggregation)
    result = run_case(case, ROUNDS, TRAIN, TEST, work, partition=PARTITIONS[run.partition], seed=run.seed,
                      server=dict(RECORD_ONLY), name=run.name)
    result.update({"name": run.name, "partition": run.partition, "seed": run.seed, "purpose": run.purpose})
    result["figures"] = summarise_run(result)
    f = result["figures"]
    print(f"  final accuracy {result['final_accuracy']}, honest min cosine {f['honest_min']} at {f['honest_min_at']}, "
          f"bad agent {f['bad_agent_cosines']}, refusals {result['refusals']}, {result['wall_s']} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_arguments(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "update_directions.json")
    args = parser.parse_args(argv)
    quiet_logs()
    scale = {"agents": AGENTS, "bad_agent": BAD, "rounds": ROUNDS, "train_samples": TRAIN, "test_samples": TEST,
             "dataset": "fashion-mnist"}

    def head(started: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, Any]:
        return {"benchmark": "update_directions", "generated_by": "bench/update_directions.py", "machine": started, **scale,
                "partitions": PARTITIONS, "seeds": list(SEEDS), "method_config": {m: TABLES[m] for m in METHODS},
                "sign_flip_scale": SIGN_FLIP_SCALE, "label_seed": LABEL_SEED, "server": RECORD_ONLY,
                "reference": "each update's cosine with the coordinate-wise median of the round's updates, its own "
                             "included (cloud_server/robust.py direction_cosines)"}

    run_grid(grid(), _run_one, args.out, scale, head, resume=args.resume, only=args.only, summary=summary,
             work_prefix="update-directions-")

if __name__ == "__main__":
    main()

"""The label check's blind spot, replayed offline: would another rule than
:func:`cloud_server.robust_validation.implausible_labels` tell the shuffled-labels agent from the
honest ones at Dirichlet(0.1)? No new runs: the rules are replayed on the server model's agreement
per round and agent that bench/defence_scores.py recorded (``replay.agreement`` of its ``labels-*``
runs), every seed it holds.

Why the rule misses it there: the bad agent shuffles its *own* labels, so under strong label skew
most of them stay right. A shard that is 60% one class keeps that class on ~60% of the shuffled
labels' samples of it: the share of an agent's labels a permutation leaves right is about
sum_c p_c^2 (p: its label histogram), 0.10 at IID and 0.3-0.5 at Dirichlet(0.1). So the bad
agent's agreement is not near chance (0.1) there, and the honest agents whose classes the server
model has not learnt yet are as low; the MAD term, with the honest agreements spread as widely as
bench/results/defence_scores.json records them, sets a limit below zero.

Rules replayed (an agent is judged against the other agents of the round, as the check does):

* ``current-<floor>``: the check as it is (floor and the MAD term, ``plausible_mad`` 6);
* ``floor-<f>``: the floor alone, no MAD term;
* ``mad<k>-0.3``: the check at floor 0.3 with ``plausible_mad`` k instead of 6;
* ``ratio-<r>``: below r x the other agents' median;
* ``kappa-<k>``: the chance-corrected agreement (Cohen's kappa with the agent's label histogram
  standing in for the server's prediction histogram, which was not recorded),
  (agreement - sum_c p_c^2) / (1 - sum_c p_c^2), below k. The histograms are the partition's,
  recomputed from the data (``--chance``), as the server could from the labels it is sent.

    python bench/label_rules.py --chance   # writes bench/results/label_rules.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import RESULTS, write_json  # noqa: E402
from cloud_server.robust_validation import implausible_labels  # noqa: E402

Rule = Callable[[Mapping[str, float], Mapping[str, float]], set[str]]  # (agreement, chance) -> refused


def _others(agreement: Mapping[str, float], agent: str) -> list[float]:
    return [v for a, v in agreement.items() if a != agent]


def _current(floor: float, mad: float) -> Rule:
    return lambda ag, _chance: set(implausible_labels(ag, floor, mad))


def _floor(floor: float) -> Rule:
    return lambda ag, _chance: {a for a, v in ag.items() if v < floor}


def _ratio(r: float) -> Rule:
    return lambda ag, _chance: {a for a, v in ag.items() if len(ag) > 2 and v < r * statistics.median(_others(ag, a))}


def kappa(agreement: float, chance: float) -> float:
    """Agreement above what a permutation of the agent's own labels would keep (1: all, 0: chance)."""
    return (agreement - chance) / (1.0 - chance)


def _kappa(k: float) -> Rule:
    return lambda ag, chance: {a for a, v in ag.items() if kappa(v, chance[a]) < k}


RULES: dict[str, Rule] = {
    **{f"current-{f}": _current(f, 6.0) for f in (0.3, 0.5)},
    **{f"floor-{f}": _floor(f) for f in (0.2, 0.25, 0.3, 0.35, 0.4)},
    **{f"mad{k}-0.3": _current(0.3, float(k)) for k in (1, 2, 3, 4)},
    **{f"mad{k}-0.5": _current(0.5, float(k)) for k in (1, 2, 3)},
    **{f"ratio-{r}": _ratio(r) for r in (0.4, 0.5, 0.6, 0.7)},
    **{f"kappa-{k}": _kappa(k) for k in (0.0, 0.1, 0.2)},
}
NEEDS_CHANCE = tuple(n for n in RULES if n.startswith("kappa-"))


def replay_rules(runs: list[dict[str, Any]], bad: str, chance: Mapping[str, Mapping[str, float]] | None = None,
                 rules: Mapping[str, Rule] = RULES) -> dict[str, Any]:
    """Rule -> partition -> seed -> honest uploads refused of judged (the clean and attacked runs)
    and the rounds the bad agent was refused in (judged rounds: those with its agreement).
    ``chance``: run name -> agent -> sum_c p_c^2; without it the kappa rules are left out."""
    out: dict[str, Any] = {}
    for name, rule in rules.items():
        if name in NEEDS_CHANCE and chance is None:
            continue
        for run in runs:
            if run["check"] != "labels":
                continue
            cell = out.setdefault(name, {}).setdefault(run["partition"], {}).setdefault(
                str(run["seed"]), {"honest_refused": 0, "honest_judged": 0, "bad_refused_rounds": [], "bad_judged": 0})
            attacked = run["attack"] != "none"
            for k, ag in enumerate(run["replay"]["agreement"]):
                if not ag:
                    continue
                refused = rule(ag, (chance or {}).get(run["name"], {}))
                honest = [a for a in ag if not (attacked and a == bad)]
                cell["honest_judged"] += len(honest)
                cell["honest_refused"] += sum(1 for a in honest if a in refused)
                if attacked and bad in ag:
                    cell["bad_judged"] += 1
                    if bad in refused:
                        cell["bad_refused_rounds"].append(k + 1)
    return out


def label_chance(runs: list[dict[str, Any]], partitions: Mapping[str, str], train: int, test: int,
                 agents: int) -> dict[str, dict[str, float]]:
    """Run name -> agent -> sum_c p_c^2 of its training labels (the seeded partition the run used)."""
    import numpy as np

    from edge_agent.agent import load_agent_data
    from edge_agent.config import DataConfig, EdgeConfig

    cache: dict[tuple[str, int], dict[str, float]] = {}
    out = {}
    for run in runs:
        key = (run["partition"], int(run["seed"]))
        if key not in cache:
            cache[key] = {}
            for i in range(agents):
                data = DataConfig(dataset="fashion-mnist", partition=partitions[key[0]], num_agents=agents, agent_index=i,
                                  seed=key[1], train_samples=train, test_samples=test)
                shard, _ = load_agent_data(EdgeConfig(agent_id=f"agent-{i}", run_id="label-rules", data=data,
                                                      broker_url="mqtt://127.0.0.1:1"))
                p = np.bincount(shard.labels, minlength=10) / len(shard.labels)
                cache[key][f"agent-{i}"] = round(float((p ** 2).sum()), 6)
        out[run["name"]] = cache[key]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scores", type=Path, default=RESULTS / "defence_scores.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "label_rules.json")
    parser.add_argument("--chance", action="store_true", help="recompute the agents' label histograms (kappa rules)")
    args = parser.parse_args(argv)
    scores = json.loads(args.scores.read_text())
    runs = [r for r in scores["runs"] if r["check"] == "labels"]
    chance = (label_chance(runs, scores["partitions"], scores["train_samples"], scores["test_samples"], scores["agents"])
              if args.chance else None)
    result = replay_rules(runs, scores["bad_agent"], chance)
    write_json(args.out, {"benchmark": "label_rules", "generated_by": "bench/label_rules.py",
                          "from": "bench/results/defence_scores.json", "runs": [r["name"] for r in runs],
                          "seeds": sorted({r["seed"] for r in runs}), "chance": chance, "rules": result})
    for name, parts in result.items():
        cells = [f"{p} s{s}: {c['honest_refused']}/{c['honest_judged']} honest, bad {c['bad_refused_rounds']} of {c['bad_judged']}"
                 for p, seeds in parts.items() for s, c in seeds.items()]
        print(f"{name:12s} " + " | ".join(cells))


if __name__ == "__main__":
    main()

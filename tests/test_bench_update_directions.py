"""bench/update_directions.py: the grid behind plausible_min_cosine's default and what it
summarises of the runs' recorded cosines (by hand); the JSON it wrote, against the default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_bench_baselines import load

RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "update_directions.json"


def test_the_grid_measures_both_methods_every_partition_and_two_seeds() -> None:
    ud = load("update_directions")
    runs = ud.grid()
    names = [r.name for r in runs]
    assert len(names) == len(set(names))
    for method in ("fedavg", "fedgkd"):
        for part in ("iid", "dir0.5", "dir0.1"):
            for seed in (0, 1):
                assert f"{method}-none-{part}-s{seed}" in names
                assert f"{method}-sign_flip-median-{part}-s0" in names
    assert runs[0].attack == "none"  # the honest figures first: an interrupted bench has them
    assert ud.RECORD_ONLY == {"plausible_min_cosine": -1.0}  # recorded, nothing refused


def _round(n: int, cosines: dict[str, float | None]) -> dict[str, Any]:
    return {"round": n, "update_cosines": cosines}


def test_summarise_run_finds_the_lowest_honest_cosine_and_the_bad_agents() -> None:
    ud = load("update_directions")
    clean = {"attack": "none", "rounds": [_round(1, {"agent-0": 0.9, "agent-4": 0.2}), _round(2, {"agent-0": 0.5, "agent-4": None})]}
    f = ud.summarise_run(clean)
    assert f["honest_min"] == 0.2 and f["honest_min_at"] == {"round": 1, "agent": "agent-4"}  # agent-4 is honest here
    assert f["honest_min_per_round"] == [0.2, 0.5] and f["honest_cosines"] == 3 and f["bad_agent_cosines"] is None
    flipped = {"attack": "sign_flip", "rounds": [_round(1, {"agent-0": 0.7, "agent-1": 0.6, "agent-4": -0.8}),
                                                 _round(2, {"agent-0": 0.4, "agent-1": 0.65, "agent-4": -0.5})]}
    f = ud.summarise_run(flipped)
    assert f["honest_min"] == 0.4 and f["honest_min_at"] == {"round": 2, "agent": "agent-0"}
    assert f["bad_agent_cosines"] == [-0.8, -0.5] and f["bad_agent_max"] == -0.5


def test_summary_by_partition_and_the_rules_cost() -> None:
    ud = load("update_directions")

    def run(name: str, attack: str, part: str, rule: str, honest_min: float, bad: float | None, acc: float) -> dict[str, Any]:
        purpose = ("honest" if rule == "mean" else "rule_cost") if attack == "none" else attack
        return {"name": name, "method": "fedavg", "attack": attack, "partition": part, "seed": 0, "aggregation": rule,
                "purpose": purpose, "final_accuracy": acc,
                "figures": {"honest_min": honest_min, "bad_agent_max": bad, "bad_agent_cosines": None if bad is None else [bad]}}

    s = ud.summary([run("a", "none", "dir0.1", "mean", 0.3, None, 0.40), run("b", "none", "dir0.1", "trimmed_mean", 0.25, None, 0.37),
                    run("c", "sign_flip", "dir0.1", "median", 0.1, -0.6, 0.39), run("d", "none", "iid", "mean", 0.6, None, 0.45)])
    part = s["by_partition"]["dir0.1"]
    # Five honest agents under either rule are clean runs; beside an attacker, apart.
    assert part["honest_min_clean"] == 0.25 and part["honest_min_beside_an_attacker"] == 0.1
    assert part["sign_flip_cosine_max"] == -0.6 and set(part["per_run"]) == {"a", "b", "c"}
    assert s["honest_min_overall"] == 0.1
    assert s["fedavg_clean_accuracy_by_rule"]["dir0.1-s0"] == {"mean": 0.40, "trimmed_mean": 0.37, "trimmed_mean_minus_mean": -0.03}


def test_the_recorded_figures_back_the_default() -> None:
    """The default of plausible_min_cosine sits below every honest cosine the bench recorded
    (or the check is off by default, -1); and, when on, above every flipped agent's."""
    from cloud_server.robust import PLAUSIBLE_MIN_COSINE

    data = json.loads(RESULT.read_text())
    assert data["complete"], data["missing"]
    s = data["summary"]
    if PLAUSIBLE_MIN_COSINE > -1:
        assert PLAUSIBLE_MIN_COSINE < s["honest_min_overall"]
        assert all(p["sign_flip_cosine_max"] < PLAUSIBLE_MIN_COSINE for p in s["by_partition"].values())
    for run in data["runs"]:
        assert run["refusals"] == {} or run["attack"] != "none", run["name"]  # nothing was refused in a clean run

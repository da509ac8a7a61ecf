"""bench/label_rules.py: the label check's candidate rules replayed on recorded agreements, on
hand-made figures (what each rule refuses, what is counted as honest and as judged)."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_baselines import load


def _run(name: str, attack: str, seed: int, rounds: list[dict[str, float]]) -> dict[str, object]:
    return {"name": name, "check": "labels", "attack": attack, "partition": "dir0.1", "seed": seed,
            "replay": {"agreement": [{}] + rounds}}  # round 1 is not judged: the server model has not trained


def test_rules_count_honest_refusals_and_the_bad_agents_rounds_per_seed() -> None:
    lr = load("label_rules")
    bad = "agent-4"
    # Round 2: the bad agent at 0.17 beside an honest one at 0.35 (the spread that hides it from the MAD term);
    # round 3: it is at 0.38, above round 2's honest 0.35 but below this round's honest agents.
    attacked = _run("labels-random_labels-dir0.1-s0", "random_labels", 0, [
        {"agent-0": 0.78, "agent-1": 0.58, "agent-2": 0.35, "agent-3": 0.81, bad: 0.17},
        {"agent-0": 0.90, "agent-1": 0.82, "agent-2": 0.54, "agent-3": 0.69, bad: 0.38}])
    clean = _run("labels-none-dir0.1-s1", "none", 1, [
        {"agent-0": 0.73, "agent-1": 0.71, "agent-2": 0.28, "agent-3": 0.79, bad: 0.74}])
    out = lr.replay_rules([attacked, clean], bad)
    assert not any(name.startswith("kappa-") for name in out)  # no label histograms given: left out
    current = out["current-0.3"]["dir0.1"]
    assert current["0"] == {"honest_refused": 0, "honest_judged": 8, "bad_refused_rounds": [], "bad_judged": 2}
    # The floor alone catches round 2 only; in the clean run of the other seed agent-4 is honest and judged.
    assert out["floor-0.3"]["dir0.1"]["0"]["bad_refused_rounds"] == [2]
    assert out["floor-0.3"]["dir0.1"]["1"] == {"honest_refused": 1, "honest_judged": 5, "bad_refused_rounds": [],
                                               "bad_judged": 0}
    # Half the others' median: round 3's median of the others is 0.755, so 0.38 is just above 0.3775.
    assert out["ratio-0.5"]["dir0.1"]["0"]["bad_refused_rounds"] == [2]
    assert out["ratio-0.6"]["dir0.1"]["0"]["bad_refused_rounds"] == [2, 3]


def test_kappa_measures_agreement_above_what_a_permutation_keeps() -> None:
    lr = load("label_rules")
    assert lr.kappa(0.46, 0.46) == 0.0 and lr.kappa(1.0, 0.4) == 1.0
    assert abs(lr.kappa(0.1, 0.1)) < 1e-12  # IID: shuffled labels are right 1 in 10
    bad = "agent-4"
    run = _run("labels-random_labels-dir0.1-s0", "random_labels", 0, [
        {"agent-0": 0.78, "agent-1": 0.58, "agent-2": 0.35, "agent-3": 0.81, bad: 0.38}])
    chance = {run["name"]: {"agent-0": 0.43, "agent-1": 0.34, "agent-2": 0.3, "agent-3": 0.33, bad: 0.46}}
    cell = lr.replay_rules([run], bad, chance, {"kappa-0.0": lr.RULES["kappa-0.0"]})["kappa-0.0"]["dir0.1"]["0"]
    # 0.38 is below the 0.46 a permutation of its own labels keeps; honest agent-2's 0.35 is above its 0.3.
    assert cell == {"honest_refused": 0, "honest_judged": 4, "bad_refused_rounds": [2], "bad_judged": 1}


RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "label_rules.json"
SCORES = RESULT.with_name("defence_scores.json")


def test_the_recorded_replay_is_the_defence_grids() -> None:
    import pytest

    if not RESULT.exists():
        pytest.skip("bench/results/label_rules.json has not been written yet (python bench/label_rules.py --chance)")
    lr = load("label_rules")
    data = json.loads(RESULT.read_text())
    scores = json.loads(SCORES.read_text())
    runs = [r for r in scores["runs"] if r["name"] in data["runs"]]
    assert len(runs) == len(data["runs"])  # every run it replayed is still recorded
    # Replayed again from the grid's recorded agreements (and the stored label histograms): the same counts.
    assert lr.replay_rules(runs, scores["bad_agent"], data["chance"]) == data["rules"]

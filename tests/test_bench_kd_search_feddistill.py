"""bench/kd_search_feddistill.py: each arm changes one of FedDistill's loss weights to a
value of its paper's printed range, the default arm is the grid's FedDistill, the scores, pairings
and verdicts on hand-made runs (no federation is run), and bench/results/kd_search_feddistill.json
holds every arm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cloud_server.methods.feddistill import FedDistillConfig
from test_bench_baselines import load

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "kd_search_feddistill.json"


def test_each_arm_changes_one_weight_to_a_value_of_the_paper_s_range() -> None:
    search, kd = load("kd_search_feddistill"), load("kd_methods")
    assert search.DEFAULTS == {w: getattr(FedDistillConfig(), w) for w in search.WEIGHTS}
    grid_config = kd.method_config("feddistill", kd.SCALES["full"])
    assert len(search.SEARCH_ARMS) == 12
    changed = []
    for arm in search.SEARCH_ARMS:
        ((weight, value),) = arm.changes.items()
        assert value in search.PAPER_RANGES[weight] and value != search.DEFAULTS[weight], arm.name
        config = search.run_spec(arm).method_config
        assert config == {**grid_config, **search.DEFAULTS, weight: value}
        assert [k for k in search.WEIGHTS if config[k] != search.DEFAULTS[k]] == [weight]
        changed.append(weight)
    # The paper's order: the alphas, then the betas; two values each.
    assert changed == [w for w in ("alpha_t", "alpha_r", "alpha_f", "beta_l", "beta_e", "beta_fc") for _ in range(2)]
    # Sec. IV-A's ranges as printed.
    assert search.PAPER_RANGES["alpha_t"] == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert search.PAPER_RANGES["beta_l"] == (0.5, 0.8, 1.0, 1.1, 1.2, 1.4)
    assert search.PAPER_RANGES["beta_fc"] == (0.1, 0.2, 0.3, 0.4, 0.5)
    # The defaults are in the ranges too (the default arm is a point of the search).
    assert all(search.DEFAULTS[w] in search.PAPER_RANGES[w] for w in search.WEIGHTS)


def test_the_default_arm_is_the_grid_s_feddistill_cut_at_round_10() -> None:
    search, kd = load("kd_search_feddistill"), load("kd_methods")
    grid_scale = kd.SCALES["full"]
    # The grid's regime but for the rounds.
    assert {k: v for k, v in search.SCALE.key().items() if k not in ("name", "rounds")} == {
        k: v for k, v in grid_scale.key().items() if k not in ("name", "rounds")}
    assert search.SCALE.rounds == 10 and search.SCALE.seeds == grid_scale.seeds
    assert search.run_spec(search.DEFAULT).method_config == {**kd.method_config("feddistill", grid_scale), **search.DEFAULTS}
    assert search.run_spec(search.RERUN).method_config == search.run_spec(search.DEFAULT).method_config
    assert search.run_spec(search.FEDAVG).method_config == kd.method_config("fedavg", grid_scale)
    grid = json.loads((ROOT / "bench" / "results" / "kd_methods.json").read_text())
    read = search.grid_runs(grid, [0, 1, 2])
    for seed in (0, 1, 2):
        recorded = grid["runs"][f"feddistill-dir0.1-seed{seed}"]
        # The grid ran the defaults (its resolved [feddistill] table).
        assert {w: recorded["method_config"][w] for w in search.WEIGHTS} == search.DEFAULTS
        cut = read[f"default-dir0.1-seed{seed}"]
        assert cut["arm"] == "default" and len(cut["rounds"]) == 10
        assert cut["final_accuracy"] == recorded["rounds"][9]["accuracy"]
        assert search.scores(cut)["late_mean"] == pytest.approx(sum(recorded["rounds"][r - 1]["accuracy"] for r in (6, 8, 10)) / 3)
        assert read[f"fedavg-dir0.1-seed{seed}"]["final_accuracy"] == grid["runs"][f"fedavg-dir0.1-seed{seed}"]["rounds"][9]["accuracy"]


def fake(arm: str, seed: int, curve: dict[int, float]) -> dict[str, Any]:
    return {"arm": arm, "seed": seed, "name": f"{arm}-dir0.1",
            "rounds": [{"round": r, "accuracy": curve.get(r)} for r in range(1, 11)]}


def test_scores_pairs_and_verdicts_on_hand_made_runs() -> None:
    search = load("kd_search_feddistill")
    base = {0: 0.40, 1: 0.50, 2: 0.60}
    runs: dict[str, Any] = {}

    def add(arm: str, shift_final: dict[int, float], shift_late: dict[int, float]) -> None:
        for seed, b in base.items():
            # rounds 6 and 8 move by the late shift; round 10 by the final shift
            curve = {2: 0.1, 4: 0.2, 6: b + shift_late[seed], 8: b + shift_late[seed], 10: b + shift_final[seed]}
            runs[f"{arm}-{seed}"] = fake(arm, seed, curve)

    zero = {0: 0.0, 1: 0.0, 2: 0.0}
    add("default", zero, zero)
    add("fedavg", {0: -0.1, 1: -0.1, 2: -0.1}, {0: -0.1, 1: -0.1, 2: -0.1})
    add("alpha_t-0.5", {0: 0.03, 1: 0.04, 2: 0.05}, {0: 0.03, 1: 0.03, 2: 0.03})  # above on both
    add("alpha_t-1.0", {0: -0.03, 1: -0.04, 2: -0.05}, {0: -0.06, 1: -0.06, 2: -0.06})  # below on both
    add("beta_l-0.5", {0: 0.05, 1: -0.05, 2: 0.01}, {0: 0.0, 1: 0.0, 2: 0.0})  # noise on both
    add("beta_e-0.1", {0: 0.03, 1: 0.04, 2: 0.05}, {0: 0.05, 1: -0.05, 2: 0.0})  # mixed
    runs["beta_fc-0.1-0"] = fake("beta_fc-0.1", 0, {6: 0.5, 8: 0.5, 10: 0.5})  # one seed
    runs["alpha_r-0.0-0"] = fake("alpha_r-0.0", 0, {6: 0.5, 10: 0.5})  # round 8 not evaluated

    assert search.scores(runs["default-0"]) == {"final": 0.40, "late_mean": pytest.approx(0.40)}
    assert search.scores(runs["alpha_r-0.0-0"]) == {"final": 0.5, "late_mean": None}
    table = search.summary(runs)
    up = table["alpha_t-0.5"]
    assert up["vs_default"]["final"]["differences"] == pytest.approx([0.03, 0.04, 0.05])
    assert up["vs_default"]["final"]["mean_difference"] == pytest.approx(0.04)
    assert up["vs_default"]["final"]["sd_difference"] == pytest.approx(0.01)
    # rounds 6, 8 up by 0.03 and round 10 by 0.03 / 0.04 / 0.05: the late mean up by 0.03 + (0, 0.01, 0.02) / 3
    assert up["vs_default"]["late_mean"]["differences"] == pytest.approx([0.03, 0.03 + 0.01 / 3, 0.03 + 0.02 / 3])
    assert up["vs_fedavg"]["final"]["mean_difference"] == pytest.approx(0.14)
    assert up["verdict"] == "better than the default"
    assert table["alpha_t-1.0"]["verdict"] == "worse than the default"
    assert table["beta_l-0.5"]["verdict"] == "within noise"
    assert table["beta_e-0.1"]["verdict"] == "mixed (final above, rounds 6-10 within noise)"
    assert table["beta_fc-0.1"]["verdict"] == "too few seeds"
    assert "verdict" not in table["default"] and "vs_default" not in table["default"]
    assert table["fedavg"]["vs_default"]["final"]["mean_difference"] == pytest.approx(-0.1)
    assert search.better_than_default(table) == ["alpha_t-0.5"]
    rows = search.table_rows(table)
    assert rows[0].startswith("| default (the grid's) | 50.0 ± 10.0% |")
    assert "| alpha_t 0.0 → 0.5 | 54.0 ± 11.0% |" in rows[2] and "| +4.0 (1.0) |" in rows[2]
    assert "| alpha_t 0.0 → 1.0 |" in rows[3] and "| −4.0 (1.0) |" in rows[3]


def test_resume_keeps_only_runs_of_this_regime_and_arm_config(tmp_path: Path) -> None:
    search = load("kd_search_feddistill")
    spec = search.run_spec(search.SEARCH_ARMS[0])
    good = {"name": spec.name, "seed": 0, "arm": search.SEARCH_ARMS[0].name, "method_config": dict(spec.method_config)}
    stale = {**good, "seed": 1, "method_config": {**spec.method_config, "alpha_t": 0.3}}
    other = {**good, "seed": 2}
    out = tmp_path / "out.json"
    out.write_text(json.dumps({"scale": {"key": search.SCALE.key()}, "runs": {"a": good, "b": stale}}))
    root = tmp_path / "runs"
    (root / "x").mkdir(parents=True)
    (root / "x" / "summary.json").write_text(json.dumps({"scale": {**search.SCALE.key(), "rounds": 20}, "run": other}))
    found = search.previous_runs(out, root)
    assert list(found) == [f"{spec.name}-seed0"]


def test_the_recorded_search_is_of_the_defaults_and_complete() -> None:
    if not RESULT.exists():
        pytest.skip("the search has not been recorded")
    search = load("kd_search_feddistill")
    data = json.loads(RESULT.read_text())
    assert data["defaults"] == search.DEFAULTS
    # Every arm recorded makes a row (rows made from the JSON): the default, FedAvg and each searched arm.
    rows = search.table_rows(data["summary"])
    assert len(rows) >= 2 + len(search.SEARCH_ARMS) * data["scale"]["complete"]

"""bench/kd_methods.py: the verdict on a paper's claim from hand-made numbers, the
claim table computed from the cells, the quick mode end to end on synthetic data (every method,
two seeds, a real broker), and what bench/render_results.py makes of the JSON; FedKD's ablation
(--ablation fedkd): one factor per arm, the paired effects, its section beside the grid's."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from cloud_server.methods.fedkd_config import FedKdConfig
from test_bench_baselines import RESULTS, load


def s(mean: float, sd: float, n: int = 3) -> dict[str, Any]:
    return {"mean": mean, "sd": sd, "n": n, "values": []}


def test_verdict_holds_within_noise_fails_by_the_difference_rule() -> None:
    kd = load("kd_methods")
    fedavg = s(0.60, 0.02)
    # Above by 0.05 > 0.02 + 0.02: holds.
    assert kd.verdict(s(0.65, 0.02), fedavg, "above")["verdict"] == "holds"
    # Above by 0.03 < 0.02 + 0.02: within noise; below by 0.03 likewise.
    assert kd.verdict(s(0.63, 0.02), fedavg, "above")["verdict"] == "within noise"
    assert kd.verdict(s(0.57, 0.02), fedavg, "above")["verdict"] == "within noise"
    # Exactly the two sds apart is no difference (bench/_stats.py's own example).
    assert kd.verdict(s(0.60, 0.03), s(0.55, 0.02), "above")["verdict"] == "within noise"
    # Below by 0.10 > 0.04: fails, with the figures behind it.
    low = kd.verdict(s(0.50, 0.02), fedavg, "above")
    assert low["verdict"] == "fails" and low["mean_difference"] == pytest.approx(-0.10) and low["combined_sd"] == pytest.approx(0.04)
    # A wide spread turns the same means into noise.
    assert kd.verdict(s(0.65, 0.04), s(0.60, 0.03), "above")["verdict"] == "within noise"
    # "Not below" (FedKD: comparable accuracy): within noise holds, clearly below fails.
    assert kd.verdict(s(0.58, 0.02), fedavg, "not_below")["verdict"] == "holds"
    assert kd.verdict(s(0.50, 0.02), fedavg, "not_below")["verdict"] == "fails"
    # ... and at fewer bytes only: the same accuracy with more bytes fails.
    fewer = kd.verdict(s(0.60, 0.02), fedavg, "not_below", s(1.0, 0.0), s(20.0, 0.0))
    assert fewer["verdict"] == "holds" and fewer["bytes_fraction"] == pytest.approx(0.05)
    assert kd.verdict(s(0.60, 0.02), fedavg, "not_below", s(30.0, 0.0), s(20.0, 0.0))["verdict"] == "fails"
    # Both at chance (10 classes): no verdict, even when three seeds at exactly 10 % have sd 0.
    assert kd.verdict(s(0.104, 0.0), s(0.10, 0.0), "above", chance=0.1)["verdict"] == "at chance"
    assert kd.verdict(s(0.104, 0.0), s(0.10, 0.0), "above")["verdict"] == "holds"  # what the rule alone would say
    assert kd.verdict(s(0.30, 0.01), s(0.10, 0.0), "above", chance=0.1)["verdict"] == "holds"
    # Paired: a gain of 3 points in every seed is a difference however far apart the seeds' splits
    # put both cells; the unpaired figures stay beside it.
    stats = load("_stats")
    base_by_seed, mine_by_seed = {"0": 0.40, "1": 0.37, "2": 0.60}, {"0": 0.43, "1": 0.40, "2": 0.63}
    base, mine = stats.mean_sd(base_by_seed.values()), stats.mean_sd(mine_by_seed.values())
    assert kd.verdict(mine, base, "above")["verdict"] == "within noise"
    judged = kd.verdict(mine, base, "above", pairs=stats.paired(mine_by_seed, base_by_seed))
    assert judged["verdict"] == "holds" and judged["rule"] == "paired" and judged["mean_difference"] == pytest.approx(0.03)
    assert judged["unpaired"]["differ"] is False and judged["unpaired"]["combined_sd"] > 0.2
    # The same spread, the gain in one seed only: within noise; a loss in every seed: fails.
    mixed = {"0": 0.50, "1": 0.35, "2": 0.58}
    assert kd.verdict(stats.mean_sd(mixed.values()), base, "above", pairs=stats.paired(mixed, base_by_seed))["verdict"] == "within noise"
    worse = {k: v - 0.02 for k, v in base_by_seed.items()}
    worse["1"] -= 0.01
    assert kd.verdict(stats.mean_sd(worse.values()), base, "above", pairs=stats.paired(worse, base_by_seed))["verdict"] == "fails"
    # Fewer than two paired seeds: the unpaired rule decides.
    one = stats.paired({"0": 0.43}, base_by_seed)
    assert kd.verdict(mine, base, "above", pairs=one)["rule"] == "unpaired"
    # One seed: no sd, no verdict either way.
    assert kd.verdict({"mean": 0.9, "sd": None, "n": 1}, fedavg, "above")["verdict"] == "too few seeds"
    with pytest.raises(ValueError):
        kd.verdict(fedavg, fedavg, "better")


def summary(kd: Any, name: str, partition: str, seed: int, accuracies: list[float], wire_mb: float = 10.0,
            mentee: float | None = None) -> dict[str, Any]:
    """A run as bench/kd_methods.py summarises it (what cells() reads)."""
    rounds = []
    for i, acc in enumerate(accuracies, 1):
        glob = {"model": acc} | ({"mentee": mentee} if mentee is not None else {})
        rounds.append({"round": i, "status": "ok", "accuracy": acc, "local_accuracy": acc + 0.1,
                       "by_label": {"global": glob, "local": {k: v + 0.1 for k, v in glob.items()}},
                       "wire": wire_mb * 1e6 / len(accuracies), "cumulative_wire": wire_mb * 1e6 * i / len(accuracies),
                       "edge_train_flops": 10**12, "round_s": 1.0, "participants": 4, "server_flops": None})
    return {"partition": partition, "name": f"{name}-{partition}", "method_name": name, "method": kd.METHODS[name][0],
            "seed": seed, "status": "finished", "final_accuracy": accuracies[-1], "final_local_accuracy": accuracies[-1] + 0.1,
            "best_accuracy": max(accuracies), "final_by_label": {**rounds[-1]["by_label"], "labels": {}},
            "edge_train_flops_total": 10**12 * len(accuracies), "wire_total_bytes": wire_mb * 1e6, "server_flops_total": None,
            "run_wall_time_s": 60.0, "finished_at": 1000.0 * (seed + 1), "rounds": rounds}


def test_the_claim_table_is_computed_from_the_cells() -> None:
    kd = load("kd_methods")
    runs = {}
    finals = {  # name -> final accuracy per seed at Dirichlet(0.1)
        "fedavg": [0.50, 0.52, 0.54], "fedgkd": [0.60, 0.62, 0.64], "fedgkd-vote": [0.53, 0.51, 0.55],
        "feddistill": [0.40, 0.42, 0.44], "fedbe": [0.58, 0.60, 0.62], "fedavg-mentor": [0.55, 0.57, 0.59],
        "fedkd": [0.57, 0.55, 0.56],
    }
    for name, values in finals.items():
        for seed, final in enumerate(values):
            wire = 1.0 if name == "fedkd" else 20.0
            runs[f"{name}-dir0.1-seed{seed}"] = summary(kd, name, "dir0.1", seed, [0.2, final], wire, 0.3 if name == "fedkd" else None)
    cells = kd.cells(runs)
    assert cells["fedgkd-dir0.1"]["final_accuracy"]["mean"] == pytest.approx(0.62)
    assert cells["fedgkd-dir0.1"]["final_accuracy"]["sd"] == pytest.approx(0.02)
    table = kd.claims(cells, ["dir0.1"])
    rows = {r["method"]: r for r in table if r["measure"] == "global"}
    assert set(rows) == {"fedgkd", "fedgkd-vote", "feddistill", "fedbe", "fedkd"}
    # FedKD is judged twice: on the agents' own shards (its paper's evaluation) and on the balanced set.
    assert sorted((r["method"], r["measure"]) for r in table if r["method"] == "fedkd") == [("fedkd", "global"), ("fedkd", "local")]
    assert all(r["measure"] == "global" for r in table if r["method"] != "fedkd")
    assert rows["fedgkd"]["verdict"] == "holds" and rows["fedgkd"]["mean_difference"] == pytest.approx(0.10)
    assert all(r["rule"] == "paired" and r["paired"]["seeds"] == ["0", "1", "2"] for r in rows.values())
    # +0.03, -0.01, +0.01 seed by seed: mean 0.01, sd 0.02.
    assert rows["fedgkd-vote"]["verdict"] == "within noise" and rows["fedgkd-vote"]["sd_difference"] == pytest.approx(0.02)
    assert rows["fedgkd-vote"]["paired"]["differences"] == pytest.approx([0.03, -0.01, 0.01])
    assert rows["feddistill"]["verdict"] == "fails"
    assert rows["fedbe"]["verdict"] == "holds"
    assert rows["fedkd"]["baseline"] == "fedavg-mentor" and rows["fedkd"]["verdict"] == "holds"
    assert rows["fedkd"]["bytes_fraction"] == pytest.approx(0.05)
    # The same table with FedDistill's numbers raised: its verdict follows the numbers.
    for seed in range(3):
        runs[f"feddistill-dir0.1-seed{seed}"] = summary(kd, "feddistill", "dir0.1", seed, [0.2, 0.70 + 0.02 * seed])
    assert {r["method"]: r for r in kd.claims(kd.cells(runs), ["dir0.1"]) if r["measure"] == "global"}["feddistill"]["verdict"] == "holds"
    # FedKD's local row reads the local figures only: mentors far below FedAvg(mentor) on the balanced set, above it
    # on their own shards, is "fails" globally and "holds" locally.
    for seed in range(3):
        for name, final, local in (("fedkd", 0.20, 0.95), ("fedavg-mentor", 0.45, 0.70)):
            run = summary(kd, name, "dir0.1", seed, [0.1, final + 0.01 * seed], 1.0 if name == "fedkd" else 20.0)
            run["final_local_accuracy"] = local + 0.01 * seed
            runs[f"{name}-dir0.1-seed{seed}"] = run
    fedkd = {r["measure"]: r for r in kd.claims(kd.cells(runs), ["dir0.1"]) if r["method"] == "fedkd"}
    assert fedkd["global"]["verdict"] == "fails" and fedkd["global"]["mean_difference"] == pytest.approx(-0.25)
    assert fedkd["local"]["verdict"] == "holds" and fedkd["local"]["mean_difference"] == pytest.approx(0.25)
    assert fedkd["local"]["method_accuracy"]["mean"] == pytest.approx(0.96) and "own test shard" in fedkd["local"]["figure"]
    with pytest.raises(ValueError, match="measure"):
        kd.Claim("fedkd", "fedavg-mentor", ("iid",), "not_below", "c", "s", "r", measure="mentee")
    # Rounds to FedAvg's final accuracy (FedDistill's Table III measure), and FedKD's bytes-to-accuracy view.
    versus = kd.versus_fedavg(kd.cells(runs), ["dir0.1"])
    assert versus["fedgkd"]["dir0.1"]["rounds_to_fedavg_final"] == 2 and versus["fedgkd"]["dir0.1"]["global"]["differ"] is True
    view = kd.fedkd_view(cells, ["dir0.1"])["dir0.1"]
    assert view["mentee_global"]["mean"] == pytest.approx(0.3) and view["mentors_global"]["mean"] == pytest.approx(0.56)
    assert view["wire_mb_to_fedavg_mentor_final"]["fedkd mentors"] is None  # 0.56 < FedAvg(mentor)'s 0.57
    assert view["wire_mb_to_fedavg_mentor_final"]["fedavg mentor"] == {"round": 2, "wire_mb": pytest.approx(20.0)}


def test_the_page_renders_the_claim_table_from_the_json(tmp_path: Path) -> None:
    kd, render = load("kd_methods"), load("render_results")
    runs = {}
    for name in kd.METHODS:
        for seed in range(3):
            runs[f"{name}-dir0.1-seed{seed}"] = summary(kd, name, "dir0.1", seed, [0.2, 0.5 + 0.01 * seed + (0.1 if name == "fedgkd" else 0)],
                                                         mentee=0.3 if name == "fedkd" else None)
    doc = kd.document(runs, kd.SCALES["full"], None, "bench/kd_methods.py (test)")
    doc["eval_set"] = {"dataset": "fashion-mnist", "split": "test", "samples": 1000, "seed": 0, "ids_sha256": "ab" * 32,
                       "class_counts": [100] * 10}
    text = "\n".join(render.kd_methods_section(doc))
    assert "## The KD methods against their papers' claims (issue 24)" in text
    assert "**Incomplete:**" in text  # only Dirichlet(0.1) was recorded
    fedgkd = next(r for r in doc["claims"] if r["method"] == "fedgkd" and r["partition"] == "dir0.1")
    assert fedgkd["verdict"] == "holds"
    line = next(l for l in text.splitlines() if l.startswith(f"| FedGKD ({kd.MODEL_LABEL}, M = 5) | above FedAvg"))
    assert "Dirichlet(0.1)" in line and "61.0 ± 1.0%" in line and "51.0 ± 1.0%" in line and "+10.0 (0.0)" in line and "**holds**" in line
    assert "FedKD's global mentee" in text and f"MB to FedAvg({kd.MENTOR_LABEL})'s final" in text


@pytest.mark.slow
@pytest.mark.broker
def test_quick_mode_runs_every_method_with_two_seeds_in_under_a_minute(tmp_path: Path) -> None:
    kd = load("kd_methods")
    out = tmp_path / "kd.json"
    started = time.monotonic()
    assert kd.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    took = time.monotonic() - started
    data = json.loads(out.read_text())
    scale = data["scale"]
    assert scale["name"] == "quick" and scale["dataset"] == "synthetic" and scale["complete"] and scale["seeds"] == [0, 1]
    names = {f"{m}-{p}" for m in kd.METHODS for p in scale["partitions"]}
    assert set(data["runs"]) == {f"{n}-seed{seed}" for n in names for seed in (0, 1)}
    for run in data["runs"].values():
        assert run["status"] == "finished" and len(run["rounds"]) == scale["rounds"] and run["final_accuracy"] is not None
        assert all(r["participants"] == 2 for r in run["rounds"])  # client_fraction 0.5 of 4 agents
    assert all(c["n"] == 2 and c["final_accuracy"]["sd"] is not None for c in data["cells"].values())
    # FedKD: the mentors are the headline, the mentee is beside them, on both sets.
    fedkd = data["cells"]["fedkd-dir0.1"]
    assert {"model", "mentee"} <= set(fedkd["final_by_label"]["global"]) and {"model", "mentee"} <= set(fedkd["final_by_label"]["local"])
    assert data["fedkd"]["dir0.1"]["curves"]["fedavg mentor"]
    # Every verdict is the verdict function's on the JSON's own numbers.
    assert {r["method"] for r in data["claims"]} == {"fedgkd", "fedgkd-vote", "feddistill", "fedbe", "fedkd"}
    for row in data["claims"]:
        mine, base = data["cells"][f"{row['method']}-{row['partition']}"], data["cells"][f"{row['baseline']}-{row['partition']}"]
        figure = kd.MEASURES[row["measure"]][0]
        assert row["method_accuracy"] == mine[figure] and row["baseline_accuracy"] == base[figure]
        again = kd.verdict(mine[figure], base[figure], row["kind"],
                           *((mine["wire_mb"], base["wire_mb"]) if row["method"] == "fedkd" else (None, None)), chance=0.1)
        assert row["verdict"] == again["verdict"] in kd.VERDICTS
    assert data["budget"]["projected"]["minutes"] > 0 and data["budget"]["complete"]
    # --collect writes the same runs from their summaries.
    assert kd.main(["--quick", "--collect", "--out", str(tmp_path / "again.json"), "--run-dir", str(tmp_path / "runs")]) == 0
    assert set(json.loads((tmp_path / "again.json").read_text())["runs"]) == set(data["runs"])
    # What the default plausibility checks did to the honest agents, per run and over the runs.
    assert all(isinstance(r["screening"]["refused_total"], int) for r in data["runs"].values())
    assert data["honest_screening"]["refused_total"] == sum(r["screening"]["refused_total"] for r in data["runs"].values())
    print(f"quick mode: {took:.0f} s")


def test_honest_screening_counts_refusals_and_the_largest_peer_ratio() -> None:
    kd = load("kd_methods")
    rounds = [
        {"robustness": {"update_norms": {"reference": 9.0, "agents": {"a": 1.0, "b": 2.0, "c": 6.0}}}},
        {"robustness": {"update_norms": {"reference": 9.0, "agents": {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}},
                        "refused": {"d": {"implausible_norm": {"count": 1, "detail": "x"}}}}},
        {"robustness": {"update_norms": {"reference": 9.0, "agents": {"a": 1.0, "b": 50.0}}}},  # two agents: no peers to judge by
        {},
    ]
    screened = kd.honest_screening({"rounds": rounds})
    # c: 6 / median(1, 2) = 4; the other ratios are smaller.
    assert screened["update_norm_peer_ratio_max"] == pytest.approx(4.0)
    assert screened["update_norms_judged"] == 7 and screened["refused"] == {"implausible_norm": 1} and screened["refused_total"] == 1
    total = kd.screening_total({"x": {"partition": "dir0.1", "screening": screened}, "y": {"partition": "dir0.1", "screening": screened}})
    assert total["refused_total"] == 2 and total["by_partition"]["dir0.1"]["update_norms_judged"] == 14


def test_the_recorded_json_is_what_the_bench_makes_of_its_runs() -> None:
    path = RESULTS / "kd_methods.json"
    if not path.exists():
        pytest.skip("bench/results/kd_methods.json not recorded yet: run bench/kd_methods.py")
    kd = load("kd_methods")
    data = json.loads(path.read_text())
    assert data["generated_by"].startswith("bench/kd_methods.py") and data["scale"]["key"] == kd.SCALES["full"].key()
    assert all(key == f"{r['name']}-seed{r['seed']}" for key, r in data["runs"].items())
    # The cells and the claim table are recomputed from the recorded runs, never typed in.
    cells = kd.cells(data["runs"])
    assert json.loads(json.dumps(cells)) == data["cells"]
    assert json.loads(json.dumps(kd.claims(cells, list(data["scale"]["partitions"])))) == data["claims"]


def test_a_changed_method_setting_orphans_that_methods_runs_only(tmp_path: Path) -> None:
    """Runs are kept under the scale's shared regime and checked run by run against the plan's
    [method] table: FedBE's server work changing re-runs FedBE's cells and keeps every other one;
    runs recorded when the key still held FedBE's server settings count by the same rule."""
    kd = load("kd_methods")
    full = kd.SCALES["full"]
    assert "fedbe_server" not in full.key()
    specs = {run.name: run for _, _, run in kd.plan(full)}
    old_key = {**full.key(), "fedbe_server": {**full.fedbe_server, "unlabeled_samples": 64}}
    fedavg = {"name": "fedavg-dir0.1", "method_config": {**specs["fedavg-dir0.1"].method_config, "aggregation": "mean"}}
    fedbe_64 = {"name": "fedbe-dir0.1", "method_config": {**specs["fedbe-dir0.1"].method_config, "unlabeled_samples": 64}}
    fedbe_now = {"name": "fedbe-dir0.1", "method_config": dict(specs["fedbe-dir0.1"].method_config)}
    assert kd.recorded_for(old_key, fedavg, full, specs["fedavg-dir0.1"])
    assert kd.recorded_for(full.key(), fedavg, full, specs["fedavg-dir0.1"])
    assert not kd.recorded_for(old_key, fedbe_64, full, specs["fedbe-dir0.1"])
    assert kd.recorded_for(old_key, fedbe_now, full, specs["fedbe-dir0.1"])
    assert not kd.recorded_for({**full.key(), "local_epochs": 2}, fedavg, full, specs["fedavg-dir0.1"])  # another regime
    assert kd.recorded_for(full.key(), {"name": "not-planned"}, full, None)
    # On disk: --resume skips a matching summary only, and --collect keeps the same runs.
    root = tmp_path / "runs"
    for folder, key, run in (("fedavg-dir0.1-seed0", old_key, fedavg), ("fedbe-dir0.1-seed0", old_key, fedbe_64)):
        (root / folder).mkdir(parents=True)
        (root / folder / "summary.json").write_text(json.dumps({"scale": key, "run": {**run, "seed": 0}}))
    assert kd.summary_matches(root / "fedavg-dir0.1-seed0" / "summary.json", full, specs["fedavg-dir0.1"])
    assert not kd.summary_matches(root / "fedbe-dir0.1-seed0" / "summary.json", full, specs["fedbe-dir0.1"])
    assert not kd.summary_matches(root / "fedbe-dir0.1-seed1" / "summary.json", full, specs["fedbe-dir0.1"])
    kept = kd.runs_on_disk(root, full, {})  # no reports there: the summaries as recorded
    assert set(kept) == {"fedavg-dir0.1-seed0", "fedbe-dir0.1-seed0"}  # no spec given: judged by the regime alone
    planned = {run.name: (key, name, run) for key, name, run in kd.plan(full)}
    assert set(kd.runs_on_disk(root, full, planned)) == {"fedavg-dir0.1-seed0"}


def test_the_full_scales_projected_budget_is_the_docstrings_arithmetic() -> None:
    """Before any run is recorded, the grid is projected from the pilots' wall seconds (measured
    at 16 rounds, scaled to the scale's 20): 546.3 s per partition and seed x 20 / 16 x 3
    partitions x 3 seeds = 102 min, inside the 150-minute budget; a recorded run replaces the
    pilot's figure for its cell."""
    kd = load("kd_methods")
    full = kd.SCALES["full"]
    assert (kd.MODEL, kd.MENTOR, full.train_samples, full.rounds, full.local_epochs, kd.LOCAL["lr"]) == ("simplecnn", "convnet", 10000, 20, 10, 0.01)
    assert sum(kd.PILOT_S.values()) == pytest.approx(546.3) and set(kd.PILOT_S) == set(kd.METHODS) and kd.PILOT_ROUNDS == 16
    projected = kd.projection({}, full)
    assert projected["minutes"] == pytest.approx(546.3 * 20 / 16 * 3 * 3 / 60) == pytest.approx(102.4, abs=0.05)
    assert projected["minutes"] <= full.budget_minutes and projected["cells_unknown"] == []
    assert len(projected["cells_from_pilot"]) == len(kd.METHODS) * len(full.partitions)
    # One recorded seed of FedKD at Dir(0.1) replaces its cell's pilot figure (149.8 x 20 / 16 s a seed).
    run = {"name": "fedkd-dir0.1", "run_wall_time_s": 100.0}
    again = kd.projection({"fedkd-dir0.1-seed0": run}, full)
    assert again["minutes"] == pytest.approx(projected["minutes"] + (100.0 - 149.8 * 20 / 16) * 3 / 60)
    assert "fedkd-dir0.1" not in again["cells_from_pilot"]


# -- FedKD's ablation (--ablation fedkd) ------------------------------------------------------------ #


def test_each_ablation_arm_changes_one_factor_of_the_grids_fedkd() -> None:
    kd = load("kd_methods")
    scale = kd.ABLATION_SCALES["full"]
    assert (scale.partitions, scale.seeds, scale.rounds, scale.agents, scale.client_fraction) == (("dir0.1", "dir0.5", "iid"), (0, 1, 2), 6, 20, 0.2)
    everything = kd.ablation_plan(scale)
    plan = {arm.name: run for key, arm, run in everything if key == "dir0.1"}
    assert list(plan) == [a.name for a in kd.FEDKD_ARMS] and plan["fedkd"].method_config == kd.method_config("fedkd", scale)
    # At Dir(0.5) and IID only the arms that name the cause there: FedKD, its local-only mentor and the two baselines.
    for where in ("dir0.5", "iid"):
        assert [arm.name for key, arm, _ in everything if key == where] == ["fedkd", "fedavg-mentor", "mentor-local", "fedavg"]
        assert all(run.name == f"{arm.name}-{where}" for key, arm, run in everything if key == where)
    base = plan["fedkd"].method_config
    for arm in kd.FEDKD_ARMS:
        run = plan[arm.name]
        assert run.name == f"{arm.name}-dir0.1" and run.server == {"client_fraction": 0.2} and run.rounds == 6
        if run.method == "fedkd":
            changed = {k for k in set(base) | set(run.method_config) if base.get(k) != run.method_config.get(k)}
            assert changed == set(arm.changes), arm.name  # exactly its factor
            FedKdConfig.from_dict(run.method_config)  # every arm is a valid [fedkd] table
    assert plan["fedavg-mentor"].method_config["model"] == kd.MENTOR and plan["fedavg"].method_config["model"] == kd.MODEL


def test_a_fedavg_baseline_is_the_grids_run_cut_at_the_ablations_rounds() -> None:
    kd = load("kd_methods")
    scale = kd.ABLATION_SCALES["full"]
    grid_key = kd.SCALES["full"].key()
    plan = {arm.name: (key, arm, run) for key, arm, run in kd.ablation_plan(scale) if key == "dir0.1"}
    accuracies = [0.1 * (i + 1) if (i + 1) % 2 == 0 else None for i in range(20)]  # evaluated every second round
    recorded = summary(kd, "fedavg-mentor", "dir0.1", 0, [0.5] * 20)
    for r, acc in zip(recorded["rounds"], accuracies):
        r["accuracy"], r["local_accuracy"] = acc, None if acc is None else acc + 0.3
        r["by_label"] = {} if acc is None else {"global": {"model": acc}, "local": {"model": acc + 0.3}}
    recorded["method_config"] = {**kd.method_config("fedavg-mentor", kd.SCALES["full"]), "aggregation": "mean"}  # resolved: more keys
    grid = {"fedavg-mentor-dir0.1-seed0": recorded}
    key, arm, run = plan["fedavg-mentor"]
    cut = kd.grid_baseline(grid, grid_key, scale, key, arm, run, 0)
    assert cut is not None and cut["name"] == "fedavg-mentor-dir0.1" and len(cut["rounds"]) == 6
    assert cut["final_accuracy"] == pytest.approx(0.6) and cut["final_local_accuracy"] == pytest.approx(0.9)
    assert cut["best_accuracy"] == pytest.approx(0.6) and cut["wire_total_bytes"] == pytest.approx(recorded["rounds"][5]["cumulative_wire"])
    assert cut["from_grid"] == {"run": "fedavg-mentor-dir0.1-seed0", "grid_rounds": 20, "cut_at_round": 6} and cut["run_wall_time_s"] is None
    # Never another seed, another regime, another model, a FedKD arm, or a round the grid did not evaluate.
    assert kd.grid_baseline(grid, grid_key, scale, key, arm, run, 1) is None
    assert kd.grid_baseline(grid, {**grid_key, "local_epochs": 2}, scale, key, arm, run, 0) is None
    assert kd.grid_baseline({"fedavg-mentor-dir0.1-seed0": {**recorded, "method_config": {"model": "simplecnn"}}}, grid_key, scale,
                            key, arm, run, 0) is None
    assert kd.grid_baseline(grid, grid_key, scale, *plan["fedkd"], 0) is None
    odd = dataclasses.replace(scale, rounds=5)
    assert kd.grid_baseline(grid, grid_key, odd, *[x for x in kd.ablation_plan(odd) if x[1].name == "fedavg-mentor"][0], 0) is None


def _arm_run(kd: Any, arm: str, seed: int, deployed: float, local: float, mentee: float | None, majority: float = 0.5) -> dict[str, Any]:
    run = summary(kd, "fedkd" if kd.METHODS[kd.ARMS_BY_NAME[arm].base][0] == "fedkd" else "fedavg", "dir0.1", seed, [0.1, deployed],
                  mentee=mentee)
    run["final_local_accuracy"] = local
    run["final_by_label"]["local"] = {"model": local} | ({"mentee": mentee + 0.2} if mentee is not None else {})
    return {**run, "name": f"{arm}-dir0.1", "method_name": arm, "arm": arm, "local_majority_accuracy": majority}


def test_the_ablations_effects_are_paired_over_the_seeds() -> None:
    kd = load("kd_methods")
    runs = {}
    table = {  # arm -> per seed (deployed global, deployed local, mentee global)
        "fedkd": [(0.20, 0.95, 0.30), (0.25, 0.96, 0.32), (0.22, 0.94, 0.31)],
        "mentor-local": [(0.19, 0.95, 0.29), (0.25, 0.97, 0.33), (0.23, 0.94, 0.30)],
        "no-svd": [(0.30, 0.95, 0.40), (0.33, 0.96, 0.42), (0.31, 0.94, 0.41)],
        "fedavg-mentor": [(0.40, 0.70, None), (0.45, 0.68, None), (0.50, 0.90, None)],
        "fedavg": [(0.38, 0.69, None), (0.40, 0.70, None), (0.45, 0.88, None)],
    }
    for arm, seeds in table.items():
        for seed, (g, l, m) in enumerate(seeds):
            runs[f"{arm}-dir0.1-seed{seed}"] = _arm_run(kd, arm, seed, g, l, m)
    effects = kd.ablation_effects(runs, kd.ABLATION_SCALES["full"])["dir0.1"]
    assert set(effects["arms"]) == set(table) and set(effects["effect_vs_fedkd"]) == {"mentor-local", "no-svd"}
    assert effects["arms"]["fedkd"]["deployed_global"]["mean"] == pytest.approx(0.2233, abs=1e-4)
    assert effects["arms"]["fedkd"]["local_majority"]["mean"] == 0.5
    # No SVD: +0.10, +0.08, +0.09 on the mentors, seed by seed: a difference.
    svd_off = effects["effect_vs_fedkd"]["no-svd"]
    assert svd_off["deployed_global"]["differences"] == pytest.approx([0.10, 0.08, 0.09]) and svd_off["deployed_global"]["differ"]
    assert svd_off["mentee_global"]["mean_difference"] == pytest.approx(0.10)
    # The local-only mentor: -0.01, 0, +0.01: none.
    assert effects["effect_vs_fedkd"]["mentor-local"]["deployed_global"]["differ"] is False
    # The paper's comparison (the agents' own shards) and the balanced set's, against FedAvg(ConvNet).
    versus = effects["versus_fedavg"]["fedkd"]
    assert versus["mentors_vs_fedavg_mentor_local"]["differences"] == pytest.approx([0.25, 0.28, 0.04])
    assert versus["mentors_vs_fedavg_mentor_global"]["differences"] == pytest.approx([-0.20, -0.20, -0.28])
    assert versus["mentee_vs_fedavg_global"]["differences"] == pytest.approx([-0.08, -0.08, -0.14])
    # The section keeps the grid's other sections when written into its JSON, and the grid keeps it.
    section = kd.ablation_document(runs, kd.ABLATION_SCALES["full"], "test")
    assert section["scale"]["complete"] is False and section["effects"]["dir0.1"] == json.loads(json.dumps(effects))


def test_the_ablation_and_the_grid_keep_each_others_sections(tmp_path: Path) -> None:
    kd = load("kd_methods")
    out = tmp_path / "kd.json"
    out.write_text(json.dumps({"benchmark": "kd_methods", "runs": {"fedkd-dir0.1-seed0": {"kept": True}}, "claims": ["kept"]}))
    kd.write_ablation(out, "fedkd", {"runs": {"a": 1}})
    doc = json.loads(out.read_text())
    assert doc["runs"] == {"fedkd-dir0.1-seed0": {"kept": True}} and doc["claims"] == ["kept"]
    assert doc["ablations"] == {"fedkd": {"runs": {"a": 1}}}
    # The grid rewrites the file from its runs: the ablation stays.
    assert kd.carry_ablations(out, {"benchmark": "kd_methods", "runs": {}})["ablations"] == {"fedkd": {"runs": {"a": 1}}}
    assert "ablations" not in kd.carry_ablations(tmp_path / "none.json", {"runs": {}})


@pytest.mark.slow
@pytest.mark.broker
def test_the_fedkd_ablations_quick_mode_runs_every_arm_with_two_seeds(tmp_path: Path) -> None:
    kd = load("kd_methods")
    out = tmp_path / "kd.json"
    out.write_text(json.dumps({"benchmark": "kd_methods", "claims": ["the grid's, kept"]}))
    started = time.monotonic()
    assert kd.main(["--quick", "--ablation", "fedkd", "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    took = time.monotonic() - started
    doc = json.loads(out.read_text())
    assert doc["claims"] == ["the grid's, kept"]
    section = doc["ablations"]["fedkd"]
    scale = section["scale"]
    assert scale["name"] == "ablation-fedkd-quick" and scale["dataset"] == "synthetic" and scale["complete"] and scale["seeds"] == [0, 1]
    assert set(section["runs"]) == {f"{a.name}-dir0.1-seed{s}" for a in kd.FEDKD_ARMS for s in (0, 1)}
    for run in section["runs"].values():
        assert run["status"] == "finished" and len(run["rounds"]) == scale["rounds"] and run["final_accuracy"] is not None
        assert 0 < run["local_majority_accuracy"] <= 1
        # The report's resolved [method] table has the arm's factor.
        arm = kd.ARMS_BY_NAME[run["arm"]]
        assert all(run["method_config"][k] == v for k, v in arm.changes.items())
    # The effects are the function's on the section's own runs.
    assert json.loads(json.dumps(kd.ablation_effects(section["runs"], kd.ABLATION_SCALES["quick"]))) == section["effects"]
    effects = section["effects"]["dir0.1"]
    assert set(effects["effect_vs_fedkd"]) == {a.name for a in kd.FEDKD_ARMS if a.base == "fedkd" and a.name != "fedkd"}
    assert all(f["seeds"] == ["0", "1"] for e in effects["effect_vs_fedkd"].values() for f in e.values())
    # --collect writes the same runs from their summaries, still beside the rest of the file.
    assert kd.main(["--quick", "--ablation", "fedkd", "--collect", "--out", str(out), "--run-dir", str(tmp_path / "runs")]) == 0
    again = json.loads(out.read_text())
    assert set(again["ablations"]["fedkd"]["runs"]) == set(section["runs"]) and again["claims"] == ["the grid's, kept"]
    print(f"ablation quick mode: {took:.0f} s")


def test_the_recorded_ablation_is_what_the_bench_makes_of_its_runs() -> None:
    path = RESULTS / "kd_methods.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    section = (data.get("ablations") or {}).get("fedkd")
    if section is None:
        pytest.skip("no FedKD ablation recorded in bench/results/kd_methods.json yet: run bench/kd_methods.py --ablation fedkd")
    kd = load("kd_methods")
    assert section["scale"]["key"] == kd.ABLATION_SCALES["full"].key()
    assert all(key == f"{r['name']}-seed{r['seed']}" for key, r in section["runs"].items())
    assert json.loads(json.dumps(kd.ablation_effects(section["runs"], kd.ABLATION_SCALES["full"]))) == section["effects"]
    assert json.loads(json.dumps(kd.cells(section["runs"]))) == section["cells"]

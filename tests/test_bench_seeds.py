"""Seeds and spread in the benchmarks, without training: mean ± sd and the difference rule
(bench/_stats.py), bench/accuracy.py's cells, comparisons and budget check from synthetic run
reports, and what bench/render_results.py makes of them
(mean ± sd cells, captions naming the test set and the BatchNorm statistics) and of a JSON that
predates the balanced evaluation set (one line, none of its accuracies)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from test_bench_baselines import RESULTS, load

EVAL_SET = {"dataset": "fashion-mnist", "split": "test", "samples": 1000, "seed": 0, "ids_sha256": "ab" * 32,
            "images_sha256": "cd" * 32, "class_counts": [100] * 10}
MACHINE = {"cpu_model": "test CPU", "cores": 2, "torch": "x", "date_utc": "2026-11-24T00:00:00Z", "load_average_at_start": [0.0, 0.0, 0.0]}


def test_mean_and_sample_sd() -> None:
    stats = load("_stats")
    s = stats.mean_sd([0.5, 0.6, 0.7])
    assert s["mean"] == pytest.approx(0.6) and s["sd"] == pytest.approx(0.1) and s["n"] == 3  # n - 1: sqrt(0.02 / 2)
    assert stats.mean_sd([0.5, None, 0.7]) == {"mean": pytest.approx(0.6), "sd": pytest.approx(math.sqrt(0.02)), "n": 2,
                                              "values": [0.5, 0.7]}
    one = stats.mean_sd([0.4])
    assert one["mean"] == 0.4 and one["sd"] is None
    assert stats.mean_sd([None])["mean"] is None


def test_a_difference_is_one_larger_than_the_two_sds_combined() -> None:
    stats = load("_stats")
    a = stats.mean_sd([0.50, 0.52, 0.54])  # 0.52 ± 0.02
    b = stats.mean_sd([0.60, 0.62, 0.64])  # 0.62 ± 0.02: 0.10 apart > 0.04
    c = stats.mean_sd([0.53, 0.56, 0.59])  # 0.56 ± 0.03: 0.04 apart < 0.05
    assert stats.differ(a, b) is True and stats.differ(b, a) is True
    assert stats.differ(a, c) is False
    # Exactly the two sds apart is not a difference.
    d = {"mean": 0.60, "sd": 0.03}
    e = {"mean": 0.55, "sd": 0.02}
    assert stats.differ(d, e) is False
    # One seed: no sd, no claim either way.
    assert stats.differ(stats.mean_sd([0.9]), a) is None
    cmp = stats.comparison(b, a)
    assert cmp["mean_difference"] == pytest.approx(0.10) and cmp["combined_sd"] == pytest.approx(0.04) and cmp["differ"] is True
    assert "more than the two standard deviations combined" in stats.DIFFERENCE_RULE


def test_a_paired_difference_is_one_larger_than_the_sd_of_the_per_seed_differences() -> None:
    stats = load("_stats")
    # Hard and easy splits: each cell's spread is the splits' (sd 0.11), the gain is 0.03 in every seed.
    fedavg = {0: 0.40, 1: 0.37, 2: 0.60}
    method = {0: 0.43, 1: 0.40, 2: 0.63}
    unpaired = stats.comparison(stats.mean_sd(method.values()), stats.mean_sd(fedavg.values()))
    assert unpaired["differ"] is False  # 0.03 apart, sds 0.12 combined far larger
    p = stats.paired(method, fedavg)
    assert p["seeds"] == [0, 1, 2] and p["differences"] == pytest.approx([0.03, 0.03, 0.03])
    assert p["mean_difference"] == pytest.approx(0.03) and p["sd_difference"] == pytest.approx(0.0) and p["differ"] is True
    # A gain in one seed and losses in two: the mean is no further from zero than the sd.
    mixed = stats.paired({0: 0.50, 1: 0.35, 2: 0.58}, fedavg)  # +0.10, -0.02, -0.02: mean 0.02, sd 0.069
    assert mixed["mean_difference"] == pytest.approx(0.02) and mixed["sd_difference"] == pytest.approx(math.sqrt(0.0096 / 2))
    assert mixed["differ"] is False
    # Exactly one sd from zero is not a difference; below two common seeds, no claim; None and missing seeds are left out.
    assert stats.paired({0: 0.2, 1: 0.4}, {0: 0.1, 1: 0.1})["differ"] is True  # mean 0.2, sd 0.141
    edge = stats.paired({0: 0.0, 1: 0.2}, {0: 0.0, 1: 0.0})  # d = 0, 0.2: mean 0.1, sd 0.141
    assert edge["differ"] is False
    few = stats.paired({0: 0.5, 1: None, 3: 0.9}, {0: 0.4, 1: 0.4, 2: 0.4})
    assert few["seeds"] == [0] and few["n"] == 1 and few["sd_difference"] is None and few["differ"] is None
    assert "paired" in stats.PAIRED_RULE and "|mean d| > sd d" in stats.PAIRED_RULE


def synthetic_report(method: str, accuracies: list[float], seed: int, wall_s: float = 60.0) -> dict[str, Any]:
    """A finished run report in the new schema (global, local and edge accuracies, evaluation apart)."""
    gkt = method == "fedgkt"
    rounds = []
    for i, acc in enumerate(accuracies, 1):
        local = acc + 0.10
        labels = {"model": "the deployed model"} | ({"personalised_bn": "per-agent BN (personalised)", "edge": "ResNet-8"} if gkt else {})
        glob = {"model": acc} | ({"personalised_bn": acc + 0.05, "edge": acc - 0.05} if gkt else {})
        loc = {"model": local} | ({"personalised_bn": local + 0.02, "edge": local - 0.02} if gkt else {})
        rounds.append({
            "round": i, "status": "ok", "accuracy": acc, "local_accuracy": local,
            "edge_accuracy": acc - 0.05 if gkt else None, "edge_local_accuracy": local - 0.02 if gkt else None,
            "evaluation": {"accuracy": glob, "local_accuracy": loc, "labels": labels, "per_agent": {}, "server_eval_s": 2.0,
                           "edge_eval_flops": 1_000, "edge_eval_s": 1.0,
                           "bytes": {"up_payload": 10, "up_wire": 20, "down_payload": 30, "down_wire": 40}},
            "bytes": {"up_payload": 1_000_000, "up_wire": 1_100_000, "down_payload": 2_000_000, "down_wire": 2_100_000},
            "edge_train_flops": (1 if gkt else 9) * 10**12 + seed, "time_s": {"round": wall_s / len(accuracies)},
            "per_agent": {f"agent-{k}": {"idle_s": 1.0 * k, "round_s": 9.0} for k in range(4)},
        })
    return {
        "status": "finished", "models": {"edge": {"params": 1}}, "eval_set": EVAL_SET,
        "config": {"method_config": {"seed": seed, **({"server_order": "mixed", "train_extractor": False} if gkt else {})}},
        "totals": {"final_accuracy": accuracies[-1], "best_accuracy": max(accuracies), "final_local_accuracy": accuracies[-1] + 0.10,
                   "final_edge_accuracy": accuracies[-1] - 0.05 if gkt else None,
                   "edge_train_flops": sum(r["edge_train_flops"] for r in rounds), "wire_total": 3_200_000 * len(rounds),
                   "wall_time_s": wall_s},
        "rounds": rounds,
    }


# Final global accuracy of each cell, seed by seed (3 rounds: 0.10, round 2 = final - 0.1, final).
FINALS = {
    "fedgkt-iid": [0.70, 0.72, 0.74], "fedavg-resnet56-iid": [0.60, 0.62, 0.64],
    "fedgkt-noniid": [0.60, 0.65, 0.70], "fedavg-resnet56-noniid": [0.58, 0.62, 0.66],
    "centralized-resnet56": [0.80, 0.81, 0.82], "centralized-resnet8": [0.70, 0.71, 0.72],
}


def synthetic_accuracy(seeds: tuple[int, ...] = (0, 1, 2), run_wall_s: float = 100.0) -> dict[str, Any]:
    acc = load("accuracy")
    results = {}
    for table, key, run in acc.runs(3):
        for seed in seeds:
            final = FINALS[run.name][seed]
            report = synthetic_report(run.method, [0.10, final - 0.1, final], seed)
            results[acc.run_key(run.name, seed)] = {**acc.summarize(table, key, run, seed, report), "run_wall_time_s": run_wall_s}
    key = acc.scale_key(acc.SCALES["full"])
    names = {run.name for _, _, run in acc.runs(3)}
    return acc.document(results, key, acc.SCALES["full"], names, None, MACHINE, "bench/accuracy.py")


def test_cells_are_mean_and_sd_over_seeds_with_the_round_series_per_seed() -> None:
    doc = synthetic_accuracy()
    json.dumps(doc, allow_nan=False)
    assert doc["scale"]["seeds"] == [0, 1, 2] and doc["scale"]["complete"]
    assert set(doc["runs"]) == {f"{name}-seed{s}" for name in FINALS for s in (0, 1, 2)}
    avg = doc["cells"]["fedavg-resnet56-iid"]
    assert avg["n"] == 3 and avg["seeds"] == [0, 1, 2]
    assert avg["final_accuracy"]["mean"] == pytest.approx(0.62) and avg["final_accuracy"]["sd"] == pytest.approx(0.02)
    assert avg["final_local_accuracy"]["mean"] == pytest.approx(0.72)
    assert avg["accuracy_round2"]["values"] == pytest.approx([0.50, 0.52, 0.54])
    assert avg["wire_mb"]["mean"] == pytest.approx(9.6) and avg["wire_mb"]["sd"] == pytest.approx(0.0)
    assert avg["edge_tflops"]["mean"] == pytest.approx(27.0, abs=1e-6)
    assert avg["wall_min"]["mean"] == pytest.approx(100 / 60)
    assert [r["mean"] for r in avg["accuracy_by_round"]] == pytest.approx([0.10, 0.52, 0.62])
    gkt = doc["cells"]["fedgkt-iid"]
    # The evaluation's labelled figures: FedGKT's personalised BN beside the headline, not in it.
    assert gkt["final_accuracy"]["mean"] == pytest.approx(0.72)
    assert gkt["final_evaluation"]["global"]["personalised_bn"]["mean"] == pytest.approx(0.77)
    assert gkt["final_evaluation"]["labels"]["personalised_bn"] == "per-agent BN (personalised)"
    assert gkt["final_edge_accuracy"]["mean"] == pytest.approx(0.67)
    # Training costs only: the evaluation's are apart.
    run = doc["runs"]["fedgkt-iid-seed0"]
    assert run["evaluation_cost"] == {"server_eval_s": 6.0, "edge_eval_flops": 3_000, "edge_eval_s": 3.0, "wire_bytes": 180}
    assert run["rounds"][1]["local_accuracy"] == pytest.approx(0.70) and len(run["rounds"]) == 3  # round 2: 0.60 + 0.10
    assert doc["eval_set"] == EVAL_SET and doc["eval_set_same_for_every_run"] is True


def test_comparisons_follow_the_rule_and_fedavg_must_leave_chance_by_round_2() -> None:
    doc = synthetic_accuracy()
    iid, noniid = doc["comparisons"]["fedgkt_minus_fedavg_iid"], doc["comparisons"]["fedgkt_minus_fedavg_noniid"]
    # IID: 0.72 ± 0.02 vs 0.62 ± 0.02 differ; Dirichlet: 0.65 ± 0.05 vs 0.62 ± 0.04 do not.
    assert iid["global"]["differ"] is True and iid["global"]["mean_difference"] == pytest.approx(0.10)
    assert noniid["global"]["differ"] is False
    assert doc["comparisons"]["fedavg_round2_iid"] == {"min": pytest.approx(0.50), "floor": 0.30, "every_seed_above_floor": True}
    assert doc["comparisons"]["fedavg_round2_noniid"]["every_seed_above_floor"] is True


def test_the_budget_check_says_over_budget() -> None:
    within = synthetic_accuracy(run_wall_s=100.0)  # 18 runs x 100 s = 30 min
    assert within["budget"]["verdict"] == "within budget" and within["budget"]["within_budget"] is True
    assert within["budget"]["minutes"] == 150 and within["budget"]["wall_time_min"] == pytest.approx(30.0)
    over = synthetic_accuracy(run_wall_s=600.0)  # 180 min
    assert over["budget"]["verdict"] == "over budget" and over["budget"]["within_budget"] is False
    short = synthetic_accuracy(seeds=(0, 1), run_wall_s=100.0)  # fewer seeds than the benchmark's
    assert not short["scale"]["complete"] and short["budget"]["verdict"].startswith("incomplete")


def test_runs_made_at_the_same_time_count_once_in_the_budget() -> None:
    """Two invocations running at once: the benchmark's wall time is the union of the runs'
    intervals, not their sum; without finish times (older summaries) it is the sum."""
    acc = load("accuracy")
    runs = {"a": {"run_wall_time_s": 100.0, "finished_at": 1100.0},   # [1000, 1100]
            "b": {"run_wall_time_s": 100.0, "finished_at": 1150.0},   # [1050, 1150]: overlaps a
            "c": {"run_wall_time_s": 50.0, "finished_at": 2050.0}}    # [2000, 2050]: after a gap
    total, what = acc.elapsed_s(runs)
    assert total == pytest.approx(200.0) and "union" in what
    serial = {"a": {"run_wall_time_s": 100.0, "finished_at": 1100.0}, "b": {"run_wall_time_s": 100.0, "finished_at": 1200.0}}
    assert acc.elapsed_s(serial) == (pytest.approx(200.0), "the sum of the runs' wall times")
    assert acc.elapsed_s({**runs, "d": {"run_wall_time_s": 10.0}})[0] == pytest.approx(260.0)


def test_table1_setting_is_four_agents_three_seeds_within_150_minutes() -> None:
    acc = load("accuracy")
    full = acc.SCALES["full"]
    assert acc.SEEDS == (0, 1, 2) and acc.AGENTS == 4 and full.budget_minutes == 150
    assert load("render_results").ROUND2_FLOOR == acc.ROUND2_FLOOR == 0.30
    assert {run.name for _, _, run in acc.runs(full.rounds)} == set(FINALS)
    # FedGKT's defaults but for the batch, which both methods share.
    gkt = dict(next(run.method_config for _, _, run in acc.runs(full.rounds) if run.name == "fedgkt-iid"))
    assert gkt["edge_batch_size"] == gkt["server_batch_size"] == acc.FEDAVG["batch_size"] == acc.BATCH
    assert gkt["mode"] == "sync" and "eval_diagnostics" not in gkt
    # The other methods are another benchmark, on the same setting.
    methods = load("methods")
    planned = {run.name for _, _, run in methods.runs(full.rounds, full.train_samples)}
    assert {"fedgkd-resnet56-iid", "feddistill-resnet56-noniid", "fedbe-resnet56-iid", "fedkd-noniid",
            "fedgkt-kd-none-noniid", "fedgkt-kd-s2e-noniid"} <= planned
    assert not planned & set(FINALS)


def test_the_page_renders_mean_and_sd_cells_and_names_the_test_set_and_the_batchnorm_statistics(tmp_path: Path) -> None:
    render = load("render_results")
    (tmp_path / "accuracy.json").write_text(json.dumps(synthetic_accuracy()))
    page = render.render(tmp_path)
    table1 = page[page.index("### Table 1"):page.index("### Table 2")]
    # Mean ± sd cells, global and local, per partition.
    fedavg_row = next(line for line in table1.splitlines() if line.startswith("| FedAvg (ResNet-56)"))
    assert "62.0 ± 2.0%" in fedavg_row and "72.0 ± 2.0%" in fedavg_row and "the global model's averaged statistics" in fedavg_row
    gkt_row = next(line for line in table1.splitlines() if line.startswith("| FedGKT (ResNet-8 + ResNet-55)"))
    assert "72.0 ± 2.0%" in gkt_row and "65.0 ± 5.0%" in gkt_row and "the server's running statistics" in gkt_row
    personalised = next(line for line in table1.splitlines() if line.startswith("| FedGKT, personalised BN"))
    assert "77.0 ± 2.0%" in personalised
    # The captions: the test set, the seeds, the BatchNorm statistics of every number, the rule.
    assert "the same 1,000 balanced Fashion-MNIST test images for every method and seed, seeds 0, 1, 2" in table1
    assert "100 per class" in table1
    assert "server's running statistics" in table1 and "each agent's own statistics" in table1
    assert "FedAvg gets no per-agent BatchNorm statistics" in table1
    # FedGKT's departure from Algorithm 1, from the runs' own configs.
    assert '`server_order = "mixed"` and `train_extractor = false`, where Algorithm 1 walks' in table1
    assert render.DIFFERENCE_RULE in table1
    assert "IID: FedGKT − FedAvg, global +10.0 points (sds combined 4.0): differ" in table1
    assert "Dirichlet(0.5): FedGKT − FedAvg, global +3.0 points (sds combined 9.0): do not differ" in table1
    assert "**within budget**" in page and "against a budget of 150 min" in page
    assert "IID 50.00% / 52.00% / 54.00%" in table1 and "at least 30% in every seed: met" in table1  # FedAvg after round 2
    # Every seed's series.
    assert "| `fedgkt-noniid` | 2 | 10.00% / 60.00% / 70.00% |" in table1
    # edgesplit local draws the set with each run's seed: said so when sync and async of a seed share it.
    per_seed = {**synthetic_accuracy(), "eval_set_same_for_every_run": False, "eval_set_same_within_each_seed": True}
    assert "drawn with the run's seed: the same images for every run of a seed" in render._eval_set_line(per_seed, [0, 1, 2])
    assert "**not** for every run" in render._eval_set_line({**per_seed, "eval_set_same_within_each_seed": False})


def test_old_single_seed_accuracies_are_not_on_the_page(tmp_path: Path) -> None:
    """A results JSON that predates the balanced evaluation set (no ``eval_set``) gets one line,
    none of its accuracies: a synthetic old-format accuracy.json next to the recorded files, so
    the check holds whatever bench/results holds today."""
    import shutil

    render = load("render_results")
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    old = {"benchmark": "accuracy", "runs": {"fedgkt-iid": {"final_accuracy": 0.7763, "best_accuracy": 0.8119},
                    "fedavg-resnet56-iid": {"final_accuracy": 0.4621, "best_accuracy": 0.4737}}}
    (results / "accuracy.json").write_text(json.dumps(old))
    (results / "accuracy-quick.json").unlink(missing_ok=True)
    page = render.render(results)
    section = page[page.index("## Accuracy"):page.index("### Table 2")]
    assert "Table 1 (FedGKT vs FedAvg vs centralized): awaits re-measurement under the new evaluation" in section
    for name, run in old["runs"].items():
        for value in run.values():
            assert f"{100 * value:.2f}%" not in page and f"{100 * value:.1f}%" not in section, name


def test_the_other_methods_and_table2_render_beside_table1(tmp_path: Path) -> None:
    acc, methods, render = load("accuracy"), load("methods"), load("render_results")
    results = {}
    for table, key, run in methods.runs(3, 4000):
        for seed in (0, 1, 2):
            report = synthetic_report(run.method, [0.1, 0.4, 0.5 + seed / 100], seed)
            if run.method == "fedkd":  # the mentors are the headline; the shared mentee is labelled
                for r in report["rounds"]:
                    r["evaluation"]["accuracy"]["mentee"] = 0.30
                    r["evaluation"]["labels"]["mentee"] = "the shared mentee"
            results[acc.run_key(run.name, seed)] = {**acc.summarize(table, key, run, seed, report), "run_wall_time_s": 60.0}
    doc = {"benchmark": "methods", "generated_by": "bench/methods.py", "machine": MACHINE,
           "scale": {"seeds": [0, 1, 2], "partitions": acc.PARTITIONS, "ablation_partition": "dirichlet:0.5", "wall_time_min": 54.0},
           "eval_set": EVAL_SET, "eval_set_same_for_every_run": True, "budget": acc.budget(3240.0, 250, True, True),
           "cells": acc.cells(results), "runs": results}
    (tmp_path / "accuracy.json").write_text(json.dumps(synthetic_accuracy()))
    (tmp_path / "methods.json").write_text(json.dumps(doc))
    page = render.render(tmp_path)
    start = page.index("### Other methods")
    other = page[start:page.find("\n## ", start)]
    fedbe = next(line for line in other.splitlines() if line.startswith("| FedBE (ResNet-56)"))
    assert "51.0 ± 1.0%" in fedbe and "61.0 ± 1.0%" in fedbe
    mentee = next(line for line in other.splitlines() if line.startswith("| FedKD (shared mentee"))
    assert "30.0 ± 0.0%" in mentee
    assert "the same 1,000 balanced Fashion-MNIST test images for every method and seed, seeds 0, 1, 2" in other
    none = next(line for line in other.splitlines() if line.startswith("| None"))
    both = next(line for line in other.splitlines() if line.startswith("| S<->E (Table 1's FedGKT)"))
    assert "51.0 ± 1.0%" in none and "65.0 ± 5.0%" in both  # S<->E is Table 1's fedgkt-noniid cell

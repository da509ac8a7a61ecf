"""Seeds and spread in the benchmarks, without training: mean ± sd and the difference rule
(bench/_stats.py), the wall time and budget check of seeded runs (bench/_federation.py), and how
bench/render_results.py names the test set a JSON's accuracies were scored on."""

from __future__ import annotations

import math

import pytest

from test_bench_baselines import load

EVAL_SET = {"dataset": "fashion-mnist", "split": "test", "samples": 1000, "seed": 0, "ids_sha256": "ab" * 32,
            "images_sha256": "cd" * 32, "class_counts": [100] * 10}


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


def test_the_budget_check_says_over_budget() -> None:
    federation = load("_federation")
    within = federation.budget(30 * 60.0, 150, True, True)
    assert within["verdict"] == "within budget" and within["within_budget"] is True and within["wall_time_min"] == pytest.approx(30.0)
    over = federation.budget(180 * 60.0, 150, True, True)
    assert over["verdict"] == "over budget" and over["within_budget"] is False
    assert federation.budget(180 * 60.0, 150, False, True)["within_budget"] is False  # over before the last run is in
    short = federation.budget(30 * 60.0, 150, False, True)
    assert short["verdict"].startswith("incomplete") and short["within_budget"] is None
    assert "custom scale" in federation.budget(30 * 60.0, 150, True, False)["verdict"]


def test_runs_made_at_the_same_time_count_once_in_the_budget() -> None:
    """Two invocations running at once: the benchmark's wall time is the union of the runs'
    intervals, not their sum; without finish times (older summaries) it is the sum."""
    acc = load("_federation")
    runs = {"a": {"run_wall_time_s": 100.0, "finished_at": 1100.0},   # [1000, 1100]
            "b": {"run_wall_time_s": 100.0, "finished_at": 1150.0},   # [1050, 1150]: overlaps a
            "c": {"run_wall_time_s": 50.0, "finished_at": 2050.0}}    # [2000, 2050]: after a gap
    total, what = acc.elapsed_s(runs)
    assert total == pytest.approx(200.0) and "union" in what
    serial = {"a": {"run_wall_time_s": 100.0, "finished_at": 1100.0}, "b": {"run_wall_time_s": 100.0, "finished_at": 1200.0}}
    assert acc.elapsed_s(serial) == (pytest.approx(200.0), "the sum of the runs' wall times")
    assert acc.elapsed_s({**runs, "d": {"run_wall_time_s": 10.0}})[0] == pytest.approx(260.0)


def test_the_page_names_the_test_set_its_accuracies_were_scored_on() -> None:
    render = load("render_results")
    same = {"eval_set": EVAL_SET, "eval_set_same_for_every_run": True}
    line = render._eval_set_line(same, [0, 1, 2])
    assert "the same 1,000 balanced Fashion-MNIST test images for every method and seed, seeds 0, 1, 2" in line
    assert "100 per class" in line and "drawn with seed 0" in line
    # edgesplit local draws the set with each run's seed: said so when the runs of a seed share it.
    per_seed = {**same, "eval_set_same_for_every_run": False, "eval_set_same_within_each_seed": True}
    assert "drawn with the run's seed: the same images for every run of a seed" in render._eval_set_line(per_seed, [0, 1, 2])
    assert "**not** for every run" in render._eval_set_line({**per_seed, "eval_set_same_within_each_seed": False})

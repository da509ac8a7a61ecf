"""bench/kd_ablation_fedbe.py: the variants change only FedBE's server work, the teacher's
figures are read right, and bench/results/kd_ablation_fedbe.json holds every variant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from test_bench_baselines import load

ROOT = Path(__file__).resolve().parents[1]


def test_a_variant_changes_only_fedbe_s_server_work() -> None:
    ablation = load("kd_ablation_fedbe")
    kd = load("kd_methods")
    base = kd.SCALES["full"]
    assert base.fedbe_server == kd.FEDBE_SERVER and kd.FEDBE_SERVER["unlabeled_samples"] == 1000  # FedBE's own default
    assert ablation.VARIANTS["u1000-steps16"] == {"unlabeled_samples": 1000}  # the grid's setting: its runs reproduce the grid's
    for name, changes in ablation.VARIANTS.items():
        scale = ablation.variant_scale(name)
        assert scale.fedbe_server == {**kd.FEDBE_SERVER, **changes}
        assert {k: v for k, v in vars(scale).items() if k != "fedbe_server"} == {
            k: v for k, v in vars(base).items() if k != "fedbe_server"}
        for partition in ablation.PARTITIONS:
            run = ablation.variant_run(name, partition)
            grid_run = next(r for key, n, r in kd.plan(base) if n == "fedbe" and key == partition)
            assert run.name == f"fedbe-{name}-{partition}"
            assert {k: v for k, v in run.method_config.items() if k not in changes} == {
                k: v for k, v in grid_run.method_config.items() if k not in changes}
    paper = ablation.VARIANTS["u1000-paper"]
    # 20 epochs of 1,000 images at batch 128 (8 batches an epoch), SWA warm-up at the paper's share (250 of 1,580)
    assert paper["distill_steps"] == 20 * -(-1000 // 128) and paper["swa_warmup_steps"] == round(160 * 250 / 1580)


def _round(wbar: float, teacher: float, distilled: float) -> dict[str, Any]:
    return {"server_accuracy": {"weight_average_accuracy": wbar, "pseudo_label_accuracy": teacher, "distilled_accuracy": distilled}}


def test_the_teachers_margin_is_read_from_the_rounds() -> None:
    ablation = load("kd_ablation_fedbe")
    rounds = [_round(0.5, 0.52, 0.51)] * 3 + [_round(0.6, 0.59, 0.61)] * ablation.LAST_ROUNDS + [{"server_accuracy": None}]
    t = ablation.teacher({"rounds": rounds})
    n = 3 + ablation.LAST_ROUNDS
    assert t["rounds"] == n
    assert t["teacher_minus_mean"] == pytest.approx((3 * 0.02 - ablation.LAST_ROUNDS * 0.01) / n)
    assert t["teacher_minus_mean_last"] == pytest.approx(-0.01) and t["distilled_minus_mean_last"] == pytest.approx(0.01)
    assert ablation.teacher({"rounds": [{"accuracy": 0.3}]})["teacher_minus_mean"] is None  # not FedBE, or recorded before
    # The JSON written before the partitions (runs[variant][seed], Dirichlet(0.1)) reads as runs[variant][partition][seed].
    assert ablation.migrate({"u64-steps16": {"0": {"a": 1}}}) == {"u64-steps16": {"dir0.1": {"0": {"a": 1}}}}
    assert ablation.migrate({"u64-steps16": {"dir0.5": {"0": {"a": 1}}}}) == {"u64-steps16": {"dir0.5": {"0": {"a": 1}}}}


def test_the_recorded_ablation_has_every_variant_and_reproduces_the_grid() -> None:
    ablation = load("kd_ablation_fedbe")
    data = json.loads((ROOT / "bench" / "results" / "kd_ablation_fedbe.json").read_text())
    assert set(data["summary"]) == set(ablation.PARTITIONS)
    for partition, part in data["summary"].items():
        assert set(ablation.VARIANTS) <= set(part), partition  # every variant recorded at every partition
        # The grid's setting run again gives the grid's FedBE, seed by seed.
        assert part["u1000-steps16"]["vs_grid_fedbe"]["differences"] == [0.0, 0.0, 0.0], partition

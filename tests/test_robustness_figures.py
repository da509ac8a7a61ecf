"""The robustness figures an experiment's cell takes from its run's report (the faulty agents apart
from the honest ones), and the defaults of the server's screen against the figures its experiments
recorded (bench/experiments/direction_cosines.toml, label_scores.toml)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloud_server.experiments.results import ROBUSTNESS_FIGURES, faulty_agents, robustness_figures, run_figures

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _round(refused: dict[str, dict[str, int]] | None = None, excluded: tuple[str, ...] = (), quarantined: tuple[str, ...] = (),
           cosines: dict[str, float | None] | None = None, rises: dict[str, float | None] | None = None,
           agreement: dict[str, float] | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {}
    if refused:
        section["refused"] = {a: {why: {"count": n} for why, n in rs.items()} for a, rs in refused.items()}
    if quarantined:
        section["quarantine_excluded"] = list(quarantined)
    if cosines is not None:
        section["update_directions"] = {"agents": cosines}
    if rises is not None:
        section["update_validation"] = {"agents": rises}
    if agreement is not None:
        section["label_agreement"] = {"agents": {a: {"server": v, "edge": 0.5} for a, v in agreement.items()}}
    return {"status": "ok", "excluded": {a: "refused" for a in excluded}, "robustness": section}


def test_the_faulty_agents_figures_are_kept_apart_from_the_honest_ones() -> None:
    rounds = [
        _round({"agent-4": {"implausible_norm": 1}}, excluded=("agent-4",), cosines={"agent-0": 0.9, "agent-1": 0.4, "agent-4": -0.9},
               rises={"agent-0": 0.1, "agent-1": 0.3, "agent-4": None}, agreement={"agent-0": 0.8, "agent-4": 0.2}),
        _round({"agent-1": {"implausible_norm": 2}, "agent-4": {"out_of_range": 3}}, quarantined=("agent-4",),
               cosines={"agent-0": 0.7, "agent-1": 0.5, "agent-4": -0.5}, rises={"agent-0": 0.2, "agent-1": -0.1, "agent-4": 4.0},
               agreement={"agent-0": 0.6, "agent-4": 0.3}),
        _round(cosines={"agent-0": 0.8, "agent-4": None}),
    ]
    f = robustness_figures(rounds, {"agent-4"})
    assert set(f) == set(ROBUSTNESS_FIGURES)
    assert (f["refused_uploads"], f["honest_refused_uploads"], f["faulty_refused_uploads"]) == (6, 2, 4)
    assert f["faulty_unused_rounds"] == 2  # refused in round 1, quarantined in round 2, used in round 3
    assert (f["honest_min_cosine"], f["faulty_max_cosine"]) == (0.4, -0.5)  # a null cosine (no direction) is not judged
    assert (f["honest_max_validation_rise"], f["faulty_min_validation_rise"]) == (0.3, 4.0)  # the not-finite rise left out
    assert (f["honest_min_label_agreement"], f["faulty_max_label_agreement"]) == (0.6, 0.3)
    # The same rounds with no agent faulty: every figure is the honest agents', the faulty ones' null.
    g = robustness_figures(rounds, set())
    assert (g["honest_refused_uploads"], g["honest_min_cosine"], g["honest_min_label_agreement"]) == (6, -0.9, 0.2)
    assert g["faulty_refused_uploads"] is g["faulty_unused_rounds"] is g["faulty_max_cosine"] is None
    assert robustness_figures([], {"agent-4"})["refused_uploads"] is None


def test_a_reports_faulty_agents_reach_its_run_figures() -> None:
    report = {"agents": {"agent-0": {"fault": ""}, "agent-1": {"fault": "sign_flip x4"}},
              "totals": {"final_accuracy": 0.5, "rounds_completed": 1},
              "rounds": [_round({"agent-1": {"implausible_direction": 1}}, excluded=("agent-1",), cosines={"agent-0": 0.9, "agent-1": -0.8})]}
    assert faulty_agents(report) == {"agent-1"}
    figures = run_figures(report)
    assert (figures["faulty_refused_uploads"], figures["faulty_unused_rounds"], figures["faulty_max_cosine"]) == (1, 1, -0.8)
    assert figures["honest_refused_uploads"] == 0 and figures["honest_min_cosine"] == 0.9


def _done(name: str, variant: str | None = None) -> list[dict[str, Any]]:
    cells = json.loads((RESULTS / f"{name}.json").read_text())["cells"]
    return [c["run"] for c in cells if c["status"] == "done" and variant in (None, c["variant"])]


def test_the_direction_checks_default_is_off_or_between_the_recorded_honest_and_flipped_cosines() -> None:
    from cloud_server.robust.config import PLAUSIBLE_MIN_COSINE

    honest = [r["honest_min_cosine"] for r in _done("direction_cosines") if r["honest_min_cosine"] is not None]
    flipped = [r["faulty_max_cosine"] for r in _done("direction_cosines", "flip_median") if r["faulty_max_cosine"] is not None]
    assert honest and flipped
    if PLAUSIBLE_MIN_COSINE > -1:
        assert max(flipped) < PLAUSIBLE_MIN_COSINE < min(honest)
    else:  # off because no threshold separates them: a flipped agent points as far as an honest one somewhere
        assert max(flipped) >= min(honest)


def test_the_label_checks_default_is_off_or_below_every_recorded_honest_agreement() -> None:
    from cloud_server.robust.validation import DefenceConfig

    default = DefenceConfig()
    honest = [r["honest_min_label_agreement"] for r in _done("label_scores") if r["honest_min_label_agreement"] is not None]
    assert honest
    if default.checks_labels:
        assert default.plausible_min_label_agreement < min(honest)
    assert not default.validates  # a labelled set is the operator's to give: none by default


def test_the_score_experiments_recorded_without_refusing_an_honest_upload() -> None:
    for name in ("direction_cosines", "validation_scores", "label_scores"):
        runs = _done(name)
        assert runs, name
        assert all(r["honest_refused_uploads"] == 0 for r in runs), name

"""bench/defence_scores.py: the grid behind the defaults of the server's validation set and
FedGKT's label check, what it replays of the recorded figures (by hand), and the JSON it
wrote against the defaults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from test_bench_baselines import load

RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "defence_scores.json"


def test_the_grid_measures_both_checks_at_every_partition_and_seed_recording_only() -> None:
    ds = load("defence_scores")
    runs = ds.grid()
    names = [r.name for r in runs]
    assert len(names) == len(set(names))
    assert len(ds.SEEDS) >= 2  # one seed per cell is noise
    for seed in ds.SEEDS:
        for part in ("iid", "dir0.5", "dir0.1"):
            for name in (f"validation-none-{part}-s{seed}", f"validation-sign_flip-{part}-s{seed}",
                         f"validation-sign_flip_weights-{part}-s{seed}", f"labels-none-{part}-s{seed}",
                         f"labels-random_labels-{part}-s{seed}"):
                assert name in names
    # Seed by seed: an interrupted bench leaves whole seeds behind it, and each seed's grid is the same.
    seeds = [r.seed for r in runs]
    assert seeds == sorted(seeds, key=list(ds.SEEDS).index)
    per_seed = [[dataclasses.replace(r, seed=0) for r in runs if r.seed == s] for s in ds.SEEDS]
    assert all(x == per_seed[0] for x in per_seed)
    assert [r.name for r in ds.grid((3,))] == [r.name.replace("-s0", "-s3") for r in per_seed[0]]
    assert runs[0].attack != "none"  # the bad agent beside four honest ones first
    flip = next(r for r in runs if r.attack == "sign_flip")
    assert flip.aggregation == "median" and flip.method == "fedavg"  # the model trains as with the flip kept out
    weights_only = next(r for r in runs if r.attack == "sign_flip_weights")
    assert weights_only.aggregation == "median" and weights_only.server() == flip.server()
    # Recorded, never refused: no margin is reached, no agreement is below the floor.
    assert flip.server()["validation_loss_margin"] >= 1e9
    assert 0 < next(r for r in runs if r.check == "labels").server()["plausible_min_label_agreement"] <= 1e-6


def test_seeds_option_parses_a_list_and_names_what_is_wrong() -> None:
    import argparse

    import pytest

    ds = load("defence_scores")
    assert ds.parse_seeds("1") == (1,) and ds.parse_seeds("0, 1,2") == (0, 1, 2)
    for bad, why in (("0,x", "comma-separated integers"), ("1,1", "distinct"), ("-1", "non-negative"), ("", "distinct")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            ds.parse_seeds(bad)


def _round(rises: dict[str, float | None], shares: dict[str, float | None] | None = None) -> dict[str, Any]:
    return {"update_validation": {"agents": rises, "agents_share": shares or rises}, "label_agreement": None}


def test_replay_counts_honest_refusals_and_the_bad_agents_rounds() -> None:
    ds = load("defence_scores")
    bad = ds.BAD
    honest = {"agent-0": 0.1, "agent-1": 0.2, "agent-2": 0.0, "agent-3": 0.15}
    run = {"check": "validation", "attack": "sign_flip",
           "rounds": [_round({**honest, bad: 5.0}), _round({**honest, bad: 0.3}), _round({**honest, bad: None})]}
    r = ds.replay(run)
    assert r["bad_rises_update"] == [5.0, 0.3, None]  # null: not finite, refused at any margin (below)
    assert r["honest_max_rise_update"] == 0.2 and r["honest_nonfinite_update"] == 0
    json.dumps(r, allow_nan=False)  # what the bench writes: no infinity in it
    # Margin 0.5: round 1 (5.0 > 0.125 + 0.5) and round 3; round 2's 0.3 is within it.
    at = r["per_threshold"]["update-0.5"]
    assert at == {"honest_refused": 0, "honest_judged": 12, "bad_refused_rounds": [1, 3]}
    # Margin 0.1: the MAD term sets the limit, 0.125 + 6 x 1.4826 x 0.05 = 0.570; round 2's 0.3 stays within it.
    assert r["per_threshold"]["update-0.1"]["bad_refused_rounds"] == [1, 3]
    clean = {"check": "labels", "attack": "none", "rounds": [
        {"label_agreement": {"agents": {"agent-0": {"server": 0.8, "edge": 0.5}, "agent-1": {"server": 0.7, "edge": 0.5},
                                        "agent-2": {"server": 0.75, "edge": 0.5}, bad: {"server": 0.1, "edge": 0.1}}}}]}
    r = ds.replay(clean)  # no attack: agent-4 is honest, and its refusal counts against the floor
    assert r["honest_min_agreement"] == 0.1 and r["bad_agreement"] is None
    assert r["per_threshold"]["0.2"] == {"honest_refused": 1, "honest_judged": 4, "bad_refused_rounds": None}


def test_the_summary_keeps_each_attacked_runs_refused_rounds_apart() -> None:
    ds = load("defence_scores")
    bad, honest = ds.BAD, {"agent-0": 0.1, "agent-1": 0.2, "agent-2": 0.0, "agent-3": 0.15}
    runs = []
    for attack, rises in (("sign_flip", [None, None]), ("sign_flip_weights", [0.3, 2.0]), ("none", [0.1, 0.1])):
        run = {"name": f"validation-{attack}-iid-s0", "check": "validation", "attack": attack, "partition": "iid",
               "seed": 0, "final_accuracy": 0.5, "rounds": [_round({**honest, bad: x}) for x in rises]}
        run["replay"] = ds.replay(run)
        runs.append(run)
    entry = ds.summary(runs)["validation"]["iid"]
    # The NaN flip is refused in both rounds; the finite one only where its rise (2.0) clears 0.125 + 0.5.
    assert entry["update-0.5"]["bad_refused_rounds"] == {"validation-sign_flip-iid-s0": [1, 2],
                                                         "validation-sign_flip_weights-iid-s0": [2]}
    assert entry["update-0.5"]["honest_refused"] == 0 and entry["update-0.5"]["honest_judged"] == 2 * 4 + 2 * 4 + 2 * 5
    assert entry["bad_rises_update"]["validation-sign_flip_weights-iid-s0"] == [0.3, 2.0]


def test_the_summary_adds_up_the_seeds_and_keeps_each_seed_apart() -> None:
    ds = load("defence_scores")
    bad, honest = ds.BAD, {"agent-0": 0.1, "agent-1": 0.2, "agent-2": 0.0, "agent-3": 0.15}
    runs = []
    # Seed 1's clean run has an honest agent far above the rest (refused at margin 0.5), seed 0's none.
    for seed, attack, rounds in ((0, "sign_flip_weights", [{**honest, bad: 2.0}]), (0, "none", [{**honest, bad: 0.1}]),
                                 (1, "sign_flip_weights", [{**honest, bad: 0.3}, {**honest, bad: 3.0}]),
                                 (1, "none", [{**honest, bad: 0.1}, {**honest, "agent-0": 5.0, bad: 0.1}])):
        run = {"name": f"validation-{attack}-dir0.1-s{seed}", "check": "validation", "attack": attack,
               "partition": "dir0.1", "seed": seed, "final_accuracy": 0.5, "rounds": [_round(r) for r in rounds]}
        run["replay"] = ds.replay(run)
        runs.append(run)
    out = ds.summary(runs)
    assert out["seeds"] == [0, 1] and set(out) == {"seeds", "validation"}
    at = out["validation"]["dir0.1"]["update-0.5"]
    assert at["by_seed"] == {"0": {"honest_refused": 0, "honest_judged": 4 + 5},
                             "1": {"honest_refused": 1, "honest_judged": 2 * 4 + 2 * 5}}
    assert (at["honest_refused"], at["honest_judged"]) == (1, 9 + 18)
    assert at["bad_refused_rounds"] == {"validation-sign_flip_weights-dir0.1-s0": [1],
                                        "validation-sign_flip_weights-dir0.1-s1": [2]}
    assert ds.summary(runs[:2])["seeds"] == [0]


def ds_bad() -> str:
    return load("defence_scores").BAD  # type: ignore[no-any-return]


def test_the_recorded_figures_back_the_defaults() -> None:
    """The defaults either are off or refuse no honest upload the bench recorded and refuse the
    bad agent in most judged rounds at every partition."""
    import pytest

    from cloud_server.robust_validation import VALIDATION_LOSS_MARGIN, DefenceConfig

    if not RESULT.exists():
        pytest.skip("bench/results/defence_scores.json has not been recorded yet (python bench/defence_scores.py)")
    data = json.loads(RESULT.read_text())
    for run in data["runs"]:
        # Recorded, nothing refused, except what every margin refuses: an update whose
        # validation loss is not finite (the x4 sign flip negates BatchNorm's variances).
        nonfinite = sum(1 for rise in (run["replay"].get("bad_rises_update") or []) if rise is None)
        expected = {ds_bad(): nonfinite} if nonfinite else {}
        assert {a: sum(r.values()) if isinstance(r, dict) else r for a, r in run["refusals"].items()} == expected, run["name"]
    default = DefenceConfig()
    summary = data["summary"]
    assert not default.validates  # a labelled set is the operator's to give: none by default
    key = f"{default.validation_step}-{VALIDATION_LOSS_MARGIN}"
    for part, entry in summary.get("validation", {}).items():
        assert entry[key]["honest_refused"] == 0, (part, entry[key])
    if default.checks_labels:
        floor = str(default.plausible_min_label_agreement)
        for part, entry in summary.get("labels", {}).items():
            assert entry[floor]["honest_refused"] == 0, (part, entry[floor])


def _span(values: list[int]) -> str:
    return "none" if not values else (f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}")


def _nats(x: float) -> str:
    return (f"{x:+.2f}" if abs(x) < 10 else f"{x:+.1f}").replace("-", "\u2212")  # the page's minus sign


NOT_RUN = "\u2014"  # the page's dash for a cell whose run is not recorded yet


def _refused(per_threshold: dict[str, Any], keys: list[str], seed: str) -> str:
    """"0 of N" where no threshold refused an honest upload of this seed, else each one that did."""
    if not keys or seed not in per_threshold[keys[0]]["by_seed"]:
        return NOT_RUN
    counts = {k.split("-")[-1]: per_threshold[k]["by_seed"][seed]["honest_refused"] for k in keys}
    judged = per_threshold[keys[0]]["by_seed"][seed]["honest_judged"]
    if not any(counts.values()):
        return f"0 of {judged}"
    return ", ".join(f"{n} at {t}" for t, n in counts.items() if n) + f" of {judged}"


def _validation_cells(v: dict[str, Any], part: str, s: str) -> list[str]:
    margins = [k for k in v if k.startswith("update-")]
    name = f"validation-sign_flip_weights-{part}{s}"
    honest = [x for n, x in v.get("honest_max_rise_update", {}).items() if n.endswith(s)]
    most = f" ({_nats(max(honest))})" if honest else ""
    if name not in v.get("bad_rises_update", {}):
        return [_refused(v, margins, s[2:]), NOT_RUN + most, NOT_RUN]
    rises = v["bad_rises_update"][name]
    finite = [x for x in rises if x is not None]  # null: not finite, refused at any margin
    spread = f"{_nats(min(finite))} to {_nats(max(finite))}" if finite else "not finite"
    return [_refused(v, margins, s[2:]), spread + most, f"{_span(v['update-0.5']['bad_refused_rounds'][name])} of {len(rises)}"]


def _label_cells(lab: dict[str, Any], part: str, s: str) -> list[str]:
    floors = [k for k in lab if k.replace(".", "").isdigit()]
    name = f"labels-random_labels-{part}{s}"
    honest = [x for n, x in lab.get("honest_min_agreement", {}).items() if n.endswith(s)]
    least = f" ({min(honest):.2f})" if honest else ""
    if name not in lab.get("bad_agreement", {}):
        return [_refused(lab, floors, s[2:]), NOT_RUN + least, NOT_RUN]
    bad = [a for a in lab["bad_agreement"][name] if a is not None]
    return [_refused(lab, floors, s[2:]), f"{min(bad):.2f}-{max(bad):.2f}{least}", _span(lab["0.3"]["bad_refused_rounds"][name])]


def grid_rows(data: dict[str, Any]) -> list[str]:
    """The defence grid's rows, one per partition and seed with a run recorded, from the JSON
    (a seed still running: its missing runs' cells are a dash)."""
    labels = {"iid": "IID", "dir0.5": "Dirichlet(0.5)", "dir0.1": "Dirichlet(0.1)"}
    rows = []
    for part, label in labels.items():
        v, lab = data["summary"].get("validation", {}).get(part, {}), data["summary"].get("labels", {}).get(part, {})
        for seed in data["summary"]["seeds"]:
            s = f"-s{seed}"
            if not any(r["partition"] == part and r["seed"] == seed for r in data["runs"]):
                continue
            cells = [label, str(seed), *_validation_cells(v, part, s), *_label_cells(lab, part, s)]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_the_rows_of_a_seed_still_running_show_what_is_not_recorded() -> None:
    """A seed with some runs recorded gets its rows; the cells of its missing runs are a dash."""
    ds = load("defence_scores")
    bad, honest = ds.BAD, {"agent-0": 0.1, "agent-1": 0.2, "agent-2": 0.0, "agent-3": 0.15}
    runs = []
    for seed, attack, rises in ((0, "sign_flip_weights", [0.3, 2.0]), (0, "none", [0.1, 0.1]), (1, "none", [0.1, 0.1])):
        run = {"name": f"validation-{attack}-iid-s{seed}", "check": "validation", "attack": attack, "partition": "iid",
               "seed": seed, "final_accuracy": 0.5, "rounds": [_round({**honest, bad: x}) for x in rises]}
        run["replay"] = ds.replay(run)
        runs.append(run)
    rows = grid_rows({"summary": ds.summary(runs), "runs": runs})
    assert rows == [f"| IID | 0 | 0 of 18 | +0.30 to +2.00 (+0.20) | 2 of 2 | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} |",
                    f"| IID | 1 | 0 of 10 | {NOT_RUN} (+0.20) | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} |"]

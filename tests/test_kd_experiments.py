"""The KD experiments' defaults tied to their files and recordings: FedDistill's weight search
moves one weight of the defaults at a time over the paper's ranges in the grid's regime and found
none better; FedBE's default server work is the grid's, and the two recordings of it agree."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cloud_server.experiments.experiment_file import load_experiment
from cloud_server.experiments.runner import cell_command
from cloud_server.experiments.tables import evaluate_claims, long_table, summary
from cloud_server.methods.fedbe import FedBEConfig
from cloud_server.methods.feddistill import FedDistillConfig

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS, RESULTS = ROOT / "bench" / "experiments", ROOT / "bench" / "results"
#: The paper's printed search ranges (Song et al., Sec. IV-A).
PAPER_RANGES = {**{w: tuple(round(i / 10, 1) for i in range(11)) for w in ("alpha_t", "alpha_r", "alpha_f")},
                "beta_l": (0.5, 0.8, 1.0, 1.1, 1.2, 1.4), "beta_e": (0.1, 0.2, 0.3, 0.4, 0.5), "beta_fc": (0.1, 0.2, 0.3, 0.4, 0.5)}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(FedDistillConfig) if f.name in PAPER_RANGES}


def _commands(name: str) -> dict[str, list[str]]:
    experiment = load_experiment(EXPERIMENTS / f"{name}.toml")
    return {c.key: cell_command(experiment, c) for c in experiment.cells()}


def _with_rounds(command: list[str], rounds: int) -> list[str]:
    out = list(command)
    out[out.index("--rounds") + 1] = str(rounds)
    return out


def test_each_feddistill_variant_moves_one_default_weight_within_the_papers_range() -> None:
    assert all(DEFAULTS[w] in PAPER_RANGES[w] for w in PAPER_RANGES)
    experiment = load_experiment(EXPERIMENTS / "feddistill_weights.toml")
    moved = set()
    for variant in experiment.variants:
        weights = {k.partition(".")[2]: v for k, v in variant.overrides.settings.items() if k.startswith("feddistill.")}
        if variant.name == "default":
            assert not weights
            continue
        ((weight, value),) = weights.items()
        assert value in PAPER_RANGES[weight] and value != DEFAULTS[weight], variant.name
        moved.add(weight)
    assert moved == set(PAPER_RANGES)


def test_the_weight_searchs_default_and_fedavg_are_the_grids_runs_cut_to_its_rounds() -> None:
    grid, search = _commands("kd_methods"), _commands("feddistill_weights")
    rounds = load_experiment(EXPERIMENTS / "feddistill_weights.toml").scale.rounds
    for seed in (0, 1, 2):
        for method in ("feddistill", "fedavg"):
            key = f"{method}-dirichlet0.1-s{seed}"
            assert search[key] == _with_rounds(grid[key], rounds)


def test_no_searched_weight_beat_feddistills_defaults_as_recorded() -> None:
    experiment = load_experiment(EXPERIMENTS / "feddistill_weights.toml")
    results = json.loads((RESULTS / "feddistill_weights.json").read_text())
    # The recording is of today's defaults: its default cells set no weight, and its commands are today's.
    assert {c["key"]: c["command"] for c in results["cells"]} == _commands("feddistill_weights")
    judged = evaluate_claims(experiment.claims, summary(long_table(results)))
    assert len(judged) == len(experiment.variants) - 1
    assert all(c["met"] for c in judged), [c["check"] for c in judged if not c["met"]]


def test_fedbes_default_server_work_is_the_grids_and_its_two_recordings_agree() -> None:
    grid = load_experiment(EXPERIMENTS / "kd_methods.toml")
    assert grid.overrides.settings["fedbe.unlabeled_samples"] == FedBEConfig.__dataclass_fields__["unlabeled_samples"].default
    grid_commands, ablation = _commands("kd_methods"), _commands("fedbe_unlabeled")
    recorded = {name: {c["key"]: c for c in json.loads((RESULTS / f"{name}.json").read_text())["cells"]}
                for name in ("kd_methods", "fedbe_unlabeled")}
    for partition in ("dirichlet0.1", "dirichlet0.5"):
        for seed in (0, 1, 2):
            key = f"fedbe-{partition}-s{seed}"
            assert ablation[key] == grid_commands[key]
            # The same command run twice, once for each experiment: the same accuracy.
            assert recorded["fedbe_unlabeled"][key]["run"]["final_accuracy"] == pytest.approx(
                recorded["kd_methods"][key]["run"]["final_accuracy"])

"""bench/kd_pilots.py: a pilot's changes are parsed into the scale's and the local training's
keys, and anything else is refused with the keys it takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kd_pilots  # noqa: E402


def test_a_pilot_is_a_name_and_its_changes() -> None:
    assert kd_pilots.parse_pilot("base:") == ("base", {})
    assert kd_pilots.parse_pilot("n20k-e5:train_samples=20000,local_epochs=5") == ("n20k-e5", {"train_samples": 20000.0, "local_epochs": 5.0})
    assert kd_pilots.parse_pilot("lr:lr=0.01") == ("lr", {"lr": 0.01})


@pytest.mark.parametrize("text", [":lr=0.1", "x:momentum=0.5", "x:lr"])
def test_a_malformed_pilot_is_refused_naming_the_keys(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        kd_pilots.parse_pilot(text)


def test_a_pilot_may_name_a_registered_model_and_nothing_else() -> None:
    assert kd_pilots.parse_pilot("cnn:model=simplecnn,local_epochs=10") == ("cnn", {"model": "simplecnn", "local_epochs": 10.0})
    with pytest.raises(argparse.ArgumentTypeError, match="not registered"):
        kd_pilots.parse_pilot("x:model=lenet")
    with pytest.raises(argparse.ArgumentTypeError, match="needs a number"):
        kd_pilots.parse_pilot("x:lr=fast")
    assert kd_pilots.parse_pilot("t:method=fedgkd-vote") == ("t", {"method": "fedgkd-vote"})
    with pytest.raises(argparse.ArgumentTypeError, match="not a run of the bench"):
        kd_pilots.parse_pilot("x:method=fedprox")


def test_a_pilot_is_the_benchs_fedavg_run_with_its_changes_or_the_same_model_centralized() -> None:
    scale, run, local = kd_pilots.pilot_run({"model": "simplecnn", "local_epochs": 10.0, "lr": 0.01}, "dir0.1", "federated")
    full = kd_pilots.kd_methods.SCALES["full"]
    assert scale.local_epochs == 10 and scale.agents == full.agents and scale.rounds == full.rounds
    assert run.method == "fedavg" and run.server == {"client_fraction": full.client_fraction}
    assert run.method_config["model"] == "simplecnn" and run.method_config["lr"] == 0.01 and run.method_config["local_epochs"] == 10
    assert local["lr"] == 0.01 and local["momentum"] == kd_pilots.kd_methods.LOCAL["momentum"]
    scale, run, _ = kd_pilots.pilot_run({"model": "convnet", "rounds": 3.0}, "iid", "centralized")
    assert run.method == "centralized" and run.rounds == 3 and scale.rounds == 3
    # One epoch a round, the shared optimiser, the bench's batch.
    assert run.method_config == {"model": "convnet", "epochs_per_round": 1, "augment": False, "optimizer": "sgd",
                                 "lr": kd_pilots.kd_methods.LOCAL["lr"], "momentum": 0.9, "weight_decay": 1e-5,
                                 "batch_size": kd_pilots.kd_methods.BATCH}
    with pytest.raises(ValueError, match="kind"):
        kd_pilots.pilot_run({}, "iid", "split")
    # Any run of the bench: FedKD's model is its mentee, its lr both models'.
    _, run, _ = kd_pilots.pilot_run({"method": "fedkd", "model": "convnet", "lr": 0.02}, "dir0.5", "federated")
    assert run.method == "fedkd" and run.name == "fedkd-dir0.5"
    assert (run.method_config["mentee_model"], run.method_config["mentor_lr"], run.method_config["mentee_lr"]) == ("convnet", 0.02, 0.02)
    _, run, _ = kd_pilots.pilot_run({"method": "fedgkd-vote"}, "dir0.1", "federated")
    assert run.method == "fedgkd" and run.method_config["variant"] == "vote"
    with pytest.raises(ValueError, match="centralized pilot"):
        kd_pilots.pilot_run({"method": "fedbe"}, "iid", "centralized")


@pytest.mark.slow
@pytest.mark.broker
def test_quick_pilots_record_a_federated_and_a_centralized_row(tmp_path: Path) -> None:
    """The pipeline end to end at the quick scale (synthetic data, 4 agents, 2 rounds): each
    pilot a row of the JSON with its kind, model, accuracy per round and wall / CPU time."""
    import json

    out = tmp_path / "pilots.json"
    common = ["--quick", "--out", str(out), "--run-dir", str(tmp_path / "runs")]
    assert kd_pilots.main([*common, "cnn:model=simplecnn,local_epochs=1"]) == 0
    assert kd_pilots.main([*common, "--centralized", "cnn:model=simplecnn"]) == 0
    assert kd_pilots.main([*common, "cnn:model=simplecnn,local_epochs=2"]) == 0  # replaces the first row
    rows = json.loads(out.read_text())["pilots"]
    assert [(r["name"], r["kind"]) for r in rows] == [("cnn", "centralized"), ("cnn", "federated")]
    for row in rows:
        assert row["status"] == "finished" and row["model"] == "simplecnn" and row["scale"]["dataset"] == "synthetic"
        assert [r for r, _ in row["accuracy_by_round"]] == [1, 2] and all(0.0 <= a <= 1.0 for _, a in row["accuracy_by_round"])
        assert row["wall_s"] > 0 and row["cpu_s"] > 0
    central, federated = rows
    assert central["method"] == "centralized" and central["partition"] is None and central["wire_total_bytes"] == 0
    assert federated["method"] == federated["run"] == "fedavg" and federated["partition"] == "dir0.1" and federated["scale"]["local_epochs"] == 2
    assert federated["wire_total_bytes"] > 0 and federated["edge_train_flops"] > 0

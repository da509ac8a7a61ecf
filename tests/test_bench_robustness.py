"""bench/robustness.py: the attacks' hooks against hand computations, the grid it
runs, what it summarises of a run's rounds, the quick mode end to end over a real broker, and
what bench/render_results.py makes of the JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from test_bench_baselines import load

from shared_protocol.methods.fedavg import FedAvgUpdate


def _update(weights: dict[str, np.ndarray], version: int = 3) -> FedAvgUpdate:
    return FedAvgUpdate(run="r", sender="agent-4", instance="i", round=4, model_version=version, num_samples=10, weights=weights, int_buffers={})


def test_sign_flip_sends_the_update_negated_and_scaled_from_the_global_the_agent_holds() -> None:
    rb = load("robustness")
    base = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32)}
    trained = {"w": np.array([1.5, -2.0, 0.0], dtype=np.float32)}  # update (0.5, 0, -0.5)
    agent = SimpleNamespace(method=SimpleNamespace(global_state=base, global_version=3),
                            config=SimpleNamespace(agent_id="agent-4"))
    sent = rb.ATTACKS["sign_flip"].corrupt(agent, _update(trained))
    s = rb.SIGN_FLIP_SCALE
    np.testing.assert_allclose(sent.weights["w"], [1.0 - s * 0.5, -2.0, 0.5 + s * 0.5])
    assert sent.weights["w"].dtype == np.float32
    # Mean of four honest updates u and the flipped one: (4u - s u) / 5, zero at s = 4.
    assert s == 4.0
    # A global version the agent does not hold: no silent garbage, an error.
    with pytest.raises(RuntimeError, match="global version 7"):
        rb.ATTACKS["sign_flip"].corrupt(agent, _update(trained, version=7))
    x1e3 = rb.ATTACKS["weights_x1e3"].corrupt(agent, _update(trained))
    np.testing.assert_allclose(x1e3.weights["w"], trained["w"] * 1e3)


def test_sign_flip_weights_flips_the_trainable_parameters_and_sends_batchnorm_statistics_as_trained() -> None:
    import torch

    rb = load("robustness")
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))  # names 0.weight ... 1.running_var
    rng = np.random.default_rng(0)
    base = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model.state_dict().items() if v.dtype.is_floating_point}
    base["1.running_var"] = np.array([0.5, 2.0], dtype=np.float32)
    delta = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    delta["1.running_var"] = np.array([0.25, -1.0], dtype=np.float32)  # trained: 0.75, 1.0 (positive)
    trained = {k: base[k] + delta[k] for k in base}
    msg = dataclasses.replace(_update(trained), int_buffers={"1.num_batches_tracked": 7})
    agent = SimpleNamespace(method=SimpleNamespace(global_state=base, global_version=3, model=model),
                            config=SimpleNamespace(agent_id="agent-4"))
    sent = rb.ATTACKS["sign_flip_weights"].corrupt(agent, msg)
    s = rb.SIGN_FLIP_SCALE
    parameters = {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert parameters == {n for n, _ in model.named_parameters()} and set(sent.weights) == set(trained)
    for k in parameters:  # by hand: global - 4 (w - global) = base - 4 delta
        np.testing.assert_allclose(sent.weights[k], base[k] - s * delta[k], rtol=1e-6, atol=1e-6, err_msg=k)
        assert sent.weights[k].dtype == np.float32
    for k in ("1.running_mean", "1.running_var"):  # as the agent trained them, bit for bit
        np.testing.assert_array_equal(sent.weights[k], trained[k], err_msg=k)
    assert sent.int_buffers == {"1.num_batches_tracked": 7}
    # The plain sign_flip flips the statistics too: a running variance goes negative (0.5 - 4 x 0.25 = -0.5).
    plain = rb.ATTACKS["sign_flip"].corrupt(agent, msg)
    np.testing.assert_allclose(plain.weights["1.running_var"], [-0.5, 6.0])
    for k in parameters:
        np.testing.assert_array_equal(plain.weights[k], sent.weights[k])
    # No held global, or no model to name the parameters by: an error, not a silent guess.
    with pytest.raises(RuntimeError, match="sign_flip_weights: agent-4 does not hold global version 7"):
        rb.ATTACKS["sign_flip_weights"].corrupt(agent, dataclasses.replace(msg, model_version=7))
    modelless = SimpleNamespace(method=SimpleNamespace(global_state=base, global_version=3), config=agent.config)
    with pytest.raises(RuntimeError, match="no model to name its parameters"):
        rb.ATTACKS["sign_flip_weights"].corrupt(modelless, msg)
    other = rb.ATTACKS["sign_flip_weights"].corrupt(agent, "not an update")  # type: ignore[arg-type]
    assert other == "not an update"


def test_random_labels_permute_the_bad_agents_own_training_labels_only(tmp_path: Path) -> None:
    rb = load("robustness")
    from edge_agent.agent import load_agent_data
    from edge_agent.config import DataConfig, EdgeConfig

    data = DataConfig(dataset="synthetic", partition="iid", num_agents=5, agent_index=4, seed=0, train_samples=200,
                      test_samples=50)
    config = EdgeConfig(agent_id="agent-4", run_id="r", broker_url="mqtt://127.0.0.1:1883", data=data)
    honest_train, honest_test = load_agent_data(config)
    train, test = rb.shuffled_labels(config)
    assert rb.ATTACKS["random_labels"].shuffle_labels and rb.ATTACKS["random_labels"].corrupt is None
    np.testing.assert_array_equal(train.images, honest_train.images)
    np.testing.assert_array_equal(train.sample_ids, honest_train.sample_ids)
    np.testing.assert_array_equal(np.sort(train.labels), np.sort(honest_train.labels))  # the same labels, permuted
    assert np.mean(train.labels != honest_train.labels) > 0.5
    np.testing.assert_array_equal(test.labels, honest_test.labels)  # it is scored on its real test shard


def test_the_grid_covers_every_method_attack_and_rule_of_the_issue() -> None:
    rb = load("robustness")
    grid = rb.cases(False)
    names = [c.name for c in grid]
    assert len(names) == len(set(names))
    have = {(c.method, c.attack, c.checks, c.aggregation) for c in grid}
    for method, attack in (("fedavg", "weights_x1e3"), ("fedavg", "sign_flip"), ("fedavg", "random_labels"),
                           ("fedkd", "factors_1e10"), ("fedgkt", "maps_6e4"), ("fedgkt", "logits_1e30")):
        # Every attack with the defences on and off, next to the method's clean run.
        assert {(method, attack, True, "mean"), (method, attack, False, "mean"), (method, "none", True, "mean")} <= have
    # The rest of the FedAvg family through the same aggregation; random labels for the KD methods too.
    assert {("fedgkd", "none", True, "mean"), ("fedgkd", "weights_x1e3", True, "mean"), ("fedgkd", "weights_x1e3", False, "mean"),
            ("fedgkd", "sign_flip", True, "mean"), ("fedkd", "random_labels", True, "mean"),
            ("fedgkt", "random_labels", True, "mean")} <= have
    # The weights-only flip (BatchNorm statistics honest): the defaults, the median, the direction check.
    assert {("fedavg", "sign_flip_weights", True, "mean", None), ("fedavg", "sign_flip_weights", True, "median", None),
            ("fedavg", "sign_flip_weights", True, "mean", 0.0)} <= {(c.method, c.attack, c.checks, c.aggregation, c.min_cosine)
                                                                    for c in grid}
    for rule in rb.RULES:
        assert ("fedavg", "none", True, rule) in have  # each rule's cost on clean data
        assert ("fedavg", "sign_flip", True, rule) in have and ("fedavg", "random_labels", True, rule) in have
    quick = rb.cases(True)
    assert {c.method for c in quick} == {"fedavg"} and {c.attack for c in quick} == {"none", "weights_x1e3", "sign_flip", "random_labels"}


def _round(n: int, acc: float, completed: list[str], refused: dict[str, Any] | None = None,
           excluded: list[str] | None = None, quarantined: list[str] | None = None) -> dict[str, Any]:
    return {"round": n, "status": "ok", "accuracy": acc, "completed": completed, "excluded": excluded or [],
            "refused": refused or {}, "quarantine_excluded": quarantined or [], "skipped_steps": {}, "clipped": {},
            "aggregation_used": None, "warnings": []}


def test_summarise_counts_refusals_and_the_rounds_the_bad_agent_was_not_used() -> None:
    rb = load("robustness")
    everyone = [f"agent-{i}" for i in range(5)]
    rounds = [_round(1, 0.3, everyone, {"agent-4": {"implausible_norm": 1}}, ["agent-4"]),
              _round(2, 0.4, everyone, {"agent-4": {"implausible_norm": 1}, "agent-1": {"implausible_norm": 1}},
                     ["agent-1", "agent-4"]),
              _round(3, 0.5, everyone, quarantined=["agent-4"]),
              _round(4, 0.6, everyone)]
    s = rb.summarise(rounds)
    assert s["refusals"] == {"agent-4": {"implausible_norm": 2}, "agent-1": {"implausible_norm": 1}}
    assert s["bad_agent_unused_rounds"] == [1, 2, 3] and s["rounds_ok"] == 4 and s["honest_completed_every_round"]
    rounds[3]["completed"] = ["agent-0", "agent-4"]
    assert not rb.summarise(rounds)["honest_completed_every_round"]
    assert not rb.summarise([])["honest_completed_every_round"]


def _run(method: str, attack: str, checks: bool, rule: str, accs: list[float], refusals: dict[str, Any] | None = None,
         unused: list[int] | None = None, largest: float = 3.5, min_cosine: float | None = None) -> dict[str, Any]:
    return {"method": method, "attack": attack, "checks": checks, "aggregation": rule, "min_cosine": min_cosine, "status": "finished",
            "rounds": [{"round": i + 1, "accuracy": a} for i, a in enumerate(accs)], "final_accuracy": accs[-1],
            "largest_weight": largest, "rounds_ok": len(accs), "refusals": refusals or {},
            "bad_agent_unused_rounds": unused or [], "honest_completed_every_round": True}


def test_the_page_renders_the_robustness_table_from_the_json() -> None:
    rb, render = load("robustness"), load("render_results")
    runs = [
        _run("fedavg", "none", True, "mean", [0.5, 0.7]),
        _run("fedavg", "weights_x1e3", True, "mean", [0.52, 0.69], {"agent-4": {"implausible_norm": 2}}, [1, 2]),
        _run("fedavg", "weights_x1e3", False, "mean", [0.1, 0.1], largest=1.7e14),
        _run("fedavg", "sign_flip", True, "mean", [0.1, 0.12]),
        _run("fedavg", "sign_flip", True, "mean", [0.5, 0.69], {"agent-4": {"implausible_direction": 2}}, [1, 2], min_cosine=0.0),
        _run("fedavg", "none", True, "median", [0.5, 0.66]),
        _run("fedavg", "sign_flip", True, "median", [0.5, 0.65]),
        _run("fedavg", "random_labels", True, "median", [0.5, 0.418]),  # 0.418 - 0.468 is -5 points, not below
        _run("fedavg", "none", True, "trimmed_mean", [0.5, 0.468]),
        _run("fedavg", "random_labels", True, "trimmed_mean", [0.5, 0.4179]),
        _run("fedgkt", "logits_1e30", True, "mean", [0.4, 0.6], {"agent-4": {"out_of_range": 2}}, [1, 2]),
    ]
    doc = {"benchmark": "robustness", "generated_by": "bench/robustness.py (test)",
           "machine": {"cpu_model": "cpu", "cores": 2, "torch": "2", "date_utc": "2026-01-01T00:00:00Z",
                       "load_average_at_start": [1.0, 1.0, 1.0]},
           "agents": 5, "bad_agent": "agent-4", "rounds": 2, "train_samples": 3000, "test_samples": 500,
           "dataset": "fashion-mnist", "partition": "iid", "seed": 0, "sign_flip_scale": 4.0, "label_seed": 12345,
           "method_config": rb.TABLES, "attacks": {k: a.what for k, a in rb.ATTACKS.items()},
           "eval_set": {"dataset": "fashion-mnist", "split": "test", "samples": 500, "seed": 0, "ids_sha256": "ab" * 32,
                        "class_counts": [50] * 10},
           "complete": False, "missing": ["fedgkt-none-mean-checks"], "runs": runs}
    text = "\n".join(render.robustness_section(doc))
    assert "## Robustness: one bad device of five (issue 25)" in text
    assert "Fashion-MNIST, iid, 5 agents with 600 training images each (3,000 in all), 2 rounds, seed 0" in text
    assert "500 balanced Fashion-MNIST test images" in text
    assert "**Incomplete:** 1 run(s) of the grid are not in this JSON yet: `fedgkt-none-mean-checks`." in text
    lines = text.splitlines()

    def row(*cells: str) -> str:
        prefix = "| " + " | ".join(cells) + " |"
        return next(l for l in lines if l.startswith(prefix))

    refused = row("FedAvg", "weights x 1e3", "mean", "on")
    assert "| 69.00% | -1.0 | yes | 52.0 / 69.0 | 2/2 | agent-4: implausible_norm ×2 | 1, 2 | 3.5 |" in refused
    assert "| 10.00% | -60.0 | **no** |" in row("FedAvg", "weights x 1e3", "mean", "off") and "1.7e+14" in row("FedAvg", "weights x 1e3", "mean", "off")
    assert "| -58.0 | **no** |" in row("FedAvg", "update negated and scaled x4", "mean", "on")
    # The direction check turned on: its own row, against the default clean run (none with the check made).
    assert "| 69.00% | -1.0 | yes | 50.0 / 69.0 | 2/2 | agent-4: implausible_direction ×2 | 1, 2 |" in row(
        "FedAvg", "update negated and scaled x4", "mean", "on, cosine ≥ 0")
    assert "| 65.00% | -1.0 | yes |" in row("FedAvg", "update negated and scaled x4", "median", "on")  # against the median's clean run
    assert "| 60.00% | — | — |" in row("FedGKT (server model)", "logits 1e30", "mean", "on")  # no clean run recorded
    # Exactly 5 points below is within 5 points (0.418 - 0.468 is -0.05000000000000004 in floats); more is not.
    clean_median = next(r for r in runs if r["attack"] == "none" and r["aggregation"] == "median")
    clean_median.update(final_accuracy=0.468, rounds=[{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.468}])
    text = "\n".join(render.robustness_section(doc))
    lines = text.splitlines()
    assert "| 41.80% | -5.0 | yes |" in row("FedAvg", "trains on shuffled labels", "median", "on")
    assert "| 41.79% | -5.0 | **no** |" in row("FedAvg", "trains on shuffled labels", "trimmed_mean", "on")
    # The defences' verdict names the attacked runs that got through; runs with them off are not counted.
    assert ("With the defences on, 4 attacked run(s) finished every round with the honest agents within 5 points of their "
            "clean run; **2 did not**: FedAvg, update negated and scaled x4, mean; FedAvg, trains on shuffled labels, "
            "trimmed_mean.") in text
    # The clean-data cost of each rule next to the mean's.
    assert "| mean | 70.00% | — | 50.0 / 70.0 | none |" in text
    assert "| median | 46.80% | -23.2 | 50.0 / 46.8 | none |" in text


@pytest.mark.slow
@pytest.mark.broker
def test_quick_mode_runs_the_fedavg_attacks_end_to_end_and_resumes(tmp_path: Path) -> None:
    rb = load("robustness")
    out = tmp_path / "robustness.json"
    rb.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "robustness" and data["complete"] and data["missing"] == []
    runs = {r["attack"]: r for r in data["runs"]}
    assert set(runs) == {"none", "weights_x1e3", "sign_flip", "random_labels"}
    for r in runs.values():
        assert r["status"] == "finished" and r["rounds_ok"] == data["rounds"] and r["honest_completed_every_round"]
        assert r["eval_set"] == data["eval_set"]
    # x1e3 is refused at the door in every round; the checkpoint stays the size of the clean run's.
    assert runs["weights_x1e3"]["refusals"] == {"agent-4": {"implausible_norm": data["rounds"]}}
    assert runs["weights_x1e3"]["bad_agent_unused_rounds"] == list(range(1, data["rounds"] + 1))
    assert runs["weights_x1e3"]["largest_weight"] < 100 * runs["none"]["largest_weight"]
    # --resume with everything recorded runs nothing and keeps the runs.
    before = out.read_text()
    rb.main(["--quick", "--resume", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == json.loads(before)["runs"]

"""One bad device must not spoil the model (cloud_server/robust.py), over a real mosquitto.

Per method family (FedAvg, FedKD, FedGKT): three agents on Fashion-MNIST, one of which
sends finite garbage -- well-formed frames, only the numbers are bad: its upload tensors are
overwritten just before encoding, by a test-only hook on that agent's ``send``. The run must
finish every round with the honest agents; the global (FedAvg, FedKD's mentee) or server
(FedGKT) model must stay within 5 points of the same run without the bad agent (same seeds);
the checkpoint must hold no weight above 100x the clean run's largest; report.json must name
the agent, the reason and the rounds.

Besides the garbage, two attacks of plausible size, each its own test: a sign-flipped update
(``global - 4 (w - global)``, bench/robustness.py's; FedAvg and FedKD, refused by the direction
check, which is off by default and turned on here as a fleet close to IID may; and FedAvg under
Dirichlet(0.1), where the direction check cannot tell it from honest agents, refused by the
server's validation set, also off by default), and an agent that trains on shuffled labels (a
test-only hook on its data; FedAvg and FedKD: nothing refuses it and nothing needs to; FedGKT,
whose server trains on the agents' labels: refused by the label-agreement check, off by default,
and what happens without it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_server.report import validate_report
from edge_agent.agent import EdgeAgent, load_agent_data
from edge_agent.config import DataConfig, EdgeConfig
from shared_protocol.messages import Message
from shared_protocol.methods.fedavg import FedAvgUpdate
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.fedkd import FedKdUpdate, factor_state, unfactor_state

from fedhelpers import FAST_GKT, method_server_config, mqtt_federation

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROUNDS = 3
BAD = "agent-2"
SIGN_FLIP_SCALE = 4.0  # as bench/robustness.py: the mean of the three is about 0 (2u - 4u) / 3
LABEL_SEED = 12345
Corrupt = Callable[[EdgeAgent, Message], Message]


def _sign_flip(agent: EdgeAgent, msg: Message) -> Message:
    """The agent's honest update negated and scaled, from the global model it trained from."""
    if not isinstance(msg, FedAvgUpdate):
        return msg
    base = agent.method.global_state  # type: ignore[attr-defined]
    assert agent.method.global_version == msg.model_version  # type: ignore[attr-defined]
    return dataclasses.replace(msg, weights={
        k: (base[k] - SIGN_FLIP_SCALE * (v.astype(np.float64) - base[k])).astype(v.dtype) for k, v in msg.weights.items()})


def _fedkd_sign_flip(agent: EdgeAgent, msg: Message) -> Message:
    """FedKD's update rebuilt, negated and scaled, and factored again with the round's threshold
    (well-formed factors: U and V stay orthonormal, only the update points the other way)."""
    if not isinstance(msg, FedKdUpdate):
        return msg
    assert msg.payload == "update"
    rebuilt = unfactor_state(msg.TYPE, msg.layout, msg.factors)
    flipped = {name: (-SIGN_FLIP_SCALE * t.reconstruct()).astype(np.float32) for name, t in rebuilt.items()}
    layout, factors, _ = factor_state(flipped, msg.threshold)
    return dataclasses.replace(msg, layout=layout, factors=factors)


def _weights_x1000(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, FedAvgUpdate):
        return dataclasses.replace(msg, weights={k: (v * 1000).astype(v.dtype) for k, v in msg.weights.items()})
    return msg


def _factors_1e10(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, FedKdUpdate):
        return dataclasses.replace(msg, factors=np.full_like(msg.factors, 1e10))
    return msg


def _maps_6e4(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, GktFeatures) and msg.split == "train":
        return dataclasses.replace(msg, features=np.full_like(msg.features, 6e4))  # fp16's range
    return msg


def _logits_1e30(agent: EdgeAgent, msg: Message) -> Message:
    if isinstance(msg, GktFeatures) and msg.split == "train":
        return dataclasses.replace(msg, logits=np.full_like(msg.logits, 1e30))
    return msg


TRAIN_SAMPLES = 900  # each run's seeded subset of Fashion-MNIST, partitioned among the three agents


def _agent(run_id: str, index: int, partition: str = "iid") -> EdgeConfig:
    data = DataConfig(dataset="fashion-mnist", partition=partition, num_agents=3, agent_index=index, seed=0,
                      train_samples=TRAIN_SAMPLES, test_samples=150)
    return EdgeConfig(agent_id=f"agent-{index}", run_id=run_id, data=data, progress=False)


def _run(tmp: Path, broker_url: str, method: str, table: dict[str, Any], corrupt: Corrupt | None,
         agents: tuple[int, ...] = (0, 1, 2), shuffle_labels: bool = False,
         server: dict[str, Any] | None = None, partition: str = "iid") -> tuple[dict[str, Any], float]:
    """(report.json, the checkpoint's largest |weight|) of a 3-round run of ``agents``;
    ``corrupt`` overwrites agent-2's uploads; ``shuffle_labels``: agent-2 trains on its
    shard with the labels permuted (seeded); ``server``: more [server] keys; ``partition``:
    the agents' shares of the 900 images."""
    run_id = f"rb-{method}-{tmp.name}"[:60]
    cfg = method_server_config(tmp, method, table, run_id=run_id, agents=len(agents), rounds=ROUNDS, min_agents=1,
                               dataset="fashion-mnist", eval_samples=400, **(server or {}))
    fed = mqtt_federation(cfg, [_agent(run_id, i, partition) for i in agents], broker_url)
    if shuffle_labels:
        k = next(i for i, a in enumerate(fed.agents) if a.config.agent_id == BAD)
        config = fed.agents[k].config
        train, test = load_agent_data(config)
        train = dataclasses.replace(train, labels=np.random.default_rng(LABEL_SEED).permutation(train.labels))
        fed.agents[k] = EdgeAgent(config, data=(train, test))
    if corrupt is not None:
        bad = next(a for a in fed.agents if a.config.agent_id == BAD)
        honest_send = bad.send  # the hook: the method's context captures agent.send when it is welcomed

        def send(msg: Message, *args: Any, **kwargs: Any) -> Any:
            return honest_send(corrupt(bad, msg), *args, **kwargs)

        bad.send = send  # type: ignore[method-assign]
    fed.start().join(timeout_s=900)
    report = json.loads((tmp / "run" / "report.json").read_text())
    validate_report(report)
    with np.load(tmp / "run" / "checkpoint" / "method.npz", allow_pickle=False) as npz:
        largest = max(float(np.max(np.abs(npz[k]))) for k in npz.files if npz[k].dtype.kind == "f" and npz[k].size)
    return report, largest


def _accuracy(report: dict[str, Any], label: str) -> float:
    return report["rounds"][-1]["evaluation"]["accuracy"][label]


# Reasons found when the round closes, among the round's uploads (not messages refused at the door).
JUDGED_AT_THE_CLOSE = ("implausible_norm", "implausible_direction", "implausible_validation", "implausible_labels")


def _check(clean: tuple[dict, float], attacked: tuple[dict, float], label: str, reason: str) -> None:
    (clean_report, clean_largest), (report, largest) = clean, attacked
    assert report["status"] == "finished" and clean_report["status"] == "finished"
    assert [r["status"] for r in report["rounds"]] == ["ok"] * ROUNDS
    for r in report["rounds"]:
        assert set(r["completed"]) == {"agent-0", "agent-1"}, r["round"]  # the honest agents, every round
        assert r["warnings"], r["round"]  # ok, with a warning
        robustness = r["robustness"]
        refused = robustness.get("refused", {})
        assert set(refused) <= {BAD}
        assert BAD in refused or BAD in robustness.get("quarantine_excluded", []), r["round"]
    named = {why for r in report["rounds"] for why in r["robustness"].get("refused", {}).get(BAD, {})}
    assert reason in named, named
    if reason not in JUDGED_AT_THE_CLOSE:  # refused at the door: counted with the run's rejected messages too
        assert report["totals"]["rejected_by_reason"][reason] >= 1
    clean_acc, acc = _accuracy(clean_report, label), _accuracy(report, label)
    assert acc >= clean_acc - 0.05, (acc, clean_acc)
    assert largest <= 100 * clean_largest, (largest, clean_largest)


def test_fedavg_one_agent_sending_weights_x1000(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = {"model": "resnet8", "batch_size": 32}
    clean = _run(tmp_path / "clean", mosquitto.url, "fedavg", table, None, agents=(0, 1))
    attacked = _run(tmp_path / "bad", mosquitto.url, "fedavg", table, _weights_x1000)
    _check(clean, attacked, "model", "implausible_norm")


def test_fedkd_one_agent_sending_factors_1e10(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}
    clean = _run(tmp_path / "clean", mosquitto.url, "fedkd", table, None, agents=(0, 1))
    attacked = _run(tmp_path / "bad", mosquitto.url, "fedkd", table, _factors_1e10)
    _check(clean, attacked, "mentee", "implausible_factors")


def test_fedgkt_one_agent_sending_maps_6e4_or_logits_1e30(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = dict(FAST_GKT)
    clean = _run(tmp_path / "clean", mosquitto.url, "fedgkt", table, None, agents=(0, 1))
    for name, corrupt in (("maps", _maps_6e4), ("logits", _logits_1e30)):
        attacked = _run(tmp_path / name, mosquitto.url, "fedgkt", table, corrupt)
        _check(clean, attacked, "model", "out_of_range")
        detail = attacked[0]["rounds"][0]["robustness"]["refused"][BAD]["out_of_range"]["detail"]
        assert ("feature maps reach" if name == "maps" else "edge logits reach") in detail


# The direction check is off by default (honest agents under label skew point away from the
# round's median: bench/results/update_directions.json); a fleet whose data is close to IID
# turns it on, as here.
DIRECTION = {"plausible_min_cosine": 0.0}


def test_fedavg_one_agent_sending_its_update_sign_flipped(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = {"model": "resnet8", "batch_size": 32}
    clean = _run(tmp_path / "clean", mosquitto.url, "fedavg", table, None, agents=(0, 1), server=DIRECTION)
    attacked = _run(tmp_path / "bad", mosquitto.url, "fedavg", table, _sign_flip, server=DIRECTION)
    _check(clean, attacked, "model", "implausible_direction")
    detail = attacked[0]["rounds"][0]["robustness"]["refused"][BAD]["implausible_direction"]["detail"]
    assert "< plausible_min_cosine 0" in detail
    for r in attacked[0]["rounds"]:  # the flipped agent points away; the honest ones along the median
        cosines = r["robustness"]["update_directions"]["agents"]
        assert cosines[BAD] < 0 < min(cosines["agent-0"], cosines["agent-1"]), r["round"]


def test_fedkd_one_agent_sending_its_update_sign_flipped(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    table = {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}
    clean = _run(tmp_path / "clean", mosquitto.url, "fedkd", table, None, agents=(0, 1), server=DIRECTION)
    attacked = _run(tmp_path / "bad", mosquitto.url, "fedkd", table, _fedkd_sign_flip, server=DIRECTION)
    _check(clean, attacked, "mentee", "implausible_direction")



FAMILIES = {  # method -> (its table, the model the test scores)
    "fedavg": ({"model": "resnet8", "batch_size": 32}, "model"),
    "fedkd": ({"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}, "mentee"),
    "fedgkt": (dict(FAST_GKT), "model"),
}


def _no_refusal_with_every_agent(report: dict[str, Any], method: str) -> None:
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok"] * ROUNDS
    for r in report["rounds"]:
        assert set(r["completed"]) == {"agent-0", "agent-1", BAD}, r["round"]
        robustness = r.get("robustness", {})  # FedGKT's: only when something happened
        assert not robustness.get("refused"), r["round"]
        if method != "fedgkt":
            assert BAD in robustness["update_norms"]["agents"]
            assert robustness["update_directions"]["agents"][BAD] > 0, r["round"]  # even a check at 0 passes it


@pytest.mark.parametrize("method", ["fedavg", "fedkd"])
def test_one_agent_training_on_shuffled_labels(method: str, mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Shuffled labels make uploads of honest size and, in weight-sharing methods, of honest
    direction (the agent's cosine with the round's median stays above 0, 0.8 and more here): no check can
    tell them from an honest agent's, and none is refused. What must hold is the rest: every
    round ok with every agent, within 5 points of the run without it, no weight blown up; the
    report records the agent's figures every round (its update's norm and cosine), the numbers a
    user would look at."""
    table, label = FAMILIES[method]
    clean_report, clean_largest = _run(tmp_path / "clean", mosquitto.url, method, table, None, agents=(0, 1))
    report, largest = _run(tmp_path / "bad", mosquitto.url, method, table, None, shuffle_labels=True)
    _no_refusal_with_every_agent(report, method)
    assert _accuracy(report, label) >= _accuracy(clean_report, label) - 0.05, (_accuracy(report, label), _accuracy(clean_report, label))
    assert largest <= 100 * clean_largest, (largest, clean_largest)


# FedGKT's label-agreement check (cloud_server/methods/fedgkt_label_check.py), off by default: see
# LABEL_CHECK's value and docs/configuration.md for the measurement behind it.
LABEL_CHECK = {"plausible_min_label_agreement": 0.3}
# The check adds a forward pass of the server model over the round's maps to the server step: on a
# loaded 2-core machine round 3's evaluation reports came after the helper's 120 s round deadline
# (evaluated without them, no accuracy). The deadline bounds waiting only: no figure depends on it.
GKT_DEADLINE = {"round_deadline_s": 600.0}


def test_fedgkt_one_agent_training_on_shuffled_labels_with_and_without_the_label_check(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """FedGKT's server trains on the labels the agents send. Without the label check nothing
    refuses an agent on shuffled labels (its maps and logits are in range) and its maps are
    trained on every round: it cost the server model 16 points here (37.5% against 53.5% without
    the agent, round 3), which this test prints but does not pin. With the check, from round 2 on
    the server model agrees with the agent's labels far less than with the others' and the agent
    is refused (implausible_labels) and named in report.json with the figure; the server model
    ends within 5 points of the run without the agent. Quarantined after its first refusal
    (quarantine_after 1), it is still judged in round 3 and refused again, not released (a
    quarantined agent's maps used to go unjudged: released the round after)."""
    table, label = FAMILIES["fedgkt"]
    clean = _run(tmp_path / "clean", mosquitto.url, "fedgkt", table, None, agents=(0, 1), server={**LABEL_CHECK, **GKT_DEADLINE})
    without, _ = _run(tmp_path / "without", mosquitto.url, "fedgkt", table, None, shuffle_labels=True, server=GKT_DEADLINE)
    _no_refusal_with_every_agent(without, "fedgkt")
    for r in without["rounds"]:
        assert BAD not in r.get("excluded", {}) and "label_agreement" not in r.get("robustness", {}), r["round"]
    attacked = _run(tmp_path / "with", mosquitto.url, "fedgkt", table, None, shuffle_labels=True,
                    server={**LABEL_CHECK, **GKT_DEADLINE, "quarantine_after": 1})
    report = attacked[0]
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok"] * ROUNDS
    first, *later = report["rounds"]
    assert "label_agreement" not in first.get("robustness", {}) and BAD not in first.get("excluded", {})  # round 1: not judged
    for r in later:
        robustness = r["robustness"]
        figures = robustness["label_agreement"]["agents"]
        assert figures[BAD]["server"] < min(figures["agent-0"]["server"], figures["agent-1"]["server"]), r["round"]
        assert set(robustness.get("refused", {})) == {BAD} or BAD in robustness.get("quarantine_excluded", []), r["round"]
        assert r["excluded"][BAD].startswith("implausible_labels"), r["round"]
    refused_rounds = [r["round"] for r in later if BAD in r["robustness"].get("refused", {})]
    assert refused_rounds == [2, 3], refused_rounds
    events = [(e["round"], e["agent"], e["event"]) for r in later for e in r["robustness"].get("quarantine_events", [])]
    assert events == [(2, BAD, "quarantined")], events
    assert later[-1]["robustness"]["quarantined"][BAD]["checks"] == ["implausible_labels"]
    detail = later[0]["robustness"]["refused"][BAD]["implausible_labels"]["detail"]
    assert "of its labels, below plausible_min_label_agreement 0.3" in detail
    clean_acc, acc, without_acc = _accuracy(clean[0], label), _accuracy(report, label), _accuracy(without, label)
    print(f"fedgkt server model, round {ROUNDS}: without the agent {clean_acc:.3f}, with it and no check "
          f"{without_acc:.3f}, with the check {acc:.3f}")
    assert acc >= clean_acc - 0.05, (acc, clean_acc, without_acc)
    assert attacked[1] <= 100 * clean[1]


# The server validation set (cloud_server/robust_validation.py), off by default: 500 of the
# Fashion-MNIST training images the agents do not take, as docs/configuration.md describes.
VALIDATION = {"validation_samples": 500, "validation_agent_train_samples": TRAIN_SAMPLES}


def test_fedavg_sign_flip_under_dirichlet_0_1_with_the_validation_set(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Under Dirichlet(0.1) honest agents point away from the round's median as far as a
    sign-flipped one (bench/results/update_directions.json): the direction check cannot tell
    them apart. The server's validation set can: the global model plus the flipped update does
    far worse on it than plus an honest one. The agent is refused every round it is judged
    (implausible_validation, named in report.json with the figure), and the global model ends
    within 5 points of the run without it."""
    table = {"model": "resnet8", "batch_size": 32}
    dirichlet = "dirichlet:0.1"
    clean = _run(tmp_path / "clean", mosquitto.url, "fedavg", table, None, agents=(0, 1), server=VALIDATION, partition=dirichlet)
    for r in clean[0]["rounds"]:
        assert not r.get("robustness", {}).get("refused"), r["round"]  # no honest agent refused
    attacked = _run(tmp_path / "bad", mosquitto.url, "fedavg", table, _sign_flip, server=VALIDATION, partition=dirichlet)
    _check(clean, attacked, "model", "implausible_validation")
    for r in attacked[0]["rounds"]:
        figures = r["robustness"]["update_validation"]
        assert figures["samples"] == 500
        rises = figures["agents"]
        assert rises["agent-0"] is not None and rises["agent-1"] is not None, r["round"]
        # null: not finite. The flip negates BatchNorm's running variances with the weights, and a
        # negative variance makes the model's output NaN: refused as not finite.
        assert rises[BAD] is None or rises[BAD] > max(rises["agent-0"], rises["agent-1"]), r["round"]
    detail = attacked[0]["rounds"][0]["robustness"]["refused"][BAD]["implausible_validation"]["detail"]
    assert "validation_loss_margin" in detail

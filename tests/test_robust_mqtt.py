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
check, which is off by default and turned on here as a fleet close to IID may), and an agent
that trains on shuffled labels (a test-only hook on its data; every family: nothing refuses it,
and FedGKT's server model loses more than 5 points, a known gap marked xfail).
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


def _agent(run_id: str, index: int) -> EdgeConfig:
    data = DataConfig(dataset="fashion-mnist", partition="iid", num_agents=3, agent_index=index, seed=0,
                      train_samples=900, test_samples=150)
    return EdgeConfig(agent_id=f"agent-{index}", run_id=run_id, data=data, progress=False)


def _run(tmp: Path, broker_url: str, method: str, table: dict[str, Any], corrupt: Corrupt | None,
         agents: tuple[int, ...] = (0, 1, 2), shuffle_labels: bool = False,
         server: dict[str, Any] | None = None) -> tuple[dict[str, Any], float]:
    """(report.json, the checkpoint's largest |weight|) of a 3-round run of ``agents``;
    ``corrupt`` overwrites agent-2's uploads; ``shuffle_labels``: agent-2 trains on its
    shard with the labels permuted (seeded); ``server``: more [server] keys."""
    run_id = f"rb-{method}-{tmp.name}"[:60]
    cfg = method_server_config(tmp, method, table, run_id=run_id, agents=len(agents), rounds=ROUNDS, min_agents=1,
                               dataset="fashion-mnist", eval_samples=400, **(server or {}))
    fed = mqtt_federation(cfg, [_agent(run_id, i) for i in agents], broker_url)
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
    if reason not in ("implausible_norm", "implausible_direction"):  # refused at the door: counted with the run's rejected messages too
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


# FedGKT's server model trains on the labels the agents send with their maps: with one agent of
# three on shuffled labels it reached 37.5% against 53.5% without it (round 3; 40.0 / 38.0 at
# round 2), and nothing in the system refuses plausible labels (issue 25: what is left).
GKT_LABELS_GAP = pytest.mark.xfail(reason="FedGKT has no defence against an agent training on shuffled labels: "
                                          "37.5% vs 53.5% without it (one agent of three)", raises=AssertionError, strict=False)


@pytest.mark.parametrize("method", [m if m != "fedgkt" else pytest.param(m, marks=GKT_LABELS_GAP) for m in FAMILIES])
def test_one_agent_training_on_shuffled_labels(method: str, mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Shuffled labels make uploads of honest size and, in weight-sharing methods, of honest
    direction (the agent's cosine with the round's median stays above 0, 0.8 and more here): no check can
    tell them from an honest agent's, and none is refused. What must hold is the rest: every
    round ok with every agent, within 5 points of the run without it, no weight blown up; the
    report records the agent's figures every round (weight-sharing methods: its update's norm
    and cosine), the numbers a user would look at."""
    table, label = FAMILIES[method]
    clean_report, clean_largest = _run(tmp_path / "clean", mosquitto.url, method, table, None, agents=(0, 1))
    report, largest = _run(tmp_path / "bad", mosquitto.url, method, table, None, shuffle_labels=True)
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok"] * ROUNDS
    for r in report["rounds"]:
        assert set(r["completed"]) == {"agent-0", "agent-1", BAD}, r["round"]
        robustness = r.get("robustness", {})  # FedGKT's: only when something happened
        assert not robustness.get("refused"), r["round"]
        if method != "fedgkt":
            assert BAD in robustness["update_norms"]["agents"]
            assert robustness["update_directions"]["agents"][BAD] > 0, r["round"]  # even a check at 0 passes it
    assert _accuracy(report, label) >= _accuracy(clean_report, label) - 0.05, (_accuracy(report, label), _accuracy(clean_report, label))
    assert largest <= 100 * clean_largest, (largest, clean_largest)

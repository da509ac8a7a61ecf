"""One bad device must not spoil the model (cloud_server/robust.py), over a real mosquitto.

Per method family (FedAvg, FedKD, FedGKT): three agents on Fashion-MNIST, one of which
sends finite garbage -- well-formed frames, only the numbers are bad: its upload tensors are
overwritten just before encoding, by a test-only hook on that agent's ``send``. The run must
finish every round with the honest agents; the global (FedAvg, FedKD's mentee) or server
(FedGKT) model must stay within 5 points of the same run without the bad agent (same seeds);
the checkpoint must hold no weight above 100x the clean run's largest; report.json must name
the agent, the reason and the rounds.
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
from edge_agent.config import DataConfig, EdgeConfig
from shared_protocol.messages import Message
from shared_protocol.methods.fedavg import FedAvgUpdate
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.fedkd import FedKdUpdate

from fedhelpers import FAST_GKT, method_server_config, mqtt_federation

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROUNDS = 3
BAD = "agent-2"
Corrupt = Callable[[Message], Message]


def _weights_x1000(msg: Message) -> Message:
    if isinstance(msg, FedAvgUpdate):
        return dataclasses.replace(msg, weights={k: (v * 1000).astype(v.dtype) for k, v in msg.weights.items()})
    return msg


def _factors_1e10(msg: Message) -> Message:
    if isinstance(msg, FedKdUpdate):
        return dataclasses.replace(msg, factors=np.full_like(msg.factors, 1e10))
    return msg


def _maps_6e4(msg: Message) -> Message:
    if isinstance(msg, GktFeatures) and msg.split == "train":
        return dataclasses.replace(msg, features=np.full_like(msg.features, 6e4))  # fp16's range
    return msg


def _logits_1e30(msg: Message) -> Message:
    if isinstance(msg, GktFeatures) and msg.split == "train":
        return dataclasses.replace(msg, logits=np.full_like(msg.logits, 1e30))
    return msg


def _agent(run_id: str, index: int) -> EdgeConfig:
    data = DataConfig(dataset="fashion-mnist", partition="iid", num_agents=3, agent_index=index, seed=0,
                      train_samples=900, test_samples=150)
    return EdgeConfig(agent_id=f"agent-{index}", run_id=run_id, data=data, progress=False)


def _run(tmp: Path, broker_url: str, method: str, table: dict[str, Any], corrupt: Corrupt | None,
         agents: tuple[int, ...] = (0, 1, 2)) -> tuple[dict[str, Any], float]:
    """(report.json, the checkpoint's largest |weight|) of a 3-round run of ``agents``;
    ``corrupt`` overwrites agent-2's uploads."""
    run_id = f"rb-{method}-{tmp.name}"[:60]
    cfg = method_server_config(tmp, method, table, run_id=run_id, agents=len(agents), rounds=ROUNDS, min_agents=1,
                               dataset="fashion-mnist", eval_samples=400)
    fed = mqtt_federation(cfg, [_agent(run_id, i) for i in agents], broker_url)
    if corrupt is not None:
        bad = next(a for a in fed.agents if a.config.agent_id == BAD)
        honest_send = bad.send  # the hook: the method's context captures agent.send when it is welcomed

        def send(msg: Message, *args: Any, **kwargs: Any) -> Any:
            return honest_send(corrupt(msg), *args, **kwargs)

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
    if reason != "implausible_norm":  # refused at the door: counted with the run's rejected messages too
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

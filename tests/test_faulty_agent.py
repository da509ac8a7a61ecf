"""A misbehaving device on purpose ([agent] fault, edge_agent/faults.py; ``edgesplit local
--faulty-agent``): what each fault does to what the agent sends, at the agent's one hook (its
``send``), the config and flag checks, and a small federation in which the faulty agent's sign
flip passes the defaults and is refused by the validation screen, with the report naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from cloud_server.launcher import build_parser, main
from cloud_server.local_run import write_configs
from edge_agent.agent import EdgeAgent
from edge_agent.config import EdgeConfig
from edge_agent.costs import RoundMeter
from edge_agent.faults import AgentFault
from shared_protocol.errors import NonFiniteError
from shared_protocol.faults import FAULT_KINDS, FaultSpec
from shared_protocol.messages import decode_message
from shared_protocol.methods.fedavg import FedAvgUpdate
from shared_protocol.topics import Topics
from shared_protocol.transport import InMemoryBroker, InMemoryTransport
from shared_protocol.tomlio import read_toml

from fedhelpers import agent_config, in_memory_federation, method_server_config

RNG = np.random.default_rng(7)
GLOBAL = {"conv.weight": RNG.normal(size=(4, 3)).astype(np.float32), "bn.running_var": RNG.uniform(0.5, 2, size=4).astype(np.float32)}
TRAINED = {k: (v + RNG.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in GLOBAL.items()}


class _HoldsGlobal:
    """A method as the agent sees it: it holds GLOBAL as version 3."""

    def held_global(self, version: int) -> dict[str, np.ndarray] | None:
        return GLOBAL if version == 3 else None


def _update(version: int = 3) -> FedAvgUpdate:
    return FedAvgUpdate(run="f1", round=1, sender="agent-0", instance="i", num_samples=10, model_version=version,
                        int_buffers={"bn.num_batches_tracked": 5}, weights=dict(TRAINED))


def _sent(fault: str, scale: float | None = None, version: int = 3) -> bytes:
    """The frame agent-0, made faulty, publishes for ``_update(version)`` through its ``send``."""
    broker = InMemoryBroker()
    server = InMemoryTransport(broker, "server")
    server.subscribe(Topics("f1").up("agent-0"))
    server.connect()
    config = dataclasses.replace(agent_config("f1", 0, 2, train_samples=40, test_samples=20), fault=fault, fault_scale=scale)
    agent = EdgeAgent(config, transport=InMemoryTransport(broker, "agent-0"))
    agent.transport.connect()
    agent.method = _HoldsGlobal()  # type: ignore[assignment]
    agent.send(_update(version), RoundMeter())
    delivery = server.receive(timeout_s=5)
    assert delivery is not None
    return delivery.payload


def test_sign_flip_sends_minus_scale_times_the_honest_update() -> None:
    sent = decode_message(_sent("sign_flip", 2.5))
    assert isinstance(sent, FedAvgUpdate)
    for name, base in GLOBAL.items():
        honest = TRAINED[name].astype(np.float64) - base
        np.testing.assert_allclose(sent.weights[name] - base, -2.5 * honest, rtol=1e-5, atol=1e-6)
    assert sent.int_buffers == {"bn.num_batches_tracked": 5}  # integers travel as trained
    default = decode_message(_sent("sign_flip"))  # the default scale: bench/experiments/bad_device.toml's x4
    np.testing.assert_allclose(default.weights["conv.weight"] - GLOBAL["conv.weight"],
                               -4 * (TRAINED["conv.weight"] - GLOBAL["conv.weight"]), rtol=1e-5, atol=1e-6)


def test_sign_flip_without_the_global_model_it_started_from_fails_the_upload() -> None:
    with pytest.raises(RuntimeError, match="does not hold global model version 9"):
        _sent("sign_flip", version=9)


def test_scale_multiplies_and_nan_reaches_the_receivers_frame_check() -> None:
    scaled = decode_message(_sent("scale", 1000))
    for name, trained in TRAINED.items():
        np.testing.assert_allclose(scaled.weights[name], trained * 1000, rtol=1e-6)
    with pytest.raises(NonFiniteError):  # the agent skipped its own checks; the server's refuse the frame
        decode_message(_sent("nan"))


def test_an_honest_agent_sends_what_its_method_made() -> None:
    sent = decode_message(_sent(""))
    for name, trained in TRAINED.items():
        np.testing.assert_array_equal(sent.weights[name], trained)


def test_random_labels_permutes_the_shard_and_keeps_its_class_counts() -> None:
    base = agent_config("f1", 0, 2, train_samples=200, test_samples=20)
    honest = EdgeAgent(base, transport=InMemoryTransport(InMemoryBroker(), "a")).train
    shuffled = EdgeAgent(dataclasses.replace(base, fault="random_labels"), transport=InMemoryTransport(InMemoryBroker(), "b")).train
    np.testing.assert_array_equal(shuffled.images, honest.images)
    np.testing.assert_array_equal(shuffled.class_counts(), honest.class_counts())
    assert (shuffled.labels != honest.labels).mean() > 0.5


def test_the_config_refuses_unknown_faults_and_misplaced_scales() -> None:
    with pytest.raises(ValueError, match=r"agent.fault: unknown fault 'flip'; faults: sign_flip, scale, random_labels, nan"):
        agent_config("f1", 0, 1, fault="flip")
    with pytest.raises(ValueError, match="takes no scale"):
        agent_config("f1", 0, 1, fault="random_labels", fault_scale=2.0)
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        agent_config("f1", 0, 1, fault="scale", fault_scale=0.0)
    with pytest.raises(ValueError, match="fault_scale = 2.0 without agent.fault"):
        agent_config("f1", 0, 1, fault_scale=2.0)
    assert EdgeConfig.from_dict({"agent": {"agent_id": "a", "fault": "sign_flip", "fault_scale": 3}}).fault_spec() == \
        FaultSpec("sign_flip", 3, "agent.fault")
    assert AgentFault(FaultSpec("scale"), "a").spec.describe() == "scale x1000"


# -- the launcher's flag --------------------------------------------------------------------------- #


@pytest.mark.parametrize("value, said", [("1:bogus", "unknown fault 'bogus'"), ("sign_flip", "takes AGENT_INDEX:KIND"),
                                         ("x:nan", "the agent index must be an integer"),
                                         ("1:sign_flip:big", "must be a number"), ("1:nan:3", "takes no scale")])
def test_a_bad_faulty_agent_flag_exits_2_listing_the_kinds(value: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["local", "--faulty-agent", value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--faulty-agent" in err and said in err
    if "bogus" in value or value == "sign_flip":
        assert ", ".join(FAULT_KINDS) in err


def test_a_faulty_agent_outside_the_run_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--agents", "3", "--faulty-agent", "3:sign_flip", "--out", str(tmp_path / "r")]) == 2
    assert "no agent 3 in a run of --agents 3 (indices 0 to 2)" in capsys.readouterr().err
    assert main(["local", "--agents", "3", "--faulty-agent", "1:nan", "--faulty-agent", "1:scale",
                 "--out", str(tmp_path / "r")]) == 2
    assert "agent 1 is given twice" in capsys.readouterr().err


def test_the_flag_is_written_into_that_agents_config_only(tmp_path: Path) -> None:
    args = build_parser().parse_args(["local", "--method", "fedavg", "--agents", "3", "--faulty-agent", "2:sign_flip:4",
                                      "--faulty-agent", "0:random_labels"])
    _, paths = write_configs(args, "f1", tmp_path, "mqtt://127.0.0.1:1883")
    agents = [read_toml(p)["agent"] for p in paths]
    assert (agents[2]["fault"], agents[2]["fault_scale"]) == ("sign_flip", 4.0)
    assert agents[0]["fault"] == "random_labels" and "fault_scale" not in agents[0]
    assert "fault" not in agents[1]
    for p in paths:  # what edge-agent reads
        EdgeConfig.from_dict(read_toml(p))


# -- a federation: the defaults let the flip through, the validation screen refuses it -------------- #

TABLE = {"model": "resnet8", "batch_size": 32}
TRAIN = 240


def _run(tmp: Path, server: dict) -> dict:
    run_id = f"faulty-{tmp.name}"[:60]
    cfg = method_server_config(tmp, "fedavg", TABLE, run_id=run_id, agents=3, rounds=1, min_agents=1, **server)
    agents = [agent_config(run_id, i, 3, train_samples=TRAIN, test_samples=30,
                           **({"fault": "sign_flip"} if i == 2 else {})) for i in range(3)]
    in_memory_federation(cfg, agents).start().join(timeout_s=300)
    return json.loads((tmp / "run" / "report.json").read_text())


@pytest.mark.slow
def test_the_defaults_take_the_flip_and_the_validation_screen_refuses_it(tmp_path: Path) -> None:
    default = _run(tmp_path / "default", {})
    assert default["agents"]["agent-2"]["fault"] == "sign_flip x4"
    assert default["agents"]["agent-0"]["fault"] == ""
    only = default["rounds"][0]
    assert "agent-2" in only["completed"] and not only.get("robustness", {}).get("refused")
    summary = (tmp_path / "default" / "run" / "summary.md").read_text()
    assert summary.count("**Faulty on purpose:** agent-2 (sign_flip x4)") == 1

    screened = _run(tmp_path / "screened", {"validation_samples": 200, "validation_agent_train_samples": TRAIN})
    refused = screened["rounds"][0]["robustness"]["refused"]
    assert set(refused) == {"agent-2"} and "implausible_validation" in refused["agent-2"]

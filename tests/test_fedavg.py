"""FedAvg: the weighted mean (closed form), the wire format of weights, the
server step, and 2 agents x 2 rounds over a real mosquitto."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_server.aggregation import AggregationError, weighted_mean
from cloud_server.methods import ServerContext
from cloud_server.methods.fedavg import FedAvgConfig, FedAvgServer
from cloud_server.report import validate_report
from models import build_model, state_dict_to_arrays
from shared_protocol.errors import ShapeMismatchError, StaleMessageError
from shared_protocol.messages import RoundEnd, RoundStart, decode_message, encode_message
from shared_protocol.messages import EvalReport
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgRoundConfig, FedAvgUpdate, join_state, split_state

from fedhelpers import agent_config, distinct_resnet8_state, in_memory_federation, method_server_config, mqtt_federation

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)


_trained_like_state = distinct_resnet8_state


def _closed_form(states: list[dict[str, np.ndarray]], counts: list[int]) -> dict[str, np.ndarray]:
    n = sum(counts)
    out = {}
    for name, first in states[0].items():
        value = sum(c * s[name].astype(np.float64) for s, c in zip(states, counts)) / n
        out[name] = (np.rint(value) if first.dtype.kind in "iu" else value).astype(first.dtype)
    return out


def test_weighted_mean_equals_the_closed_form() -> None:
    states = [_trained_like_state(s) for s in (1, 2, 3)]
    counts = [10, 30, 60]
    mean = weighted_mean(states, counts)
    expected = _closed_form(states, counts)
    assert set(mean) == set(expected)
    for name in expected:
        assert mean[name].dtype == states[0][name].dtype
        np.testing.assert_allclose(mean[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
    # BatchNorm buffers are averaged too, and the counter is the rounded weighted mean.
    counter = next(n for n in mean if n.endswith("num_batches_tracked"))
    assert int(mean[counter]) == round(sum(c * int(s[counter]) for s, c in zip(states, counts)) / 100)
    # Equal weights and one agent are the trivial cases.
    np.testing.assert_allclose(weighted_mean(states[:1], [5])["classifier.fc.weight"], states[0]["classifier.fc.weight"])


def test_weighted_mean_refuses_what_cannot_be_averaged() -> None:
    a, b = _trained_like_state(1), _trained_like_state(2)
    with pytest.raises(AggregationError, match="no states"):
        weighted_mean([], [])
    with pytest.raises(AggregationError, match="weights"):
        weighted_mean([a, b], [0, 0])
    with pytest.raises(AggregationError, match="missing"):
        weighted_mean([a, {k: v for k, v in b.items() if k != "classifier.fc.bias"}], [1, 1])
    b["classifier.fc.bias"] = np.zeros(11, np.float32)
    with pytest.raises(AggregationError, match="shape"):
        weighted_mean([a, b], [1, 1])


@pytest.mark.parametrize("codec", ["zstd", "fp16-zstd"])
def test_weights_travel_with_counters_exact(codec: str) -> None:
    state = _trained_like_state(4)
    weights, ints = split_state(state)
    assert ints and all(isinstance(v, int) for v in ints.values())  # the BN counters
    msg = FedAvgUpdate(run="u", round=1, sender="agent-0", instance="i", num_samples=7, model_version=0, int_buffers=ints, weights=weights)
    back = decode_message(encode_message(msg, codecs={"weights": codec}))
    assert isinstance(back, FedAvgUpdate)
    joined = join_state(back.weights, back.int_buffers)
    for name, array in state.items():
        if array.dtype.kind == "f":
            tol = 0 if codec == "zstd" else 1e-3 * max(1.0, float(np.abs(array).max()))
            np.testing.assert_allclose(joined[name], array, atol=tol, rtol=0 if codec == "zstd" else 1e-3)
        else:
            assert int(joined[name]) == int(array)  # counters never go through the lossy codec
    blob_zstd = len(encode_message(msg, codecs={"weights": "zstd"}))
    blob_fp16 = len(encode_message(msg, codecs={"weights": "fp16-zstd"}))
    assert blob_fp16 < 0.7 * blob_zstd  # ResNet-8 is small: the frame header (a descriptor per tensor) is a third of it


def _update(agent: str, state: dict[str, np.ndarray], n: int, version: int = 0, round_: int = 1) -> FedAvgUpdate:
    weights, ints = split_state(state)
    msg = FedAvgUpdate(run="u", round=round_, sender=agent, instance=f"{agent}-i", num_samples=n, model_version=version, int_buffers=ints, weights=weights)
    return decode_message(encode_message(msg))  # through the wire (lossless zstd)  # type: ignore[return-value]


def _end(agent: str, n: int, round_: int = 1) -> RoundEnd:
    return RoundEnd(run="u", round=round_, sender=agent, num_samples=n, instance=f"{agent}-i", metrics={"train_loss": 1.0})


def test_server_aggregate_is_the_weighted_mean_of_the_uploads() -> None:
    server = FedAvgServer(CTX, {"model": "resnet8"})
    states = [_trained_like_state(s) for s in (5, 6)]
    counts = [25, 75]
    for k, (state, n) in enumerate(zip(states, counts)):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", state, n))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", n) for k, n in enumerate(counts)}, evaluate=True)
    assert outcome.used_agents == ["agent-0", "agent-1"] and outcome.samples == 100
    expected = _closed_form(states, counts)
    for name, value in expected.items():
        np.testing.assert_allclose(server.global_state[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
    # The global model itself holds the aggregate (what the next RoundStart sends).
    np.testing.assert_allclose(state_dict_to_arrays(server.model)["classifier.fc.weight"], expected["classifier.fc.weight"], rtol=1e-6)
    # Evaluated round: the new model goes to both agents (ahead of the evaluation request).
    assert [(a, type(m)) for a, m in outcome.downloads] == [("agent-0", FedAvgGlobalModel), ("agent-1", FedAvgGlobalModel)]

    def report(agent: str, version: int, correct: int, total: int) -> EvalReport:
        return EvalReport(run="u", round=1, sender=agent, instance=f"{agent}-i",
                          results={"model": {"correct": correct, "total": total, "version": version}})

    # The evaluation: the global model (scored on the global set by the evaluator) and the
    # agents' answers about this very version; an answer about another version is not counted.
    ev = server.evaluation(1, {"agent-0": report("agent-0", 1, 3, 10), "agent-1": report("agent-1", 1, 9, 30),
                               "agent-2": report("agent-2", 0, 5, 5)})
    assert ev.local == {"model": {"agent-0": (3, 10), "agent-1": (9, 30)}}
    assert list(ev.global_models["model"]) == ["global"]
    # Agents that evaluated version 1 hold it: round 2's RoundStart carries no weights for them.
    config, weights = server.round_config(2, "agent-0", evaluate=True)
    assert weights == {} and FedAvgRoundConfig.from_dict(config).model_version == 1
    assert server.round_config(2, "agent-9", evaluate=True)[1]  # a newcomer gets the weights
    server.discard("agent-0")  # e.g. it failed: it may have lost the model
    assert server.round_config(2, "agent-0", evaluate=True)[1]


def test_server_refuses_stale_or_misfit_updates_and_excludes_inconsistent_ones() -> None:
    server = FedAvgServer(CTX, {"model": "resnet8"})
    state = _trained_like_state(7)
    with pytest.raises(StaleMessageError):
        server.on_upload("agent-0", _update("agent-0", state, 10, version=3))
    wrong = {k: v for k, v in state.items() if not k.startswith("classifier.fc")}
    with pytest.raises(ShapeMismatchError):
        server.on_upload("agent-0", _update("agent-0", wrong, 10))
    server.on_upload("agent-0", _update("agent-0", state, 10))
    outcome = server.complete(1, {"agent-0": _end("agent-0", 11)}, evaluate=False)  # sample counts disagree
    assert outcome.used_agents == [] and "samples" in outcome.excluded["agent-0"]
    assert server.version == 0  # nothing aggregated


def test_configs_validate() -> None:
    with pytest.raises(ValueError, match="feature maps"):
        FedAvgConfig(model="resnet55_server")
    with pytest.raises(ValueError, match="upload_codec"):
        FedAvgConfig.from_dict({"upload_codec": "u8-zstd"})
    with pytest.raises(ValueError, match="unknown"):
        FedAvgConfig.from_dict({"modle": "resnet8"})
    codecs = FedAvgServer(CTX, {"model": "resnet8", "download_codec": "fp16-zstd"}).download_codecs
    assert codecs[FedAvgGlobalModel.TYPE] == codecs[RoundStart.TYPE] == {"weights": "fp16-zstd"}


def test_fp16_weights_both_ways_in_memory(tmp_path: Path) -> None:
    cfg = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 32, "upload_codec": "fp16-zstd", "download_codec": "fp16-zstd"},
                               run_id="fa-fp16", rounds=1)
    report = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=64, test_samples=32) for i in range(2)]).start().join()
    validate_report(report)
    record = report["rounds"][0]
    assert record["status"] == "ok" and record["accuracy"] is not None
    params = report["models"]["edge"]["params"]
    # Two fp16 models up: under the 4 bytes a parameter fp32 would need, frame headers included.
    assert record["bytes"]["up_payload"] < 2 * 4 * params
    assert record["per_agent"]["agent-0"]["codec"] == "fp16-zstd"  # the upload codec, as for feature maps


@pytest.mark.broker
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 32}, run_id="fa-mq")
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url).start()
    fed.join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["method"] == "fedavg"
    params = report["models"]["edge"]["params"]
    assert report["models"]["server"] is None
    first, second = report["rounds"]
    for record in (first, second):
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 160
        # Global: the new global model on the global set (80 images); local: on both agents'
        # test shards (40 + 40 samples).
        assert record["accuracy"] is not None and round(record["accuracy"] * 80) == record["accuracy"] * 80
        assert record["local_accuracy"] is not None and round(record["local_accuracy"] * 80) == record["local_accuracy"] * 80
        assert record["edge_accuracy"] is None  # the deployed model is the one on the devices
        assert record["bytes"]["up_payload"] > 2 * params  # two models up, zstd of fp32
    # Round 1 sends the initial model in RoundStart and the aggregate for evaluation; round 2's
    # RoundStart carries no weights (the agents kept the evaluated model): about half the bytes down.
    assert second["bytes"]["down_payload"] < 0.7 * first["bytes"]["down_payload"]
    for agent in fed.agents:
        assert agent.method.global_version == 2
        # An agent whose Discover answer reached the server after its round began redoes round 1
        # (the coordinator restarts rounds on a mid-round hello); its stale update is refused.
        assert agent.rounds_done[-1] == 2 and set(agent.rounds_done) == {1, 2}
    server = fed.coordinator.method
    assert server.version == 2 and set(server.has_version.values()) == {2}

"""What the server keeps for the leakage audit (cloud_server/audit_keeper.py): nothing unless
asked, a bounded sample when asked, as .npz files that load without pickle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cloud_server.audit_keeper import AuditKeeper
from cloud_server.config import ServerConfig
from fedhelpers import make_server, server_config
from shared_protocol.messages import EvalReport, EvalSetRequest, RoundEnd, RoundStart
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgUpdate
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.splitnn import SplitGradients
from shared_protocol.transport import InMemoryBroker, InMemoryTransport


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def features(round_: int, seq: int, rows: int, agent: str = "agent-0", split: str = "train") -> GktFeatures:
    ids = np.arange(seq * rows, (seq + 1) * rows, dtype=np.int64)
    return GktFeatures(run="r", round=round_, sender=agent, split=split, seq=seq, instance="i",
                       features=np.full((rows, 16, 4, 4), seq, np.float32), logits=np.eye(10, dtype=np.float32)[ids % 10],
                       labels=ids % 10, sample_ids=ids)


def test_off_by_default_keeps_nothing(tmp_path: Path) -> None:
    assert ServerConfig().audit is False
    coordinator = make_server(server_config(tmp_path), InMemoryTransport(InMemoryBroker(), "server"))
    assert coordinator.audit is None
    assert not (tmp_path / "run" / "audit").exists()
    with pytest.raises(ValueError, match="audit_samples_per_agent"):
        ServerConfig(audit=True, audit_samples_per_agent=0)


def test_activation_uploads_are_kept_up_to_the_bound(tmp_path: Path) -> None:
    keeper = AuditKeeper(tmp_path, "fedgkt", samples_per_agent=8)
    initial = {"extractor.conv.weight": np.ones((16, 1, 3, 3), np.float32), "fc.bias": np.zeros(10, np.float32)}
    keeper.on_sent("agent-0", RoundStart(run="r", round=1, sender="server", method="fedgkt", deadline_s=1.0, weights=initial))
    for seq in range(3):  # 18 rows in round 1: 8 kept, every label counted
        keeper.on_received("agent-0", features(1, seq, 6))
    keeper.on_received("agent-0", features(2, 0, 6))  # a later round adds nothing
    maps = load(tmp_path / "audit" / "maps-agent-0.npz")
    assert maps["features"].shape == (8, 16, 4, 4) and maps["features"].dtype == np.float32
    assert maps["sample_ids"].tolist() == list(range(8)) and maps["labels"].tolist() == [i % 10 for i in range(8)]
    assert int(maps["round"]) == 1 and len(maps["round_labels"]) == 18 and len(maps["round_predicted"]) == 18
    assert np.array_equal(load(tmp_path / "audit" / "extractor.npz")["weights/extractor.conv.weight"], initial["extractor.conv.weight"])
    manifest = json.loads((tmp_path / "audit" / "kept.json").read_text())
    assert manifest["samples_per_agent"] == 8 and sorted(manifest["files"]) == ["extractor.npz", "maps-agent-0.npz"]
    assert manifest["files"]["maps-agent-0.npz"]["rows"] == 8


def test_evaluation_maps_of_the_local_test_images_are_kept_apart_with_the_round_model(tmp_path: Path) -> None:
    keeper = AuditKeeper(tmp_path, "fedgkt", samples_per_agent=5)
    keeper.on_received("agent-0", features(1, 0, 6))
    for seq in range(2):  # evaluation's upload of the local test images: 5 of 12 rows kept, apart from training's
        keeper.on_received("agent-0", features(1, seq, 6, split="test"))
    keeper.on_received("agent-0", features(2, 0, 6, split="test"))  # a later round adds nothing
    edge = {"edge/extractor.conv.weight": np.ones((16, 1, 3, 3), np.float32)}
    keeper.on_received("agent-0", EvalReport(run="r", round=1, sender="agent-0", models=edge))
    kept = load(tmp_path / "audit" / "evalmaps-agent-0.npz")
    assert kept["features"].shape == (5, 16, 4, 4) and kept["sample_ids"].tolist() == list(range(5))
    assert np.array_equal(kept["eval_weights/extractor.conv.weight"], edge["edge/extractor.conv.weight"])
    assert load(tmp_path / "audit" / "maps-agent-0.npz")["features"].shape[0] == 5  # training's rows unchanged
    manifest = json.loads((tmp_path / "audit" / "kept.json").read_text())
    assert manifest["files"]["evalmaps-agent-0.npz"]["rows"] == 5 and manifest["eval_models"]["agent-0"]["round"] == 1


def test_one_update_per_agent_with_the_global_model_it_started_from(tmp_path: Path) -> None:
    keeper = AuditKeeper(tmp_path, "fedavg", samples_per_agent=8)
    start = {"w": np.zeros(3, np.float32)}
    config = {"model_version": 0, "lr": 0.01, "optimizer": "sgd", "batch_size": 2, "local_epochs": 1}
    keeper.on_sent("agent-0", RoundStart(run="r", round=1, sender="server", method="fedavg", deadline_s=1.0, config=config,
                                         weights=start))
    update = FedAvgUpdate(run="r", round=1, sender="agent-0", instance="i", num_samples=2, model_version=0,
                          weights={"w": np.ones(3, np.float32)})
    keeper.on_received("agent-1", FedAvgUpdate(**{**vars(update), "sender": "agent-1"}))  # never sent a model: not kept
    keeper.on_received("agent-0", update)
    kept = load(tmp_path / "audit" / "update-agent-0.npz")
    assert kept["global/w"].tolist() == [0, 0, 0] and kept["uploaded/w"].tolist() == [1, 1, 1]
    assert json.loads(str(kept["round_config"])) == config and int(kept["num_samples"]) == 2
    # A later update of the same agent (from a model sent to everyone) is not kept: one per agent.
    keeper.on_sent(None, FedAvgGlobalModel(run="r", round=1, sender="server", model_version=1, weights={"w": np.ones(3, np.float32)}))
    keeper.on_received("agent-0", FedAvgUpdate(**{**vars(update), "round": 2, "model_version": 1,
                                                 "weights": {"w": np.full(3, 2.0, np.float32)}}))
    assert load(tmp_path / "audit" / "update-agent-0.npz")["uploaded/w"].tolist() == [1, 1, 1]
    assert not (tmp_path / "audit" / "update-agent-1.npz").exists()


def test_an_upload_the_audit_does_not_read_is_named(tmp_path: Path) -> None:
    keeper = AuditKeeper(tmp_path, "mymethod", samples_per_agent=8)
    keeper.on_received("agent-0", SplitGradients(run="r", round=1, sender="agent-0", seq=0, loss=0.0, correct=0,
                                                 gradients=np.zeros((1, 1, 1, 1), np.float32)))
    # A request for the public evaluation set carries nothing private: not named.
    keeper.on_received("agent-0", EvalSetRequest(run="r", round=1, sender="agent-0", images_sha256="0" * 64))
    manifest = json.loads((tmp_path / "audit" / "kept.json").read_text())
    assert manifest["not_kept"] == {"splitnn.gradients": 1} and manifest["files"] == {}


def test_a_resumed_server_keeps_what_the_first_process_kept(tmp_path: Path) -> None:
    AuditKeeper(tmp_path, "fedgkt", samples_per_agent=4).on_received("agent-0", features(1, 0, 6))
    resumed = AuditKeeper(tmp_path, "fedgkt", samples_per_agent=4)
    resumed.on_received("agent-0", features(3, 0, 6))  # agent-0 was covered before the restart
    resumed.on_received("agent-1", features(3, 0, 6, agent="agent-1"))
    manifest = json.loads((tmp_path / "audit" / "kept.json").read_text())
    assert sorted(manifest["files"]) == ["maps-agent-0.npz", "maps-agent-1.npz"]
    assert int(load(tmp_path / "audit" / "maps-agent-0.npz")["round"]) == 1


def test_fedgkt_keeps_the_resnet8_of_the_kept_rounds_evaluation_report(tmp_path: Path) -> None:
    # An agent extracts its maps after training: the ResNet-8 it reports that round produced them.
    keeper = AuditKeeper(tmp_path, "fedgkt", samples_per_agent=4)
    keeper.on_received("agent-0", features(1, 0, 6))
    keeper.on_received("agent-0", RoundEnd(run="r", round=1, sender="agent-0", num_samples=6))
    model = {"edge/extractor.conv.weight": np.full((16, 1, 3, 3), 2.0, np.float32)}
    keeper.on_received("agent-0", EvalReport(run="r", round=2, sender="agent-0", models=model))  # another round: not kept
    assert "eval_weights/extractor.conv.weight" not in load(tmp_path / "audit" / "maps-agent-0.npz")
    keeper.on_received("agent-0", EvalReport(run="r", round=1, sender="agent-0", models=model))
    kept = load(tmp_path / "audit" / "maps-agent-0.npz")
    assert np.array_equal(kept["eval_weights/extractor.conv.weight"], model["edge/extractor.conv.weight"])
    assert json.loads((tmp_path / "audit" / "kept.json").read_text())["not_kept"] == {}


def test_a_masked_input_is_kept_decoded_in_the_agents_layout_and_the_rounds_aggregate_beside_it(tmp_path: Path) -> None:
    from cloud_server.audit.audit_updates import received_update
    from cloud_server.audit.kept import load_kept_run
    from edge_agent.secagg_client import wire_view
    from shared_protocol.secagg import SecAggParams, quantise
    from shared_protocol.secagg_messages import SecAggAdvertise, SecAggMaskedInput, SecAggUnmask

    params = SecAggParams()
    keeper = AuditKeeper(tmp_path, "fedavg", samples_per_agent=8, secagg=params)
    start = {"b": np.zeros(2, np.float32), "a": np.ones((2, 2), np.float32)}  # not in name order: the agent sorts
    config = {"model_version": 0, "lr": 0.01, "optimizer": "sgd", "batch_size": 4, "local_epochs": 1}
    updates = {"agent-0": {"a": np.array([[0.5, -0.25], [1.0, -2.0]]), "b": np.array([0.125, -0.75])},
               "agent-1": {"a": np.array([[0.25, 0.0], [-1.0, 2.0]]), "b": np.array([-0.125, 0.25])}}
    for agent, update in updates.items():
        keeper.on_sent(agent, RoundStart(run="r", round=1, sender="server", method="fedavg", deadline_s=1.0, config=config,
                                         weights=start))
        keeper.on_received(agent, SecAggAdvertise(run="r", round=1, sender=agent, num_samples=3, c_public=np.zeros(32, np.uint8),
                                                  s_public=np.zeros(32, np.uint8)))
        # A ring holding the update as the agent lays it out (floats in name order, then the weight),
        # without masks: what the decoding must give back exactly, name by name.
        flat = np.concatenate([update[n].ravel() for n in sorted(update)])
        ring, _ = quantise(np.append(flat, 0.5), params, 2)
        keeper.on_received(agent, SecAggMaskedInput(run="r", round=1, sender=agent, model_version=0, masked=wire_view(ring)))
    kept = load(tmp_path / "audit" / "update-agent-0.npz")
    assert str(kept["kind"]) == "secagg.masked_input" and int(kept["num_samples"]) == 3 and float(kept["masked_weight"]) == 0.5
    for name, value in updates["agent-0"].items():
        assert np.array_equal(kept[f"update/{name}"], value), name
    assert np.array_equal(kept["global/a"], start["a"])
    # Unmasking, then the model of version 1 (the round's aggregate) goes out: its change is kept as the aggregate.
    for agent in updates:
        keeper.on_sent(agent, SecAggUnmask(run="r", round=1, sender="server", survivors=sorted(updates)))
    mean = {n: (updates["agent-0"][n] + updates["agent-1"][n]) / 2 for n in start}
    keeper.on_sent(None, FedAvgGlobalModel(run="r", round=1, sender="server", model_version=1,
                                           weights={n: (start[n] + mean[n]).astype(np.float32) for n in start}))
    aggregate = load(tmp_path / "audit" / "aggregate.npz")
    assert str(aggregate["kind"]) == "secagg.aggregate" and aggregate["agents"].tolist() == ["agent-0", "agent-1"]
    assert aggregate["agent_samples"].tolist() == [3, 3] and int(aggregate["num_samples"]) == 6
    for name in start:
        assert np.allclose(aggregate[f"update/{name}"], mean[name], atol=1e-6), name
    manifest = json.loads((tmp_path / "audit" / "kept.json").read_text())
    assert manifest["not_kept"] == {} and "masked input" in manifest["files"]["update-agent-0.npz"]["what"]
    # The audit reads both back as updates by name.
    (tmp_path / "report.json").write_text(json.dumps({"config": {"method": "fedavg"}}))
    run = load_kept_run(tmp_path)
    assert run.aggregate is not None and run.aggregate.agents == ("agent-0", "agent-1")
    received = received_update(run.updates["agent-1"])
    assert all(np.array_equal(received[n].numpy(), updates["agent-1"][n].astype(np.float32)) for n in start)

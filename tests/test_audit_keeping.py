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

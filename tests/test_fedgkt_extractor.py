"""FedGKT's ``train_extractor``: whether the agents' extractors (conv stem) train."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch

from cloud_server.methods.fedgkt import FedGktConfig
from edge_agent.costs import RoundMeter
from edge_agent.methods.base import EdgeContext
from edge_agent.methods.fedgkt import FedGktEdge
from fldata import make_synthetic
from shared_protocol.messages import RoundStart
from shared_protocol.methods.fedgkt import GktRoundConfig


def _edge() -> FedGktEdge:
    data = make_synthetic(48, num_classes=10, in_channels=1, seed=1)
    ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="i0", train=data, test=data,
                      settings={"num_classes": 10, "edge_model": "resnet8"}, send=lambda *a, **k: None, seed=0)
    torch.manual_seed(0)
    return FedGktEdge(ctx)


def _start(round_: int, **config: object) -> RoundStart:
    table = {"edge_lr": 0.01, "edge_batch_size": 16, "upload_batch_samples": 16, **config}
    return RoundStart(run="u", round=round_, sender="server", method="fedgkt",
                      config=asdict(FedGktConfig.from_dict(table).round_config()), deadline_s=60.0)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("train_extractor", [True, False])
def test_a_frozen_extractor_keeps_its_weights_and_batchnorm_statistics(train_extractor: bool) -> None:
    edge = _edge()
    stem, head = _state(edge.model.extractor), _state(edge.model.classifier)
    for round_ in (1, 2):
        edge.run_round(_start(round_, train_extractor=train_extractor), RoundMeter())
    stem_same = all(torch.equal(v, edge.model.extractor.state_dict()[k]) for k, v in stem.items())
    assert stem_same is (not train_extractor)  # weights, BatchNorm running statistics and counter
    # The classifier trains either way.
    assert any(not torch.equal(v, edge.model.classifier.state_dict()[k]) for k, v in head.items() if v.is_floating_point())


def test_train_extractor_travels_in_the_round_config() -> None:
    assert FedGktConfig().edge.train_extractor is False  # the default; the paper presets set true
    config = FedGktConfig.from_dict({"train_extractor": False})
    assert config.to_table()["train_extractor"] is False
    assert GktRoundConfig.from_dict(asdict(config.round_config())).train_extractor is False

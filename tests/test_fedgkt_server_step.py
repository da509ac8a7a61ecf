"""FedGKT's server training through the shared server step (cloud_server/server_step.py):
the same losses and sample-id keyed logits as the plain per-step loop it replaced.

A small 16-channel server model stands in for ResNet-55 (compiling ResNet-55 takes
minutes on a 2-core CPU). Tolerances: eager vs the plain loop, 1e-6 (the same operations;
only the loss sum's accumulation differs). Compiled vs eager: the mean loss to rtol 1e-4,
the logits to rtol 1e-3 / atol 1e-4 (logits are ~0.3). Another kernel order changes the
float32 rounding of the first step by ~1e-7, and ten Adam steps at lr 0.01 carry that into
the last epoch's logits as up to ~2e-5 (observed); a logit of another sample or another
loss would be off by ~1e-1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cloud_server.feature_store import ArrayStaging
from cloud_server.methods import ServerContext
from cloud_server.methods import fedgkt
from cloud_server.feature_store import StagedBatch, gather_batches
from cloud_server.methods.fedgkt import FedGktServer
from models.losses import kd_loss
from models.seeding import build_seeded
from shared_protocol.methods.fedgkt import GktServerLogits

from test_fedgkt_unit import _end, _features


class TinyServer(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 16, H, W)
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))  # (B, K)


@pytest.fixture
def tiny_server_model(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fedgkt.build_model

    # build_model's signature: the server draws its initial weights from the run's generator
    # (models.seeding), and the stand-in does too, so two servers of one seed start alike.
    def build(name: str, num_classes: int, *args: object, generator: torch.Generator | None = None) -> nn.Module:
        if name != "resnet55_server":
            return real(name, num_classes, *args, generator=generator)
        return TinyServer(num_classes) if generator is None else build_seeded(lambda: TinyServer(num_classes), generator)

    monkeypatch.setattr(fedgkt, "build_model", build)


# One agent's maps per batch (the step counts below assume it); the mixed order has its own test.
CONFIG = {"server_batch_size": 8, "server_epochs": 2, "lr_schedule": "none", "server_lr": 0.01, "server_order": "shuffled"}


def _server(server_step: str = "auto", **config: object) -> FedGktServer:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0, server_step=server_step)
    return FedGktServer(ctx, {**CONFIG, **config})


def _uploads() -> dict[str, list]:
    # Two agents, 20 and 13 samples (partial last batches), ids out of order.
    a = [_features(1, 12, np.arange(100, 112)[::-1].copy(), seq=0), _features(2, 8, np.arange(112, 120), seq=1)]
    b = [_features(3, 13, np.array([7, 3, 11, 5, 2, 9, 0, 1, 4, 6, 8, 10, 12]), seq=0)]
    return {"a": a, "b": b}


def _run(server: FedGktServer) -> tuple[dict[str, dict[int, np.ndarray]], float]:
    uploads = _uploads()
    for agent, batches in uploads.items():
        for msg in batches:
            server.on_upload(agent, msg)
    outcome = server.complete(1, {agent: _end(batches) for agent, batches in uploads.items()}, evaluate=False)
    logits = {}
    for agent, msg in outcome.downloads:
        assert isinstance(msg, GktServerLogits)
        logits[agent] = {int(i): row for i, row in zip(msg.sample_ids, msg.logits)}
    return logits, outcome.server_loss


def _plain_loop(server: FedGktServer) -> tuple[dict[str, dict[int, np.ndarray]], float]:
    """The loop FedGKT's server ran before the shared step: per step, logits to the host
    and the loss read with .item()."""
    c = server.config
    staging = ArrayStaging(1 << 30)
    data = {}
    for agent, batches in _uploads().items():
        data[agent] = gather_batches([StagedBatch(staging.stage(m.features), m.logits, m.labels, m.sample_ids) for m in batches], staging)
    generator = torch.Generator().manual_seed(server.ctx.seed * 100_003 + 1)
    server.model.train()
    agents = list(data)
    z_s = [np.zeros((len(data[a][3]), 10), np.float32) for a in agents]
    total, n_total = 0.0, 0
    for epoch in range(c.server_epochs):
        for plan in server._batches(data, generator):  # [(agent position, rows)], one piece per agent in the batch
            features = torch.cat([data[agents[k]][0][idx].to(torch.float32) for k, idx in plan])
            edge_logits = torch.cat([data[agents[k]][1][idx] for k, idx in plan])
            labels = torch.cat([data[agents[k]][2][idx] for k, idx in plan])
            logits = server.model(features)
            loss = F.cross_entropy(logits, labels) + c.edge.alpha * kd_loss(logits, edge_logits, c.edge.temperature)
            server.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            server.optimizer.step()
            if epoch == c.server_epochs - 1:
                start = 0
                for k, idx in plan:
                    z_s[k][idx.numpy()] = logits[start : start + len(idx)].detach().cpu().numpy()
                    start += len(idx)
                total += float(loss.item()) * len(labels)
                n_total += len(labels)
    return ({a: {int(i): row for i, row in zip(data[a][3], z_s[k])} for k, a in enumerate(agents)}, total / n_total)


def _assert_same(got: dict, expected: dict, rtol: float, atol: float) -> None:
    assert got.keys() == expected.keys()
    for agent in expected:
        assert got[agent].keys() == expected[agent].keys()  # every uploaded sample id, once
        for sid, row in expected[agent].items():
            np.testing.assert_allclose(got[agent][sid], row, rtol=rtol, atol=atol, err_msg=f"{agent} sample {sid}")


def test_the_shared_step_gives_the_plain_loops_losses_and_sample_keyed_logits(tiny_server_model: None) -> None:
    fast = _server("eager")
    logits, loss = _run(fast)
    assert fast._trainer().steps["eager"] == 2 * (3 + 2)  # 2 epochs of ceil(20/8) + ceil(13/8) batches
    plain_logits, plain_loss = _plain_loop(_server("eager"))
    assert math.isclose(loss, plain_loss, rel_tol=1e-6)
    _assert_same(logits, plain_logits, rtol=1e-6, atol=1e-6)


def test_mixed_batches_give_the_plain_loops_losses_and_sample_keyed_logits(tiny_server_model: None) -> None:
    """server_order = "mixed": batches of rows from several agents; each row's z_s goes back to its agent by id."""
    fast = _server("eager", server_order="mixed")
    logits, loss = _run(fast)
    assert fast._trainer().steps["eager"] == 2 * 5  # 2 epochs of ceil(33/8) batches over the union
    plain_logits, plain_loss = _plain_loop(_server("eager", server_order="mixed"))
    assert math.isclose(loss, plain_loss, rel_tol=1e-6)
    _assert_same(logits, plain_logits, rtol=1e-6, atol=1e-6)


def test_the_round_figures_record_the_server_device(tiny_server_model: None) -> None:
    server = _server()
    _run(server)
    figures = server.ctx.device_meter.take().to_json()
    assert figures["device"] == "cpu" and figures["train_s"] > 0 and figures["peak_memory_bytes"] is None


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_losses_and_logits(tiny_server_model: None) -> None:
    compiled = _server("compiled")
    logits, loss = _run(compiled)
    step = compiled._trainer()
    assert step.mode == "compiled", step.fallback_reason
    assert step.steps["compiled"] == 2 * 3 and step.steps["eager"] == 2 * 2  # the partial batches ran eagerly
    eager_logits, eager_loss = _run(_server("eager"))
    assert math.isclose(loss, eager_loss, rel_tol=1e-4)
    _assert_same(logits, eager_logits, rtol=1e-3, atol=1e-4)


def test_graph_on_a_cpu_trains_eagerly_with_the_same_results(tiny_server_model: None) -> None:
    graph = _server("graph")
    logits, loss = _run(graph)
    assert graph._trainer().mode == "eager" and "CUDA" in graph._trainer().fallback_reason
    eager_logits, eager_loss = _run(_server("eager"))
    assert loss == eager_loss
    _assert_same(logits, eager_logits, rtol=0, atol=0)

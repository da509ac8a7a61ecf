"""An agent whose model went non-finite still answers an evaluation request: its report
leaves the unknown loss out (the wire refuses NaN), or, when what it would send cannot be
encoded, an eval_failed error; the agent keeps running either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cloud_server.assemble import build_server_method
from edge_agent.agent import EdgeAgent
from edge_agent.methods.base import shard_result
from models.weights import state_dict_to_arrays
from fedhelpers import agent_config, method_server_config
from shared_protocol.messages import ErrorReply, EvalReport, EvalRequest, Welcome, decode_message
from shared_protocol.transport import InMemoryBroker, InMemoryTransport


def test_a_non_finite_loss_is_left_out_of_the_shard_result() -> None:
    assert shard_result(3, 4, float("nan")) == {"correct": 3, "total": 4}
    assert shard_result(3, 4, float("inf"), version=2) == {"correct": 3, "total": 4, "version": 2}
    assert shard_result(3, 4, 1.5) == {"correct": 3, "total": 4, "loss_sum": 1.5}


def test_an_agent_with_a_nan_model_answers_the_evaluation_and_keeps_running(tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 32}, agents=1)
    server = build_server_method(config, device="cpu")
    broker = InMemoryBroker()
    agent = EdgeAgent(agent_config("t1", 0, 1, train_samples=64, test_samples=16),
                      transport=InMemoryTransport(broker, "agent-0"))
    seen = InMemoryTransport(broker, "watcher")
    seen.connect()
    seen.subscribe(agent.topics.up("agent-0"))
    agent.transport.connect()
    agent._on_welcome(Welcome(run="t1", round=0, sender="server", accepted=True, method="fedavg", settings=server.welcome_settings()))
    # The global model it holds is finite but absurd (one bad agent's x1e30 update got in): its
    # logits overflow and the loss is not a number.
    state = {k: np.array(v, copy=True) for k, v in state_dict_to_arrays(agent.method.model).items()}
    for k, v in state.items():
        if v.dtype.kind == "f":
            v *= np.float32(1e30)
    agent.method.global_state, agent.method.global_version = state, 1
    agent._on_eval_request(EvalRequest(run="t1", round=1, sender="server"))
    received = []
    while (delivery := seen.receive(timeout_s=0.1)) is not None:
        received.append(decode_message(delivery.payload))
    reports = [m for m in received if isinstance(m, (EvalReport, ErrorReply))]
    assert len(reports) == 1
    report = reports[0]
    assert isinstance(report, EvalReport), report
    model = report.results["model"]
    assert "loss_sum" not in model and model["total"] == 16
    assert not agent._stop.is_set()


def test_a_report_that_cannot_be_encoded_becomes_an_eval_failed_error(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A FedGKT agent sends its ResNet-8 with its report; when that model holds NaN, the frame
    is refused by the encoder: the server gets eval_failed with the reason, the agent goes on."""
    from edge_agent.methods.base import EvalAnswer

    config = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 32}, agents=1)
    server = build_server_method(config, device="cpu")
    broker = InMemoryBroker()
    agent = EdgeAgent(agent_config("t1", 0, 1, train_samples=64, test_samples=16), transport=InMemoryTransport(broker, "agent-0"))
    seen = InMemoryTransport(broker, "watcher")
    seen.connect()
    seen.subscribe(agent.topics.up("agent-0"))
    agent.transport.connect()
    agent._on_welcome(Welcome(run="t1", round=0, sender="server", accepted=True, method="fedavg", settings=server.welcome_settings()))
    bad = EvalAnswer(results={"model": shard_result(1, 2)}, models={"edge": {"w": np.full((2, 2), np.nan, np.float32)}})
    monkeypatch.setattr(agent.method, "evaluate", lambda request, meter: bad)
    agent._on_eval_request(EvalRequest(run="t1", round=1, sender="server"))
    received = []
    while (delivery := seen.receive(timeout_s=0.1)) is not None:
        received.append(decode_message(delivery.payload))
    (reply,) = [m for m in received if isinstance(m, (EvalReport, ErrorReply))]
    assert isinstance(reply, ErrorReply) and reply.code == "eval_failed" and "edge/w" in reply.reason
    assert not agent._stop.is_set()

"""Split learning: gradients through the wire equal a single-process
forward/backward of the same split model; retries and turns; 2 agents x 2
rounds over a real mosquitto with a real per-batch exchange."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cloud_server.methods import ServerContext
from cloud_server.methods.splitnn import SplitNNConfig, SplitNNServer
from cloud_server.report import validate_report
from edge_agent.costs import RoundMeter
from edge_agent.methods.base import EdgeContext
from edge_agent.methods.splitnn import SplitNNEdge
from fldata import make_synthetic
from fldata.torch_data import make_loader
from models import build_model, load_arrays_into
from shared_protocol.errors import StaleMessageError, ValueRangeError
from shared_protocol.messages import Message, RoundEnd, RoundStart, decode_message, encode_message
from shared_protocol.messages import EvalReport, EvalRequest
from shared_protocol.methods.splitnn import SplitActivations, SplitExtractor, SplitExtractorWeights, SplitGradients

from fedhelpers import agent_config, in_memory_federation, method_server_config, mqtt_federation

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)


def _wire(msg: Message) -> Message:
    return decode_message(encode_message(msg))  # the default codecs: raw fp32 both ways


def _deliver(server: SplitNNServer, agent: str, msg: Message) -> Message | None:
    """What the coordinator does with an upload: an answered type goes to ``answer``."""
    if isinstance(msg, server.answered_types):
        return server.answer(agent, msg)
    server.on_upload(agent, msg)
    return None


def _edge(server: SplitNNServer, data) -> tuple[SplitNNEdge, list[Message]]:  # type: ignore[no-untyped-def]
    """An edge step whose request() goes through the wire to the server step."""
    sent: list[Message] = []

    def send(msg: Message, meter: RoundMeter, codecs: dict | None = None) -> None:
        msg = _wire(msg)
        sent.append(msg)
        _deliver(server, msg.sender, msg)

    def request(msg: Message, meter: RoundMeter, is_reply, timeout_s: float, codecs: dict | None = None, attempts: int = 3) -> Message:  # type: ignore[no-untyped-def]
        msg = decode_message(encode_message(msg, codecs=codecs))
        sent.append(msg)
        reply = _deliver(server, msg.sender, msg)
        assert reply is not None
        reply = _wire(reply)
        assert is_reply(reply)
        return reply

    ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="i0", train=data, test=data,
                      settings=server.welcome_settings(), send=send, request=request)
    return SplitNNEdge(ctx), sent


def test_gradients_match_a_single_process_forward_backward() -> None:
    data = make_synthetic(16, num_classes=10, in_channels=1, seed=1)
    server = SplitNNServer(CTX, {"batch_size": 16, "edge_optimizer": "sgd", "edge_lr": 0.01, "edge_momentum": 0.0, "edge_weight_decay": 0.0})
    # The reference: the same split model, whole, in one process, before anyone steps.
    extractor_ref = build_model("resnet8", 10, 1).extractor
    load_arrays_into(extractor_ref, server.extractor_state)
    head_ref = copy.deepcopy(server.model)
    images = torch.from_numpy((data.images.astype(np.float32) / 255.0 - 0.5) / 0.25)  # any fixed input
    labels = torch.from_numpy(data.labels)

    edge, sent = _edge(server, data)
    config, weights = server.round_config(1, "agent-0", evaluate=False)
    edge._load(weights)
    edge.extractor.train()
    activations = edge.extractor(images)  # (16, 16, 32, 32)
    reply = edge.ctx.request(
        SplitActivations(run="u", round=1, sender="agent-0", split="train", seq=0, instance="i0",
                         activations=activations.detach().numpy(), labels=labels.numpy()),
        RoundMeter(), lambda m: isinstance(m, SplitGradients), 1.0,
    )
    activations.backward(torch.from_numpy(reply.gradients))

    h_ref = extractor_ref(images)
    h_ref.retain_grad()
    loss_ref = F.cross_entropy(head_ref(h_ref), labels)
    loss_ref.backward()
    assert reply.loss == pytest.approx(float(loss_ref.detach()), abs=1e-6)
    np.testing.assert_allclose(reply.gradients, h_ref.grad.numpy(), atol=1e-5, rtol=0)
    for (name, p), (_, p_ref) in zip(edge.extractor.named_parameters(), extractor_ref.named_parameters()):
        np.testing.assert_allclose(p.grad.numpy(), p_ref.grad.numpy(), atol=1e-5, rtol=1e-5, err_msg=f"extractor {name}")
    for (name, p), (_, p_ref) in zip(server.model.named_parameters(), head_ref.named_parameters()):
        np.testing.assert_allclose(p.grad.numpy(), p_ref.grad.numpy(), atol=1e-5, rtol=1e-4, err_msg=f"server {name}")


def test_a_turn_end_to_end_with_retry_and_evaluation() -> None:
    data = make_synthetic(40, num_classes=10, in_channels=1, seed=2)
    server = SplitNNServer(CTX, {"batch_size": 16})
    edge, sent = _edge(server, data)
    config, weights = server.round_config(1, "agent-0", evaluate=True)
    start = RoundStart(run="u", round=1, sender="server", method="splitnn", config=config, deadline_s=60, evaluate=True, weights=weights)
    result = edge.run_round(start, RoundMeter())
    assert result.uploads == {"train": {"batches": 3, "samples": 40}}  # 16 + 16 + 8
    assert [type(m).__name__ for m in sent] == ["SplitActivations"] * 3 + ["SplitExtractorWeights"]
    # A retried batch (its answer was lost) is answered from the cache, not trained on again.
    params_before = [p.detach().clone() for p in server.model.parameters()]
    again = server.answer("agent-0", sent[2])
    assert again is not None and again is server.turn.last_reply  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(params_before, server.model.parameters()))
    with pytest.raises(ValueRangeError, match="expected batch 3"):
        server.answer("agent-0", sent[0])
    # The uploaded extractor is what the next agent starts from.
    np.testing.assert_array_equal(server.extractor_state["conv.weight"], edge.extractor.conv.weight.detach().numpy())
    end = RoundEnd(run="u", round=1, sender="agent-0", num_samples=40, instance="i0", uploads=result.uploads)
    outcome = server.complete(1, {"agent-0": end}, evaluate=True)
    assert outcome.used_agents == ["agent-0"] and outcome.samples == 40 and outcome.server_loss is not None
    (agent, final), = outcome.downloads
    assert isinstance(final, SplitExtractor)  # the round's final extractor, ahead of the evaluation request
    sent.clear()
    assert edge.on_message(_wire(final))
    answer = edge.evaluate(EvalRequest(run="u", round=1, sender="server"), RoundMeter())
    assert [m.split for m in sent] == ["test"] and answer.uploads  # sent: delivered to the server == {"test": {"batches": 1, "samples": 40}}
    ev = server.evaluation(1, {"agent-0": EvalReport(run="u", round=1, sender="agent-0", uploads=answer.uploads)})
    correct, total = ev.local["model"]["agent-0"]
    assert total == 40 and 0 <= correct <= 40
    assert list(ev.global_models["model"]) == ["global"]  # the final extractor + the server's part, both held here


def test_only_the_agent_whose_turn_it_is_may_send() -> None:
    server = SplitNNServer(CTX, {})
    server.round_config(1, "agent-0", evaluate=False)
    batch = SplitActivations(run="u", round=1, sender="agent-1", split="train", seq=0, instance="x",
                             activations=np.zeros((2, 16, 32, 32), np.float32), labels=np.zeros(2, np.int64))
    with pytest.raises(StaleMessageError, match="not its turn"):
        server.answer("agent-1", batch)
    weights = SplitExtractorWeights(run="u", round=1, sender="agent-1", instance="x", batches=0, weights=server.extractor_state)
    with pytest.raises(StaleMessageError):
        server.on_upload("agent-1", weights)
    with pytest.raises(ValueError, match="feature maps"):
        SplitNNConfig(server_model="resnet56")
    assert server.schedule == "sequential"


@pytest.mark.broker
def test_two_agents_take_turns_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "splitnn", {"batch_size": 32}, run_id="sl-mq")
    agents = [agent_config(cfg.run_id, i, 2, train_samples=96, test_samples=48) for i in range(2)]
    fed = mqtt_federation(cfg, agents, mosquitto.url).start()
    fed.join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["method"] == "splitnn"
    server = fed.coordinator.method
    # Agents took turns: agent-0's whole turn, then agent-1's, every round (a restarted turn repeats its entry).
    turns = [t for k, t in enumerate(server.turn_order) if k == 0 or t != server.turn_order[k - 1]]
    assert turns == [(1, "agent-0"), (1, "agent-1"), (2, "agent-0"), (2, "agent-1")]
    feature_bytes = 16 * 32 * 32 * 4  # one fp32 feature map = one gradient
    for record in report["rounds"]:
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 96 and record["accuracy"] is not None
        # Every training sample's activation went up and its gradient came down (Eq. 12), plus the
        # test activations of the evaluation; the same accounting as every method.
        assert record["bytes"]["down_payload"] > 96 * feature_bytes
        # The test activations are evaluation's bytes, apart from training's.
        assert record["bytes"]["up_payload"] > 96 * feature_bytes
        assert record["bytes"]["up_payload"] < 1.05 * 96 * feature_bytes + 200_000
        assert record["evaluation"]["bytes"]["up_payload"] > 48 * feature_bytes
        for agent in ("agent-0", "agent-1"):
            assert record["per_agent"][agent]["network_s"] > 0  # waiting for gradients
    assert report["models"]["edge"]["name"] == "resnet8-extractor"
    assert report["models"]["server"]["name"] == "resnet55_server"


def test_a_turn_restarted_by_the_server_mid_way_starts_over_cleanly(tmp_path: Path) -> None:
    """A hello from agent-0 mid-turn on a new broker connection (it reconnected, and may have
    lost what the server sent) makes the coordinator restart agent-0's round; the agent abandons
    the old turn at once instead of waiting for gradients that will never come, and the run
    finishes normally. (A hello repeated on the same connection, answering a late Discover, does
    not restart the round: tests/test_restarts.py.)"""
    cfg = method_server_config(tmp_path, "splitnn", {"batch_size": 16, "reply_timeout_s": 30.0}, run_id="sl-restart", rounds=1)
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=96, test_samples=32) for i in range(2)])
    server = fed.coordinator.method
    agent0 = fed.agents[0]

    def hello_mid_turn() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            turn = server.turn
            if turn is not None and turn.agent == "agent-0" and turn.next_seq >= 1:
                break
            time.sleep(0.01)
        # What agent-0 publishes after its transport reconnected (the same instance, the next
        # connection): the in-memory transport has no broker to drop, so count a connection.
        agent0.transport._connects += 1
        agent0.hello()

    threading.Thread(target=hello_mid_turn, daemon=True).start()
    started = time.monotonic()
    report = fed.start().join(timeout_s=120)
    validate_report(report)
    assert time.monotonic() - started < 60  # no reply timeouts were waited out
    record = report["rounds"][0]
    assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"] and record["samples"] == 48 * 2
    assert server.turn_order == [(1, "agent-0"), (1, "agent-0"), (1, "agent-1")]


def test_a_private_extractor_turn_sends_activations_only_and_is_scored_on_the_device() -> None:
    data = make_synthetic(40, num_classes=10, in_channels=1, seed=2)
    server = SplitNNServer(CTX, {"batch_size": 16, "extractor": "private"})
    assert server.scores_on_device and server.extractor_state == {}
    edge, sent = _edge(server, data)
    edge.ctx.private_key = b"k" * 32
    edge.ctx.public_set = lambda ref, meter, round_: data  # the run's global set, as the agent holds it
    config, weights = server.round_config(1, "agent-0", evaluate=True)
    assert weights == {}
    start = RoundStart(run="u", round=1, sender="server", method="splitnn", config=config, deadline_s=60, evaluate=True, weights=weights)
    result = edge.run_round(start, RoundMeter())
    assert [type(m).__name__ for m in sent] == ["SplitActivations"] * 3  # no extractor after the turn
    # The server refuses what a private extractor must not send.
    held = SplitExtractorWeights(run="u", round=1, sender="agent-0", instance="i0", batches=3,
                                 weights={k: v.detach().numpy() for k, v in edge.extractor.state_dict().items()})
    with pytest.raises(ValueRangeError, match="private"):
        server.on_upload("agent-0", held)
    test_batch = SplitActivations(run="u", round=1, sender="agent-0", split="test", seq=0, instance="i0",
                                  activations=sent[0].activations, labels=sent[0].labels)
    with pytest.raises(ValueRangeError, match="scored on the device"):
        server.answer("agent-0", test_batch)
    end = RoundEnd(run="u", round=1, sender="agent-0", num_samples=40, instance="i0", uploads=result.uploads)
    outcome = server.complete(1, {"agent-0": end}, evaluate=True)
    assert outcome.used_agents == ["agent-0"] and outcome.downloads == []
    # Without the server's part the agent cannot score: a specific error, not a silent empty answer.
    with pytest.raises(StaleMessageError, match="without the server's part"):
        edge.evaluate(EvalRequest(run="u", round=1, sender="server"), RoundMeter())
    (part,) = server.evaluation_downloads(1, "agent-0")
    assert part.for_evaluation and edge.on_message(_wire(part))
    sent.clear()
    meter = RoundMeter()
    answer = edge.evaluate(EvalRequest(run="u", round=1, sender="server"), meter)
    assert sent == [] and answer.models == {} and answer.uploads == {}
    server.model.eval()
    with torch.no_grad():
        expected = sum(int((server.model(edge.extractor.eval()(images)).argmax(1) == labels).sum())
                       for images, labels, _ in make_loader(data, 256))
    assert answer.results["model"]["correct"] == answer.global_results["model"]["correct"] == expected
    ev = server.evaluation(1, {"agent-0": EvalReport(run="u", round=1, sender="agent-0", results=answer.results)})
    assert ev.global_models == {} and ev.local["model"]["agent-0"] == (expected, 40)
    # A restarted agent resumes its extractor and key from its local state, not a fresh draw.
    state = edge.state_arrays()
    fresh, _ = _edge(server, data)
    fresh.load_state_arrays(state)
    assert fresh.ctx.private_key == b"k" * 32
    for (name, a), b in zip(edge.extractor.state_dict().items(), fresh.extractor.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_private_extractor_is_drawn_from_the_agent_key() -> None:
    data = make_synthetic(8, num_classes=10, in_channels=1, seed=2)
    server = SplitNNServer(CTX, {"extractor": "private"})
    weights = []
    for key in (b"a" * 32, b"a" * 32, b"b" * 32):
        ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="i0", train=data, test=data,
                          settings=server.welcome_settings(), send=lambda *a, **k: None, private_key=key)
        weights.append(SplitNNEdge(ctx).extractor.conv.weight.detach())
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    ring = SplitNNServer(CTX, {})
    assert not torch.equal(weights[0], torch.from_numpy(ring.extractor_state["conv.weight"]))
    # The server's part starts from the same weights in either mode.
    for a, b in zip(server.model.state_dict().values(), ring.model.state_dict().values()):
        assert torch.equal(a, b)

"""FedGKD / FedGKD-Vote: the loss against hand-computed values, the model
buffer and its average, the vote coefficients, the teachers on the wire (server
and edge), and 2 agents x 2 rounds over a real mosquitto."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkd import FedGkdConfig, FedGkdServer, ModelBuffer, vote_coefficients
from cloud_server.report import validate_report
from edge_agent.methods.base import EdgeContext
from edge_agent.methods.fedavg import logits_of
from edge_agent.methods.fedgkd import FedGkdEdge, fedgkd_loss
from fldata import make_synthetic
from models import build_model, state_dict_to_arrays
from shared_protocol.errors import ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import RoundEnd, RoundStart, decode_message, encode_message
from shared_protocol.messages import EvalReport, EvalRequest
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgRoundConfig, FedAvgUpdate, join_state, split_state
from shared_protocol.methods.fedgkd import CONFIG_KEY, FedGkdTeachers

from fedhelpers import agent_config, distinct_resnet8_state, in_memory_federation, method_server_config, mqtt_federation

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
LN = math.log

# --------------------------------------------------------------------------- #
# The loss (Eqs. 3-5)
# --------------------------------------------------------------------------- #


def test_loss_equals_hand_computed_values() -> None:
    # Sample 0: the local model is uniform (p = 1/3 each), the teacher says q = (1/2, 1/4, 1/4), label 0.
    #   CE = ln 3;  KL(q || p) = 1/2 ln(3/2) + 2 * 1/4 ln(3/4) = 1/2 ln(9/8).
    # Sample 1: local and teacher agree on (1/2, 1/4, 1/4), label 0: CE = ln 2, KL = 0.
    logits = torch.tensor([[0.0, 0.0, 0.0], [LN(2), 0.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[LN(2), 0.0, 0.0], [LN(2), 0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([0, 0])
    loss = fedgkd_loss(logits, labels, [teacher], [0.2])
    # Batch means: CE (ln 3 + ln 2) / 2, KL (1/2 ln(9/8) + 0) / 2; weight gamma / 2 = 0.1.
    expected = (LN(3) + LN(2)) / 2 + 0.1 * (0.5 * LN(9 / 8)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # The direction is KL(teacher || local): the reverse, KL(p || q) = 1/3 ln(32/27) for sample 0, is not it.
    reverse = (LN(3) + LN(2)) / 2 + 0.1 * (LN(32 / 27) / 3) / 2
    assert abs(loss.item() - reverse) > 1e-4
    # Only the local model learns: the teacher's logits get no gradient.
    loss.backward()
    assert teacher.grad is None and logits.grad is not None
    # gamma scales the KD term linearly; gamma -> 0 is plain cross-entropy.
    plain = fedgkd_loss(logits, labels, [teacher], [0.0]).item()
    assert plain == pytest.approx((LN(3) + LN(2)) / 2, rel=1e-6)
    assert fedgkd_loss(logits, labels, [teacher], [0.4]).item() - plain == pytest.approx(2 * (expected - plain), rel=1e-5)


def test_vote_loss_sums_each_teacher_with_its_own_coefficient() -> None:
    # One sample, local uniform over 2 classes, label 1 (CE = ln 2).
    # Teacher A: q = (3/4, 1/4): KL = 3/4 ln(3/2) + 1/4 ln(1/2). Teacher B agrees with the local model: KL = 0.
    logits = torch.zeros(1, 2)
    a = torch.tensor([[LN(3), 0.0]])
    b = torch.zeros(1, 2)
    labels = torch.tensor([1])
    kl_a = 0.75 * LN(1.5) + 0.25 * LN(0.5)
    loss = fedgkd_loss(logits, labels, [a, b], [0.3, 0.1])  # Eq. 5: sum_m gamma_m / 2 KL_m
    assert loss.item() == pytest.approx(LN(2) + 0.15 * kl_a, rel=1e-6)
    swapped = fedgkd_loss(logits, labels, [a, b], [0.1, 0.3])
    assert swapped.item() == pytest.approx(LN(2) + 0.05 * kl_a, rel=1e-6)
    with pytest.raises(ValueError, match="coefficients"):
        fedgkd_loss(logits, labels, [a, b], [0.1])
    with pytest.raises(ShapeMismatchError):
        fedgkd_loss(logits, labels, [torch.zeros(1, 3)], [0.1])


# --------------------------------------------------------------------------- #
# The buffer and the vote coefficients
# --------------------------------------------------------------------------- #


_state = distinct_resnet8_state


def test_buffer_keeps_the_last_m_models_and_averages_them() -> None:
    buffer = ModelBuffer(3)
    states = {v: _state(v) for v in range(6)}
    buffer.push(0, states[0])
    assert buffer.versions() == [0]
    for name, array in buffer.average().items():  # one model: its own average
        np.testing.assert_array_equal(array, states[0][name])
    for v in range(1, 6):
        buffer.push(v, states[v])
    assert buffer.versions() == [5, 4, 3] and len(buffer) == 3  # newest first, the oldest dropped
    average = buffer.average()
    assert set(average) == set(states[0])
    for name, array in average.items():
        mean = np.mean([states[v][name].astype(np.float64) for v in (3, 4, 5)], axis=0)
        if array.dtype.kind == "f":
            np.testing.assert_allclose(array, mean, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            assert int(array) == int(np.rint(mean)), name  # BatchNorm counters: the rounded mean
        assert array.dtype == states[0][name].dtype
    with pytest.raises(ValueError, match="not newer"):
        buffer.push(5, states[0])


def test_vote_coefficients_follow_the_papers_rule() -> None:
    # gamma_i / 2 = lambda * exp(-L_i / beta) / sum_j exp(-L_j / beta)
    losses, lam, beta = [1.0, 2.0, 1.5], 0.1, 0.5
    e = [math.exp(-1.0 / 0.5), math.exp(-2.0 / 0.5), math.exp(-1.5 / 0.5)]
    expected = [2 * lam * x / sum(e) for x in e]
    got = vote_coefficients(losses, lam, beta)
    assert got == pytest.approx(expected, rel=1e-12)
    assert sum(got) == pytest.approx(2 * lam)  # the KD weights sum to lambda, as FedGKD's gamma / 2
    assert got[0] > got[2] > got[1]  # the lower the validation loss, the larger the say
    # Equal losses: equal votes. A tiny temperature must not overflow.
    assert vote_coefficients([0.7, 0.7], 0.1, 0.2) == pytest.approx([0.1, 0.1])
    assert vote_coefficients([1000.0, 0.0], 0.1, 0.001) == pytest.approx([0.0, 0.2])
    # The paper's beta is 1 / M.
    assert FedGkdConfig(model="resnet8", buffer_size=5).beta == pytest.approx(0.2)
    assert FedGkdConfig(model="resnet8", buffer_size=5, vote_temperature=0.3).beta == pytest.approx(0.3)


def test_config_validates() -> None:
    assert FedGkdConfig().gamma == 0.2 and FedGkdConfig().buffer_size == 5 and FedGkdConfig().variant == "avg"
    with pytest.raises(ValueError, match="variant"):
        FedGkdConfig(variant="mean")
    with pytest.raises(ValueError, match="gamma"):
        FedGkdConfig(gamma=0.0)
    with pytest.raises(ValueError, match="buffer_size"):
        FedGkdConfig(buffer_size=0)
    with pytest.raises(ValueError, match=r"unknown \[fedgkd\] keys"):
        FedGkdConfig.from_dict({"gama": 0.1})
    with pytest.raises(ValueRangeError, match="at least one teacher"):
        FedGkdTeachers.from_dict({"variant": "avg", "buffer_size": 2, "teachers": []})
    with pytest.raises(ValueRangeError, match="coefficient"):
        FedGkdTeachers.from_dict({"variant": "avg", "buffer_size": 2, "teachers": [{"source": "sent", "coefficient": -1, "versions": [1, 0]}]})
    with pytest.raises(ValueRangeError, match="unknown keys"):
        FedGkdTeachers.from_dict({"variant": "avg", "buffer_size": 2, "teachers": [], "extra": 1})
    bad = EvalReport(run="u", round=1, sender="a", instance="i", results={"model": {"correct": 1, "total": 2, "loss_sum": -1.0}})
    with pytest.raises(ValueRangeError, match="loss_sum"):
        bad.validate()


# --------------------------------------------------------------------------- #
# The server: teachers per round
# --------------------------------------------------------------------------- #


def _update(agent: str, state: dict[str, np.ndarray], n: int, version: int, round_: int) -> FedAvgUpdate:
    weights, ints = split_state(state)
    msg = FedAvgUpdate(run="u", round=round_, sender=agent, instance=f"{agent}-i", num_samples=n, model_version=version, int_buffers=ints, weights=weights)
    return decode_message(encode_message(msg))  # type: ignore[return-value]


def _end(agent: str, n: int, round_: int, **metrics: float) -> RoundEnd:
    return RoundEnd(run="u", round=round_, sender=agent, num_samples=n, instance=f"{agent}-i", metrics={"train_loss": 1.0, **metrics})


def _teachers_of(config: dict) -> FedGkdTeachers:
    return FedGkdTeachers.from_dict(config[CONFIG_KEY])


def _run_server_round(server: FedGkdServer, round_: int, agents: dict[str, tuple[dict[str, np.ndarray], int]],
                      eval_losses: dict[str, tuple[float, int]] | None = None, **end_metrics: float) -> None:
    for agent, (state, n) in agents.items():
        server.round_config(round_, agent, evaluate=True)
        server.on_upload(agent, _update(agent, state, n, server.version, round_))
    outcome = server.complete(round_, {a: _end(a, n, round_, **end_metrics) for a, (_, n) in agents.items()}, evaluate=True)
    assert outcome.used_agents == sorted(agents)
    reports = {agent: EvalReport(run="u", round=round_, sender=agent, instance=f"{agent}-i",
                                 results={"model": {"correct": 0, "total": total, "loss_sum": loss_sum, "version": round_}})
               for agent, (loss_sum, total) in (eval_losses or {}).items()}
    server.evaluation(round_, reports)


def test_avg_server_sends_the_buffer_average_as_one_extra_model() -> None:
    server = FedGkdServer(CTX, {"model": "resnet8", "buffer_size": 2, "gamma": 0.3})
    w0 = dict(server.global_state)
    # Round 1: one model in the buffer, the teacher is the global model itself: no extra tensors.
    config, weights = server.round_config(1, "agent-0", evaluate=True)
    spec = _teachers_of(config)
    assert [(t.source, t.versions, t.coefficient) for t in spec.teachers] == [("global", (0,), 0.3)]
    assert not any(k.startswith("teacher") for k in weights)
    FedAvgRoundConfig.from_dict({k: v for k, v in config.items() if k != CONFIG_KEY})  # the rest is FedAvg's config
    _run_server_round(server, 1, {"agent-0": (_state(1), 10), "agent-1": (_state(2), 30)})
    w1 = server.global_state
    # Round 2: the buffer is [w1, w0]; the teacher is their average, sent as teacher0/<name>.
    config, weights = server.round_config(2, "agent-0", evaluate=True)
    spec = _teachers_of(config)
    assert [(t.source, t.versions, t.coefficient) for t in spec.teachers] == [("sent", (1, 0), 0.3)]
    teacher = join_state({k[len("teacher0/"):]: v for k, v in weights.items() if k.startswith("teacher0/")}, spec.teachers[0].int_buffers)
    assert set(teacher) == set(w0)
    for name in w0:
        if w0[name].dtype.kind == "f":
            np.testing.assert_allclose(teacher[name], (w1[name].astype(np.float64) + w0[name]) / 2, rtol=1e-6, atol=1e-6, err_msg=name)
    report = server.round_report(2)
    float_bytes = sum(a.nbytes for a in split_state(w0)[0].values())
    assert report["buffer_versions"] == [1, 0] and report["teachers_sent"] == 1 and report["teacher_tensor_bytes"] == float_bytes
    # Round 3 with M = 2: w0 left the buffer.
    _run_server_round(server, 2, {"agent-0": (_state(3), 10)})
    assert server.buffer.versions() == [2, 1]
    assert _teachers_of(server.round_config(3, "agent-0", evaluate=True)[0]).teachers[0].versions == (2, 1)


def test_vote_server_weighs_teachers_by_validation_loss_and_resends_only_what_is_missing() -> None:
    server = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 3})
    config, weights = server.round_config(1, "agent-0", evaluate=False)
    spec = _teachers_of(config)
    # Round 1: only w0, never evaluated: its softmax weight is 1 (gamma_1 / 2 = lambda); its loss is asked for.
    assert [(t.source, t.versions) for t in spec.teachers] == [("global", (0,))] and spec.teachers[0].coefficient == pytest.approx(0.2)
    assert spec.measure_start_loss
    # The agents measured w0 (mean loss (23 + 9) / 16 = 2.0) and evaluated w1 (mean (6 + 10) / 16 = 1.0).
    _run_server_round(server, 1, {"agent-0": (_state(1), 10), "agent-1": (_state(2), 30)},
                      eval_losses={"agent-0": (6.0, 8), "agent-1": (10.0, 8)}, start_loss_sum=16.0, start_loss_total=8)
    assert server.mean_val_loss(0) == pytest.approx(2.0) and server.mean_val_loss(1) == pytest.approx(1.0)
    config, weights = server.round_config(2, "agent-0", evaluate=False)
    spec = _teachers_of(config)
    assert [t.versions for t in spec.teachers] == [(1,), (0,)]
    assert [t.coefficient for t in spec.teachers] == pytest.approx(vote_coefficients([1.0, 2.0], 0.1, 1 / 3))
    # agent-0 trained round 1 from w0 and evaluated w1: nothing extra travels.
    assert [t.source for t in spec.teachers] == ["global", "held"] and not spec.measure_start_loss
    assert not weights  # it holds w1 too (it evaluated it)
    # A newcomer gets w1 as the global model and w0 as a sent teacher.
    config, weights = server.round_config(2, "agent-9", evaluate=False)
    assert [t.source for t in _teachers_of(config).teachers] == ["global", "sent"]
    w0_sent = {k[len("teacher1/"):]: v for k, v in weights.items() if k.startswith("teacher1/")}
    assert w0_sent and all(np.array_equal(w0_sent[k], server.buffer.entries()[1][1][k]) for k in w0_sent)
    # An agent that failed may have lost its copies: it gets them again.
    server.discard("agent-0")
    assert [t.source for t in _teachers_of(server.round_config(2, "agent-0", evaluate=False)[0]).teachers] == ["global", "sent"]
    report = server.round_report(2)
    assert report["teacher_versions"] == [[1], [0]] and report["teacher_val_losses"] == [1.0, 2.0]
    assert report["teachers_global"] == 3 and report["teachers_held"] == 1 and report["teachers_sent"] == 2
    # The vote needs every new model's evaluation (its loss weighs the next round): every round is evaluated.
    assert server.evaluate_every_round and not FedGkdServer(CTX, {"model": "resnet8"}).evaluate_every_round


def test_vote_leaves_out_models_nobody_scored() -> None:
    # w0's loss was measured at round 1's start, but every evaluation answer of w1 was lost.
    server = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 3})
    _run_server_round(server, 1, {"agent-0": (_state(1), 10)}, start_loss_sum=8.0, start_loss_total=4)
    spec = _teachers_of(server.round_config(2, "agent-0", evaluate=False)[0])
    assert [(t.versions, t.source) for t in spec.teachers] == [((0,), "held")]
    assert spec.teachers[0].coefficient == pytest.approx(0.2)  # one scored model: the whole lambda
    assert spec.measure_start_loss  # w1 starts round 2 unscored: the agents measure it
    # Nothing scored at all: the newest model (the global one) teaches alone.
    blind = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 3})
    _run_server_round(blind, 1, {"agent-0": (_state(1), 10)})
    spec = _teachers_of(blind.round_config(2, "agent-0", evaluate=False)[0])
    assert [(t.versions, t.source, t.coefficient) for t in spec.teachers] == [((1,), "global", pytest.approx(0.2))]


def test_server_checkpoint_keeps_the_buffer_and_losses() -> None:
    server = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 2})
    _run_server_round(server, 1, {"agent-0": (_state(1), 10)}, eval_losses={"agent-0": (4.0, 4)})
    restored = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 2})
    restored.load_state(server.state())
    assert restored.buffer.versions() == [1, 0] and restored.mean_val_loss(1) == pytest.approx(1.0)
    for (v, s), (rv, rs) in zip(server.buffer.entries(), restored.buffer.entries()):
        assert v == rv and all(np.array_equal(s[k], rs[k]) for k in s)


# --------------------------------------------------------------------------- #
# The edge: teachers resolved, refused when missing, used on the same batch
# --------------------------------------------------------------------------- #


def _edge(sent: list) -> FedGkdEdge:
    data = make_synthetic(24, num_classes=10, in_channels=1, seed=1)
    ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="agent-0-i", train=data, test=data,
                      settings={"num_classes": 10, "model": "resnet8"}, send=lambda msg, meter, codecs=None: sent.append(msg))
    return FedGkdEdge(ctx)


def _start(server: FedGkdServer, round_: int, agent: str = "agent-0") -> RoundStart:
    config, weights = server.round_config(round_, agent, evaluate=False)
    msg = RoundStart(run="u", round=round_, sender="server", method="fedgkd", config=config, deadline_s=60.0, weights=weights)
    return decode_message(encode_message(msg))  # type: ignore[return-value]


def test_edge_trains_with_its_teachers_and_refuses_to_train_without() -> None:
    from edge_agent.costs import RoundMeter

    sent: list = []
    edge = _edge(sent)
    server = FedGkdServer(CTX, {"model": "resnet8", "variant": "vote", "buffer_size": 2, "batch_size": 8})
    start = _start(server, 1)
    result = edge.run_round(start, RoundMeter())
    assert result.metrics["start_loss_total"] == 24 and result.metrics["start_loss_sum"] > 0 and result.uploads["teachers"] == 1
    update = sent[-1]
    assert isinstance(update, FedAvgUpdate) and update.model_version == 0
    server.on_upload("agent-0", decode_message(encode_message(update)))
    server.complete(1, {"agent-0": _end("agent-0", 24, 1, start_loss_sum=result.metrics["start_loss_sum"], start_loss_total=24)}, evaluate=True)
    floats, ints = split_state(server.global_state)  # what FedAvgGlobalModel carries to the agent
    assert edge.on_message(FedAvgGlobalModel(run="u", round=1, sender="server", model_version=1, int_buffers=ints, weights=floats))
    answer = edge.evaluate(EvalRequest(run="u", round=1, sender="server"), RoundMeter())
    figures = answer.results["model"]
    assert figures["total"] == 24 and figures["loss_sum"] > 0 and figures["version"] == 1
    report = EvalReport(run="u", round=1, sender="agent-0", instance="agent-0-i", results=answer.results)
    server.evaluation(1, {"agent-0": decode_message(encode_message(report))})  # type: ignore[dict-item]
    assert server.mean_val_loss(1) == pytest.approx(figures["loss_sum"] / 24)
    # Round 2: w1 is the global model and w0 a held teacher; the agent kept both.
    start2 = _start(server, 2)
    assert [t.source for t in _teachers_of(start2.config).teachers] == ["global", "held"]
    edge.run_round(start2, RoundMeter())
    # Without the teacher config, or with a held teacher it does not have, the round fails loudly.
    no_teacher = RoundStart(run="u", round=3, sender="server", method="fedgkd",
                            config={k: v for k, v in start2.config.items() if k != CONFIG_KEY}, deadline_s=60.0)
    with pytest.raises(ValueRangeError, match="no teachers"):
        edge.run_round(no_teacher, RoundMeter())
    edge.held.clear()
    with pytest.raises(StaleMessageError, match="held teacher version 0"):
        edge.run_round(start2, RoundMeter())
    # Tensors of a teacher the config does not send are refused too.
    bad = RoundStart(run="u", round=2, sender="server", method="fedgkd", config=start2.config, deadline_s=60.0,
                     weights={"teacher5/x": np.zeros(2, np.float32)})
    with pytest.raises(ShapeMismatchError, match="teachers"):
        edge.run_round(bad, RoundMeter())


def test_edge_loss_uses_the_teacher_on_the_local_models_batch() -> None:
    edge = _edge([])
    teacher_state = _state(7)
    edge._load_teachers([teacher_state], [0.2])
    images, labels = torch.randn(4, 1, 32, 32), torch.tensor([0, 1, 2, 3])
    edge.model.train()
    output = edge.forward_fn(FedAvgRoundConfig())(edge.model, images)  # what the trainer computes per batch
    loss = edge.loss_fn(FedAvgRoundConfig())(output, labels, torch.arange(4))
    output = output[0]
    reference = build_model("resnet8", 10, 1)
    from models import load_arrays_into

    load_arrays_into(reference, teacher_state)
    reference.eval()
    with torch.no_grad():
        expected = fedgkd_loss(logits_of(output), labels, [logits_of(reference(images))], [0.2])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    edge._teachers = []
    with pytest.raises(ValueRangeError, match="no teacher"):
        edge.loss_fn(FedAvgRoundConfig())


# --------------------------------------------------------------------------- #
# End to end
# --------------------------------------------------------------------------- #


def test_vote_two_rounds_in_memory(tmp_path: Path) -> None:
    cfg = method_server_config(tmp_path, "fedgkd", {"model": "resnet8", "batch_size": 32, "variant": "vote", "buffer_size": 3},
                               run_id="gkd-vote", rounds=2, eval_every=2)
    report = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=64, test_samples=32) for i in range(2)]).start().join()
    validate_report(report)
    first, second = report["rounds"]
    assert first["status"] == second["status"] == "ok"
    assert first["method"]["teacher_versions"] == [[0]] and first["method"]["coefficients"] == [0.2]
    # Round 2 votes between w1 and w0 with the losses the agents measured; both were already on the agents.
    losses = second["method"]["teacher_val_losses"]
    assert second["method"]["teacher_versions"] == [[1], [0]] and None not in losses
    assert second["method"]["coefficients"] == pytest.approx(vote_coefficients(losses, 0.1, 1 / 3), abs=1e-5)
    assert second["method"]["teachers_sent"] == 0 and second["method"]["teachers_held"] == 2
    # The vote evaluates every round (eval_every = 2 notwithstanding): round 1 has an accuracy too.
    assert first["accuracy"] is not None


@pytest.mark.broker
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "fedgkd", {"model": "resnet8", "batch_size": 32, "buffer_size": 2}, run_id="gkd-mq")
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url).start()
    fed.join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["method"] == "fedgkd"
    first, second = report["rounds"]
    for record in (first, second):
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["accuracy"] is not None
    # Round 1: one model in the buffer, the teacher is the global model: FedAvg's bytes.
    assert first["method"]["teachers_global"] == 2 and first["method"]["teacher_tensor_bytes"] == 0
    # Round 2: the average of [w1, w0] went to both agents as an extra model (FedAvg's round 2 would
    # carry no weights in RoundStart at all: under 0.7x round 1's bytes down, see test_fedavg).
    params_bytes = sum(a.nbytes for a in split_state(fed.coordinator.method.global_state)[0].values())  # fp32 floats of one model
    assert second["method"]["teachers_sent"] == 2 and second["method"]["teacher_tensor_bytes"] == 2 * params_bytes
    assert second["method"]["buffer_versions"] == [1, 0]
    assert second["bytes"]["down_payload"] > 0.85 * first["bytes"]["down_payload"]
    for agent in fed.agents:
        assert agent.method.global_version == 2
    assert fed.coordinator.method.buffer.versions() == [2, 1]

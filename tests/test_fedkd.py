"""FedKD: the adaptive losses by hand (Eqs. 1-7), the threshold schedule (Eq. 9), the
messages, the server step, and 2 agents x 2 rounds over a real mosquitto."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from cloud_server.methods import ServerContext
from cloud_server.methods.fedkd import FedKdConfig, FedKdServer
from cloud_server.report import validate_report
from edge_agent.methods.fedkd import FedKdEdge, attention_map, fedkd_losses
from models import build_model
from models.mentor import HiddenOutputs, forward_with_hidden, hidden_dim
from shared_protocol import svd
from shared_protocol.errors import ProtocolError, ShapeMismatchError, StaleMessageError, ValueRangeError
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedkd import FedKdAggregate, FedKdRoundConfig, FedKdUpdate, factor_state, unfactor_state

from fedhelpers import agent_config, in_memory_federation, mqtt_federation, server_config

# A CPU-sized pair for tests: ResNet-20 mentor (220 k parameters), ResNet-8 mentee.
FAST_KD = {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}


# --------------------------------------------------------------------------- #
# Eqs. 1-7 against hand computation
# --------------------------------------------------------------------------- #


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _ce(z: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.log(_softmax(z))[np.arange(len(y)), y]))


def _kl(a: np.ndarray, b: np.ndarray) -> float:
    """KL(a, b) = sum_i a_i log(a_i / b_i), mean over samples (the paper's definition per sample)."""
    return float(np.mean(np.sum(a * np.log(a / b), axis=1)))


def _attention(fmap: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    energy = (fmap**2).mean(axis=1)  # (B, h, w)
    b, h, w = energy.shape
    fh, fw = h // size[0], w // size[1]
    pooled = energy.reshape(b, size[0], fh, size[1], fw).mean(axis=(2, 4)).reshape(b, -1)  # average pool
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def _tiny_example() -> tuple[HiddenOutputs, HiddenOutputs, torch.Tensor, nn.Linear, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    raw = {
        "z_t": np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 1.5]]),  # mentor logits (B=2, K=3)
        "z_s": np.array([[1.0, 1.0, 0.0], [-0.5, 0.3, 0.9]]),  # mentee logits
        "h_t": rng.normal(size=(2, 4)),  # mentor hidden (D_t = 4)
        "h_s": rng.normal(size=(2, 2)),  # mentee hidden (D_s = 2)
        "f_t": rng.normal(size=(2, 3, 2, 2)),  # mentor last feature map (C=3, 2x2)
        "f_s": rng.normal(size=(2, 2, 4, 4)),  # mentee last feature map (C=2, 4x4): pooled to 2x2
        "w_h": rng.normal(size=(4, 2)),
        "b_h": rng.normal(size=4),
    }
    labels = torch.tensor([0, 2])
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in raw.items()}
    projection = nn.Linear(2, 4).double()
    with torch.no_grad():
        projection.weight.copy_(t["w_h"])
        projection.bias.copy_(t["b_h"])
    return (HiddenOutputs(t["z_t"], t["h_t"], t["f_t"]), HiddenOutputs(t["z_s"], t["h_s"], t["f_s"]), labels, projection, raw)


def test_adaptive_losses_match_hand_computation() -> None:
    mentor, mentee, labels, projection, raw = _tiny_example()
    y = labels.numpy()
    parts = fedkd_losses(mentor, mentee, labels, projection, attention=True)

    ce_t, ce_s = _ce(raw["z_t"], y), _ce(raw["z_s"], y)  # Eqs. 1, 2
    weight = 1.0 / (ce_t + ce_s)
    p_t, p_s = _softmax(raw["z_t"]), _softmax(raw["z_s"])
    distill_t = _kl(p_s, p_t) * weight  # Eq. 3: KL(y^s, y^t) / (L^t_t + L^t_s)
    distill_s = _kl(p_t, p_s) * weight  # Eq. 4: KL(y^t, y^s) / (L^t_t + L^t_s)
    projected = raw["h_s"] @ raw["w_h"].T + raw["b_h"]  # W_h H^s
    mse_h = float(np.mean((raw["h_t"] - projected) ** 2))
    mse_a = float(np.mean((_attention(raw["f_t"], (2, 2)) - _attention(raw["f_s"], (2, 2))) ** 2))
    hidden = (mse_h + mse_a) * weight  # Eq. 5

    assert parts.task_mentor.item() == pytest.approx(ce_t, rel=1e-9)
    assert parts.task_mentee.item() == pytest.approx(ce_s, rel=1e-9)
    assert parts.weight.item() == pytest.approx(weight, rel=1e-9)
    assert parts.distill_mentor.item() == pytest.approx(distill_t, rel=1e-9)
    assert parts.distill_mentee.item() == pytest.approx(distill_s, rel=1e-9)
    assert parts.hidden.item() == pytest.approx(hidden, rel=1e-9)
    assert parts.mentor.item() == pytest.approx(ce_t + distill_t + hidden, rel=1e-9)  # Eq. 6
    assert parts.mentee.item() == pytest.approx(ce_s + distill_s + hidden, rel=1e-9)  # Eq. 7: same L^h


def test_hidden_terms_can_be_switched_off() -> None:
    mentor, mentee, labels, _projection, raw = _tiny_example()
    parts = fedkd_losses(mentor, mentee, labels, projection=None, attention=False)
    y = labels.numpy()
    weight = 1.0 / (_ce(raw["z_t"], y) + _ce(raw["z_s"], y))
    assert parts.hidden.item() == 0.0
    assert parts.mentor.item() == pytest.approx(_ce(raw["z_t"], y) + weight * _kl(_softmax(raw["z_s"]), _softmax(raw["z_t"])), rel=1e-9)


def test_the_ablation_switches_drop_exactly_their_terms() -> None:
    """The paper's Fig. 2 (a model without mutual distillation learns from the labels only) and
    Fig. 3 (no adaptive weighting: the terms weighted 1), against the hand computation."""
    mentor, mentee, labels, projection, raw = _tiny_example()
    y = labels.numpy()
    ce_t, ce_s = _ce(raw["z_t"], y), _ce(raw["z_s"], y)
    full = fedkd_losses(mentor, mentee, labels, projection, attention=True)
    kl_t, kl_s = _kl(_softmax(raw["z_s"]), _softmax(raw["z_t"])), _kl(_softmax(raw["z_t"]), _softmax(raw["z_s"]))
    hidden = full.hidden.item() / full.weight.item()  # the unweighted L^h of Eq. 5
    # The mentor alone from the labels: L_t = CE; L_s untouched.
    parts = fedkd_losses(mentor, mentee, labels, projection, attention=True, mentor_distillation=False)
    assert parts.mentor.item() == pytest.approx(ce_t, rel=1e-9) and parts.distill_mentor.item() == 0.0
    assert parts.mentee.item() == pytest.approx(full.mentee.item(), rel=1e-9)
    assert torch.autograd.grad(parts.mentor, [mentee.logits, projection.weight], allow_unused=True) == (None, None)
    # The mentee alone from the labels.
    parts = fedkd_losses(mentor, mentee, labels, projection, attention=True, mentee_distillation=False)
    assert parts.mentee.item() == pytest.approx(ce_s, rel=1e-9) and parts.mentor.item() == pytest.approx(full.mentor.item(), rel=1e-9)
    # Weight 1 instead of 1 / (L^t_t + L^t_s).
    parts = fedkd_losses(mentor, mentee, labels, projection, attention=True, adaptive_weight=False)
    assert parts.weight.item() == 1.0
    assert parts.mentor.item() == pytest.approx(ce_t + kl_t + hidden, rel=1e-6)
    assert parts.mentee.item() == pytest.approx(ce_s + kl_s + hidden, rel=1e-6)
    # On the wire only when off: a default round config is what older agents accept.
    assert not set(FedKdRoundConfig.ADDED_LATER) & set(FedKdRoundConfig().to_dict())
    off = FedKdRoundConfig(mentor_distillation=False).to_dict()
    assert off["mentor_distillation"] is False and FedKdRoundConfig.from_dict(off) == FedKdRoundConfig(mentor_distillation=False)
    with pytest.raises(ValueError, match="adaptive_weight must be true or false"):
        FedKdRoundConfig(adaptive_weight=0)  # type: ignore[arg-type]
    assert FedKdConfig.from_dict({"mentee_distillation": False}).round_config(1, 0, 2).mentee_distillation is False


def test_each_model_gets_only_its_own_loss_gradient() -> None:
    """L_t reaches the mentor (and W_h) only, L_s the mentee (and W_h) only; the adaptive
    weight is a constant, so the KL term's gradient is weight * dKL."""
    mentor, mentee, labels, projection, _raw = _tiny_example()
    parts = fedkd_losses(mentor, mentee, labels, projection, attention=True)
    assert not parts.weight.requires_grad
    grads = torch.autograd.grad(parts.mentee, [mentor.logits, mentor.hidden, mentor.feature_map], allow_unused=True)
    assert all(g is None for g in grads)
    grads = torch.autograd.grad(parts.mentor, [mentee.logits, mentee.hidden, mentee.feature_map], allow_unused=True)
    assert all(g is None for g in grads)
    assert torch.autograd.grad(parts.mentor, projection.weight)[0].abs().sum() > 0
    assert torch.autograd.grad(parts.mentee, projection.weight, retain_graph=True)[0].abs().sum() > 0

    # d L^d_t / d z_t = weight * (p_t - p_s) per sample / B: no term through the task losses.
    mentor2, mentee2, labels2, _p, raw = _tiny_example()
    parts2 = fedkd_losses(mentor2, mentee2, labels2, None, attention=False)
    (grad,) = torch.autograd.grad(parts2.mentor - torch.nn.functional.cross_entropy(mentor2.logits, labels2), mentor2.logits)
    expected = parts2.weight.item() * (_softmax(raw["z_t"]) - _softmax(raw["z_s"])) / 2
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_attention_map_is_normalised_and_pooled() -> None:
    fmap = torch.rand(3, 5, 8, 8)
    a = attention_map(fmap, (4, 4))
    assert a.shape == (3, 16)
    torch.testing.assert_close(a.norm(dim=1), torch.ones(3))


def test_hidden_states_of_mentor_and_mentee() -> None:
    x = torch.randn(2, 1, 32, 32)
    for name, dim in (("resnet8", 64), ("resnet20", 256)):
        model = build_model(name, 10, 1).eval()
        out = forward_with_hidden(model, x)
        assert hidden_dim(model) == dim and out.hidden.shape == (2, dim) and out.logits.shape == (2, 10)
        with torch.no_grad():
            reference = model(x)
        reference = reference[0] if isinstance(reference, tuple) else reference
        torch.testing.assert_close(out.logits, reference)  # the same network as its own forward
    with pytest.raises(TypeError):
        forward_with_hidden(nn.Linear(2, 2), x)


# --------------------------------------------------------------------------- #
# Config and the threshold schedule (Eq. 9)
# --------------------------------------------------------------------------- #


def test_threshold_schedule_runs_from_start_to_end() -> None:
    config = FedKdConfig(schedule_rounds=5)  # defaults 0.95 -> 0.98
    assert [config.threshold(r) for r in range(1, 8)] == pytest.approx([0.95, 0.9575, 0.965, 0.9725, 0.98, 0.98, 0.98])
    assert FedKdConfig(schedule_rounds=1).threshold(1) == 0.95
    assert config.round_config(3, 2).threshold == pytest.approx(0.965)
    assert config.round_config(3, 2).global_version == 2


def test_threshold_schedule_follows_the_runs_rounds() -> None:
    """schedule_rounds = 0 (the default): Eq. 9's t runs over ServerContext.rounds; an explicit
    schedule_rounds overrides it; neither known is a clear error, not a silent horizon."""
    assert FedKdConfig().schedule_rounds == 0
    server = _server(rounds=5)
    assert [server.threshold(r) for r in range(1, 6)] == pytest.approx([0.95, 0.9575, 0.965, 0.9725, 0.98])
    assert server.resolved_config()["schedule_rounds"] == 5
    assert server.round_config(3, "a", False)[0]["threshold"] == pytest.approx(0.965)
    override = _server(rounds=5, schedule_rounds=2)
    assert [override.threshold(r) for r in range(1, 6)] == pytest.approx([0.95, 0.98, 0.98, 0.98, 0.98])
    assert override.resolved_config()["schedule_rounds"] == 2
    assert _server(rounds=0, schedule_rounds=3).threshold(2) == pytest.approx(0.965)
    with pytest.raises(ValueError, match="schedule_rounds"):
        _server(rounds=0)


@pytest.mark.parametrize("bad", [
    {"threshold_start": 0.0}, {"threshold_end": 1.2}, {"schedule_rounds": -1}, {"schedule_rounds": 2.5}, {"upload": "weights"},
    {"weighting": "median"}, {"mentor_model": "resnet55_server"}, {"mentor_model": "nope"}, {"sync_codec": "svd"},
    {"mentee_lr": 0.0}, {"gradient_lr": -1.0}, {"local_epochs": 0},
])
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        FedKdConfig.from_dict(bad)


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown"):
        FedKdConfig.from_dict({"mode": "sync"})
    with pytest.raises(ValueRangeError):
        FedKdRoundConfig.from_dict({"threshold": 0.9, "surprise": 1})
    with pytest.raises(ValueRangeError):
        FedKdRoundConfig.from_dict({"upload_codec": "zstd"})


# --------------------------------------------------------------------------- #
# Messages
# --------------------------------------------------------------------------- #


def _update_state(seed: int = 0, scale: float = 1e-2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {k: v for k, v in build_model("resnet8", 10, 1).state_dict().items() if v.dtype.is_floating_point}
    return {k: (scale * rng.normal(size=tuple(v.shape))).astype(np.float32) for k, v in state.items()}


def test_update_round_trip_and_layout() -> None:
    delta = _update_state()
    layout, factors, packed = factor_state(delta, 0.5)
    assert any(p.mode == "factored" for p in packed.values()) and any(p.mode == "dense" for p in packed.values())
    assert factors.size == sum(p.payload_elements for p in packed.values()) < sum(v.size for v in delta.values())
    msg = FedKdUpdate(run="r", round=1, sender="a", instance="i", num_samples=5, base_version=0, payload="update",
                      threshold=0.5, layout=layout, factors=factors)
    out = decode_message(encode_message(msg))
    assert isinstance(out, FedKdUpdate)
    rebuilt = unfactor_state(out.TYPE, out.layout, out.factors)
    for name, p in packed.items():
        np.testing.assert_array_equal(rebuilt[name].reconstruct(), p.reconstruct())
        assert rebuilt[name].rank == p.rank


def test_malformed_layouts_are_rejected() -> None:
    delta = {"w": np.outer(np.arange(1, 9), np.arange(1, 13)).astype(np.float32), "b": np.ones(3, np.float32)}
    layout, factors, _ = factor_state(delta, 0.9)
    assert layout[0] == ["w", [8, 12], "factored", 1]
    base = dict(run="r", round=1, sender="a", instance="i", num_samples=5, base_version=0, payload="update", threshold=0.9)
    bad_layouts = [
        [["w", [8, 12], "factored", 0], layout[1]],  # rank 0
        [["w", [8, 12], "factored", 9], layout[1]],  # rank above min(P, Q)
        [["w", [8, 12], "factored", 2], layout[1]],  # sizes no longer add up
        [layout[0], layout[0]],  # duplicate name
        [["w", [8, 12], "dense", 0], layout[1]],
        [["w", "8x12", "factored", 1], layout[1]],
        [layout[0]],
        [],
        [["w", [8, 12], "factored"], layout[1]],
        [["w", [1 << 20, 1 << 20], "factored", 1], layout[1]],  # a huge matrix from a tiny payload
    ]
    for bad in bad_layouts:
        with pytest.raises(ProtocolError):
            FedKdUpdate(**base, layout=bad, factors=factors).validate()
    good = encode_message(FedKdUpdate(**base, layout=layout, factors=factors))
    tampered = good.replace(b'"factored",1', b'"factored",2')
    with pytest.raises(ProtocolError):
        decode_message(tampered)


# --------------------------------------------------------------------------- #
# The server step
# --------------------------------------------------------------------------- #


def _server(rounds: int = 2, **config: object) -> FedKdServer:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", rounds=rounds)
    return FedKdServer(ctx, {**FAST_KD, **config})


def _upload(server: FedKdServer, agent: str, delta: dict[str, np.ndarray], samples: int, threshold: float, round_: int = 1) -> RoundEnd:
    layout, factors, packed = factor_state(delta, threshold)
    server.on_upload(agent, FedKdUpdate(run="u", round=round_, sender=agent, instance=f"i-{agent}", num_samples=samples,
                                        base_version=server.version, payload=server.config.upload, threshold=threshold,
                                        layout=layout, factors=factors))
    # As the agent reports them: Eq. 8's K of the matrices that went dense anyway.
    fallback = {name: p.eq8_rank for name, p in packed.items() if p.mode == "dense" and p.eq8_rank is not None}
    return RoundEnd(run="u", round=round_, sender=agent, num_samples=samples, instance=f"i-{agent}", metrics={"train_loss": 1.0},
                    uploads={"dense_fallback_ranks": fallback})


def test_server_averages_refactors_and_sends_what_it_applied() -> None:
    server = _server()
    before = {k: v.copy() for k, v in server.global_state.items()}
    t = server.threshold(1)
    deltas = {"a": _update_state(1), "b": _update_state(2)}
    ends = {"a": _upload(server, "a", deltas["a"], 30, t), "b": _upload(server, "b", deltas["b"], 10, t)}
    outcome = server.complete(1, ends, evaluate=True)

    assert outcome.used_agents == ["a", "b"] and server.version == 1
    assert {agent for agent, _ in outcome.downloads} == {"a", "b"}
    msg = outcome.downloads[0][1]
    assert isinstance(msg, FedKdAggregate) and (msg.base_version, msg.version, msg.threshold) == (0, 1, t)
    aggregate = unfactor_state(msg.TYPE, msg.layout, msg.factors)
    for name in before:
        # The server added exactly the factors it sent (an agent's copy stays identical) ...
        np.testing.assert_array_equal(server.global_state[name], before[name] + aggregate[name].reconstruct())
        # ... which approximate the sample-weighted mean of the rebuilt updates.
        rebuilt = {a: svd.unpack(*_roundtrip(d[name], t)).reconstruct() for a, d in deltas.items()}
        mean = 0.75 * rebuilt["a"] + 0.25 * rebuilt["b"]
        err = float(np.sum((aggregate[name].reconstruct() - mean) ** 2))
        assert err <= (1 - t) * float(np.sum(mean**2)) * 1.001 + 1e-12
    _check_round_report(server, 1, t, deltas, aggregate)
    record = server.history[-1]
    assert record["threshold"] == t and set(record["agents"]) == {"a", "b"}
    assert all(k >= 1 for k in record["aggregate"]["ranks"].values())
    # Gaussian noise has no low-rank structure: factors are never larger, but need not be smaller.
    assert record["bytes_per_agent"]["fedkd_svd"] <= record["bytes_per_agent"]["dense_mentee"] < record["bytes_per_agent"]["fedavg_mentor"]
    # Who holds what: the next RoundStart carries no weights for them, the whole mentee for a newcomer.
    assert server.round_config(2, "a", False)[1] == {}
    assert set(server.round_config(2, "c", False)[1]) == set(server.global_state)


def _float_values(model_name: str) -> int:
    return sum(v.numel() for v in build_model(model_name, 10, 1).state_dict().values() if v.dtype.is_floating_point)


def _check_round_report(server: FedKdServer, round_: int, t: float, deltas: dict[str, dict[str, np.ndarray]],
                        aggregate: dict[str, svd.SvdTensor]) -> None:
    """report.json's record["method"] of the round against ranks and sizes computed here."""
    figures = server.round_report(round_)
    json.dumps(figures, allow_nan=False)  # strict JSON as it is
    assert figures["threshold"] == t and figures["agents_used"] == len(deltas)
    uploads = {a: {name: svd.factorize(array, t) for name, array in d.items()} for a, d in deltas.items()}
    up_bytes = np.mean([sum(p.payload_bytes for p in packed.values()) for packed in uploads.values()])
    down_bytes = sum(p.payload_bytes for p in aggregate.values())
    assert figures["up_svd_bytes"] == pytest.approx(up_bytes, abs=0.05)
    assert figures["down_svd_bytes"] == down_bytes
    assert figures["fedkd_bytes"] == pytest.approx(up_bytes + down_bytes, abs=0.05)
    assert figures["dense_mentee_bytes"] == 2 * 4 * _float_values("resnet8")  # up + down, float32
    assert figures["fedavg_mentor_bytes"] == 2 * 4 * _float_values("resnet20")
    assert figures["saved_vs_dense_mentee"] == pytest.approx(1 - (up_bytes + down_bytes) / figures["dense_mentee_bytes"], abs=1e-4)
    assert figures["saved_vs_fedavg_mentor"] == pytest.approx(1 - (up_bytes + down_bytes) / figures["fedavg_mentor_bytes"], abs=1e-4)
    # One entry per matrix (vectors always go dense), with Eq. 8's K whether or not it then went dense.
    matrices = {name for name, v in server.global_state.items() if v.ndim >= 2}
    assert set(figures["ranks"]) == matrices
    conv = figures["ranks"]["extractor.conv.weight"]
    assert conv["matrix"] == "16x9" and conv["max_factored_rank"] == 5  # (16, 1, 3, 3) as 16 x 9: 5 * 26 < 144 <= 6 * 26
    rebuilt_mean = {name: svd.factorize(
        sum(w * uploads[a][name].reconstruct().astype(np.float64) for a, w in zip(deltas, (0.75, 0.25))).astype(np.float32), t)
        for name in matrices}
    for name in matrices:
        p, q = svd.matrix_shape(server.global_state[name].shape)  # type: ignore[misc]
        up = [uploads[a][name].eq8_rank for a in deltas]
        entry = figures["ranks"][name]
        assert entry["max_factored_rank"] * (p + q + 1) < p * q <= (entry["max_factored_rank"] + 1) * (p + q + 1)
        assert (entry["up_min"], entry["up_max"]) == (min(up), max(up))
        assert entry["up_mean"] == pytest.approx(float(np.mean(up)), abs=0.005)
        assert entry["up_dense"] == sum(1 for a in deltas if uploads[a][name].mode == "dense")
        assert entry["up_dense"] == sum(1 for k in up if k > entry["max_factored_rank"])
        assert entry["down"] == rebuilt_mean[name].eq8_rank and entry["down_dense"] == (aggregate[name].mode == "dense")
        if aggregate[name].mode == "factored":
            assert entry["down"] == aggregate[name].rank
        assert all(k >= 1 for k in up) and entry["down"] >= 1


def _roundtrip(array: np.ndarray, threshold: float) -> tuple[np.ndarray, tuple[int, ...], str, int]:
    p = svd.factorize(array, threshold)
    return p.values, p.shape, p.mode, p.rank


def test_server_uniform_weighting_and_gradient_mode() -> None:
    server = _server(upload="gradient", gradient_lr=0.5, weighting="uniform", threshold_start=1.0, threshold_end=1.0)
    before = {k: v.copy() for k, v in server.global_state.items()}
    grads = {"a": _update_state(3), "b": _update_state(4)}
    ends = {a: _upload(server, a, g, n, 1.0) for (a, g), n in zip(grads.items(), (30, 10))}
    server.complete(1, ends, evaluate=False)
    for name in before:  # T = 1 keeps every singular value: the step is exact up to float32
        mean = 0.5 * grads["a"][name] + 0.5 * grads["b"][name]
        step = -0.5 * mean if name in server.param_names else mean  # BatchNorm statistics: their mean change
        np.testing.assert_allclose(server.global_state[name] - before[name], step, rtol=1e-4, atol=1e-6)


def test_server_rejects_stale_and_mismatched_updates() -> None:
    server = _server()
    delta = _update_state()
    layout, factors, _ = factor_state(delta, 0.95)
    base = dict(run="u", round=1, sender="a", instance="i", num_samples=5, payload="update", threshold=0.95)
    with pytest.raises(StaleMessageError):
        server.on_upload("a", FedKdUpdate(**base, base_version=3, layout=layout, factors=factors))
    with pytest.raises(ValueRangeError):
        server.on_upload("a", FedKdUpdate(**{**base, "payload": "gradient"}, base_version=0, layout=layout, factors=factors))
    with pytest.raises(ValueRangeError, match="T = 0.98"):  # round 1's T is T_start = 0.95
        server.on_upload("a", FedKdUpdate(**{**base, "threshold": 0.98}, base_version=0, layout=layout, factors=factors))
    small = {k: v for k, v in delta.items() if "fc" not in k}
    layout2, factors2, _ = factor_state(small, 0.95)
    with pytest.raises(ShapeMismatchError):
        server.on_upload("a", FedKdUpdate(**base, base_version=0, layout=layout2, factors=factors2))
    assert server.staged == {}
    # A round_end whose update never arrived (or came from another process) is excluded.
    outcome = server.complete(1, {"a": RoundEnd(run="u", round=1, sender="a", num_samples=5, instance="i")}, evaluate=False)
    assert outcome.used_agents == [] and "a" in outcome.excluded and server.version == 0


# --------------------------------------------------------------------------- #
# End to end
# --------------------------------------------------------------------------- #


def _check_run(fed, report: dict, run_dir: Path) -> None:  # type: ignore[no-untyped-def]
    validate_report(report)
    assert report["status"] == "finished"
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for record in report["rounds"]:
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        # The deployed model is each agent's mentor (global set and own shard); the global mentee beside it.
        ev = record["evaluation"]
        assert record["accuracy"] is not None and record["local_accuracy"] is not None
        assert set(ev["accuracy"]) == {"model", "mentee"} and set(ev["local_accuracy"]) == {"model", "mentee"}
        assert set(ev["per_agent"]["agent-0"]["accuracy"]) == {"model"}  # the mentee is one global model
        assert record["edge_train_flops"] > 0
        # codec_ratio = dense update bytes / frame bytes: about 1 for a mentee this small (see docs).
        assert all(a["codec"] == "svd" and a["codec_ratio"] > 0.5 for a in record["per_agent"].values())
    server: FedKdServer = fed.coordinator.method
    # schedule_rounds is not set: Eq. 9's horizon is the run's 2 rounds (ServerContext.rounds).
    assert server.schedule_rounds == 2 and report["config"]["method_config"]["schedule_rounds"] == 2
    assert [h["threshold"] for h in server.history] == pytest.approx([0.95, 0.98])
    # report.json carries the method's figures per round: T, ranks per matrix, bytes.
    for record, h in zip(report["rounds"], server.history):
        figures = record["method"]
        assert figures["threshold"] == h["threshold"] and figures["agents_used"] == 2
        assert figures["fedkd_bytes"] < figures["dense_mentee_bytes"] < figures["fedavg_mentor_bytes"]
        assert 0 < figures["saved_vs_dense_mentee"] < figures["saved_vs_fedavg_mentor"] < 1
        assert set(figures["ranks"]) == {name for name, v in server.global_state.items() if v.ndim >= 2}
        for name, entry in figures["ranks"].items():
            ups = [a["ranks"].get(name, a["dense_fallback_ranks"].get(name)) for a in h["agents"].values()]
            assert (entry["up_min"], entry["up_max"]) == (min(ups), max(ups)) and entry["up_min"] >= 1
            assert entry["up_dense"] == sum(1 for k in ups if k > entry["max_factored_rank"])
            assert entry["down"] >= 1 and entry["down_dense"] == (entry["down"] > entry["max_factored_rank"])
    mentee_bytes = sum(v.nbytes for v in server.global_state.values())  # float32
    assert report["rounds"][0]["method"]["sync_bytes"] == 2 * mentee_bytes  # the initial mentee, once to each agent
    assert report["rounds"][1]["method"]["sync_bytes"] == 0
    summary = (run_dir / "summary.md").read_text()
    assert "## Method figures per round" in summary and "fedavg_mentor_bytes" in summary and "`ranks` in round 2:" in summary
    for h in server.history:
        for agent in h["agents"].values():
            assert all(k >= 1 for k in agent["ranks"].values())
            assert agent["svd_bytes"] <= agent["dense_bytes"]
        assert h["bytes_per_agent"]["fedkd_svd"] < h["bytes_per_agent"]["dense_mentee"] < h["bytes_per_agent"]["fedavg_mentor"]
    assert server.history[0]["sync"]["agents"] == ["agent-0", "agent-1"] and server.history[1]["sync"]["agents"] == []
    for agent in fed.agents:
        method = agent.method
        assert isinstance(method, FedKdEdge) and agent.rounds_done == [1, 2]
        # Every copy of the global mentee is the server's, bit for bit.
        assert method.global_version == server.version == 2
        for name, value in server.global_state.items():
            np.testing.assert_array_equal(method.global_state[name], value)


@pytest.mark.broker
@pytest.mark.slow
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = replace(server_config(tmp_path, run_id="kd-mq"), method="fedkd", method_config=dict(FAST_KD))
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url).start()
    report = fed.join(300)
    _check_run(fed, report, tmp_path / "run")
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(on_disk)
    assert on_disk["models"]["mentor"]["name"] == "resnet20" and on_disk["models"]["mentee"]["name"] == "resnet8"
    assert on_disk["totals"]["wire_total"] > 0


def test_gradient_mode_two_rounds_in_memory(tmp_path: Path) -> None:
    cfg = replace(server_config(tmp_path, run_id="kd-grad"), method="fedkd",
                  method_config={**FAST_KD, "upload": "gradient", "hidden_loss": False, "attention_loss": False})
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=96, test_samples=48) for i in range(2)]).start()
    report = fed.join(300)
    _check_run(fed, report, tmp_path / "run")

"""FedDistill (group distillation): each loss of Eqs. 3-10 against hand computation,
the KL identity of Sec. III-C, the edge step's plumbing (teacher, hooks, metrics),
the configs, the features/head view in ``models.heads``, and 2 agents x 2 rounds
over a real mosquitto."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cloud_server.methods import ServerContext
from cloud_server.methods.fedavg import FedAvgServer
from cloud_server.methods.feddistill import FedDistillConfig, FedDistillServer
from cloud_server.report import validate_report
from edge_agent.costs import RoundMeter
from edge_agent.methods import EdgeContext
from edge_agent.methods.feddistill import (
    FedDistillEdge,
    feddistill_loss,
    group_distillation,
    group_distillation_parts,
    rich_classes,
)
from fldata import ArrayDataset
from fldata.datasets import make_synthetic
from fldata.torch_data import make_loader
from models import build_model, get_model_spec, list_models, load_arrays_into
from models.heads import features_and_logits, linear_head
from shared_protocol.errors import ValueRangeError
from shared_protocol.messages import RoundStart
from shared_protocol.methods.fedavg import FedAvgRoundConfig, FedAvgUpdate, join_state
from shared_protocol.methods.feddistill import FedDistillRoundConfig

from fedhelpers import agent_config, method_server_config, mqtt_federation

LN = math.log


def _logits(*probs: float) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (log-probabilities are valid logits)."""
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def _cfg(**kw: Any) -> FedDistillRoundConfig:
    base = dict(alpha_t=0.0, alpha_r=0.5, alpha_f=1.0, beta_l=1.4, beta_e=0.3, beta_fc=0.3, few_sample_threshold=None)
    return FedDistillRoundConfig(**{**base, **kw})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- #
# Rich / few classes
# --------------------------------------------------------------------------- #


def test_rich_classes_use_the_share_of_the_agents_own_samples() -> None:
    # Shares 0.5, 0.3, 0.2, 0 against gamma = 1/|C| = 0.25.
    assert rich_classes(np.array([5, 3, 2, 0]), 0.25).tolist() == [True, True, False, False]
    # A share equal to gamma is not above it: few-sample (the paper: rich iff it "exceeds" gamma).
    assert rich_classes(np.array([1, 1, 2]), 0.25).tolist() == [False, False, True]
    assert rich_classes(np.array([0, 0]), 0.5).tolist() == [False, False]
    assert _cfg().threshold(10) == pytest.approx(0.1) and _cfg(few_sample_threshold=0.3).threshold(10) == 0.3


# --------------------------------------------------------------------------- #
# Eqs. 4-6 and 3 by hand
# --------------------------------------------------------------------------- #

# Teacher q^g = (0.5, 0.2, 0.2, 0.1), student q^l uniform; rich classes {0, 1}, few {2, 3}.
TEACHER = torch.stack([_logits(0.5, 0.2, 0.2, 0.1)] * 2)
STUDENT = torch.stack([_logits(0.25, 0.25, 0.25, 0.25)] * 2)
LABELS = torch.tensor([0, 3])
RICH = torch.tensor([True, True, False, False])

# Sample 0 (t = 0, a rich class): p_\t^g = 0.5, p_\t^l = 0.75; over the non-true classes
# q~^g = (0.4, 0.4, 0.2), q~^l = (1/3, 1/3, 1/3); C_r \ t = {1}, C_f \ t = {2, 3}.
TC0 = 0.5 * LN(0.5 / 0.25) + 0.5 * LN(0.5 / 0.75)
RC0 = 0.4 * LN(0.4 * 3) + 0.6 * LN(0.6 / (2 / 3))  # class 1 alone + few bin (0.6 vs 2/3)
FC0 = 0.4 * LN(0.4 * 3) + 0.2 * LN(0.2 * 3) + 0.4 * LN(0.4 * 3)  # classes 2, 3 alone + rich bin (0.4 vs 1/3)
# Sample 1 (t = 3, a few class): q_t^g = 0.1, p_\t^g = 0.9, p_\t^l = 0.75; q~^g = (5/9, 2/9, 2/9)
# over classes (0, 1, 2); C_r \ t = {0, 1}, C_f \ t = {2}.
TC1 = 0.1 * LN(0.1 / 0.25) + 0.9 * LN(0.9 / 0.75)
RC1 = 5 / 9 * LN(5 / 9 * 3) + 2 / 9 * LN(2 / 9 * 3) + 2 / 9 * LN(2 / 9 * 3)  # classes 0, 1 alone + few bin {2}
FC1 = 2 / 9 * LN(2 / 9 * 3) + 7 / 9 * LN(7 / 9 / (2 / 3))  # class 2 alone + rich bin (7/9 vs 2/3)


def test_group_distillation_parts_match_hand_computation() -> None:
    tc, rc, fc = group_distillation_parts(TEACHER, STUDENT, LABELS, RICH)
    np.testing.assert_allclose(tc.numpy(), [TC0, TC1], rtol=1e-12)
    np.testing.assert_allclose(rc.numpy(), [RC0, RC1], rtol=1e-12)
    np.testing.assert_allclose(fc.numpy(), [FC0, FC1], rtol=1e-12)
    # Eq. 3: the weighted sum, averaged over the batch.
    gd = group_distillation(TEACHER, STUDENT, LABELS, RICH, alpha_t=0.2, alpha_r=0.5, alpha_f=0.9)
    expected = np.mean([0.2 * TC0 + 0.5 * RC0 + 0.9 * FC0, 0.2 * TC1 + 0.5 * RC1 + 0.9 * FC1])
    assert float(gd) == pytest.approx(expected, rel=1e-12)


def test_group_distillation_is_zero_for_equal_distributions_and_finite_with_empty_groups() -> None:
    torch.manual_seed(0)
    z = torch.randn(6, 5)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    for rich in (torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.bool), torch.tensor([True, False, False, False, False])):
        tc, rc, fc = group_distillation_parts(z, z, labels, rich)
        assert torch.allclose(tc, torch.zeros(6), atol=1e-6) and torch.allclose(rc, torch.zeros(6), atol=1e-6)
        assert torch.allclose(fc, torch.zeros(6), atol=1e-6)
        # An empty group (all classes rich, or none, or the true class the only one of its group)
        # must not turn the gradient into NaN.
        student = torch.randn(6, 5, requires_grad=True)
        group_distillation(z, student, labels, rich, 1.0, 1.0, 1.0).backward()
        assert student.grad is not None and torch.isfinite(student.grad).all()
        assert student.grad.abs().sum() > 0


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(p * np.log(p / q)))


def test_kl_identity_of_the_paper() -> None:
    """Sec. III-C: with alpha_t = 1 and alpha_r = alpha_f = p_\\t (the teacher's non-true
    mass, per sample), GD "is equivalent to" KL(q^g || q^l).

    With Eqs. 5 and 6 as printed, RC-KD and FC-KD each carry the *other* group's
    lumped bin, so RC + FC = NCKD + KL of the binary (p~_r, p~_f) split, and the
    identity holds up to p_\\t^g times that binary KL. It is exact whenever the
    non-true classes are all in one group (the binary split is then (1, 0)).
    This test pins both facts; the issue's "alpha_t = alpha_r = alpha_f = 1 gives
    KL" is not what the paper says and is false (checked below).
    """
    rng = np.random.default_rng(7)
    k, b = 6, 8
    zt, zs = rng.normal(size=(b, k)) * 2, rng.normal(size=(b, k)) * 2
    labels = rng.integers(0, k, size=b)
    rich = np.array([True, True, False, True, False, False])
    pg = np.exp(zt) / np.exp(zt).sum(1, keepdims=True)
    pl = np.exp(zs) / np.exp(zs).sum(1, keepdims=True)
    kl = np.array([_kl(pg[i], pl[i]) for i in range(b)])
    not_true_mass = np.array([1 - pg[i, labels[i]] for i in range(b)])
    binary = []
    for i in range(b):
        nt = np.arange(k) != labels[i]
        r, f = nt & rich, nt & ~rich
        g_r, l_r = pg[i, r].sum() / pg[i, nt].sum(), pl[i, r].sum() / pl[i, nt].sum()
        binary.append(_kl(np.array([g_r, 1 - g_r]), np.array([l_r, 1 - l_r])))
    t_zt, t_zs, t_labels = torch.tensor(zt), torch.tensor(zs), torch.tensor(labels)
    tc, rc, fc = group_distillation_parts(t_zt, t_zs, t_labels, torch.tensor(rich))
    weight = torch.tensor(not_true_mass)
    per_sample = (tc + weight * rc + weight * fc).numpy()
    np.testing.assert_allclose(per_sample, kl + not_true_mass * np.array(binary), rtol=1e-10)
    assert np.all(np.array(binary) > 1e-6)  # so the difference from KL is real here
    # One group only: the identity is exact, for the batch-mean GD as well.
    for one_group in (torch.ones(k, dtype=torch.bool), torch.zeros(k, dtype=torch.bool)):
        gd = group_distillation(t_zt, t_zs, t_labels, one_group, alpha_t=1.0, alpha_r=weight, alpha_f=weight)
        assert float(gd) == pytest.approx(kl.mean(), rel=1e-10)
        # and F.kl_div agrees with our numpy KL
        ref = F.kl_div(F.log_softmax(t_zs, 1), F.log_softmax(t_zt, 1), reduction="batchmean", log_target=True)
        assert float(gd) == pytest.approx(float(ref), rel=1e-10)
    # All alphas = 1 is not KL (it drops DKD's p_\t^g weight on the non-true part).
    gd_ones = group_distillation(t_zt, t_zs, t_labels, torch.ones(k, dtype=torch.bool), 1.0, 1.0, 1.0)
    assert abs(float(gd_ones) - kl.mean()) > 1e-3


# --------------------------------------------------------------------------- #
# Eqs. 7-10 by hand
# --------------------------------------------------------------------------- #


def _linear(weight: list[list[float]], bias: list[float]) -> torch.nn.Linear:
    layer = torch.nn.Linear(len(weight[0]), len(weight), dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight, dtype=torch.float64))
        layer.bias.copy_(torch.tensor(bias, dtype=torch.float64))
    return layer


def test_feddistill_loss_matches_hand_computation() -> None:
    # D = 2 features, K = 3 classes, one sample of class 0; classes {0, 1} rich, {2} few.
    local_head = _linear([[2, 0], [0, 1], [0, 0]], [0, 0, 0])
    global_head = _linear([[0, 1], [1, 0], [0, 0]], [0, 0, 0])
    f_l = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    f_g = torch.tensor([[0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    y_ll, y_gg = local_head(f_l), global_head(f_g)  # (2, 0, 0) and (1, 0, 0)
    labels, rich = torch.tensor([0]), torch.tensor([True, True, False])
    cfg = _cfg(alpha_t=1.0, alpha_r=0.5, alpha_f=0.25, beta_l=1.4, beta_e=0.3, beta_fc=0.2)
    parts = feddistill_loss(f_l, y_ll, local_head, f_g, y_gg, global_head, labels, rich, cfg)

    e = math.e
    ce = LN(e**2 + 2) - 2  # CE((2, 0, 0), 0)
    # L_L = GD(softmax(1,0,0) || softmax(2,0,0)): the non-true classes are uniform in both,
    # so RC-KD = FC-KD = 0 and only TC-KD remains.
    qg, ql = e / (e + 2), e**2 / (e**2 + 2)
    local = 1.0 * (qg * LN(qg / ql) + (1 - qg) * LN((1 - qg) / (1 - ql)))
    # L_E: local features (1, 0) through the global classifier give (0, 1, 0).
    extractor = LN(2 + e)
    # L_FC = GD(softmax(1,0,0) || softmax(0,1,0)) (global features (0, 1) through the local classifier).
    ql_t = 1 / (e + 2)
    tc = qg * LN(qg / ql_t) + (1 - qg) * LN((1 - qg) / (1 - ql_t))
    # non-true classes (1, 2): q~^g = (1/2, 1/2), q~^l = (e, 1)/(e + 1); class 1 rich, class 2 few.
    a, b = 0.5 * LN(0.5 * (e + 1) / e), 0.5 * LN(0.5 * (e + 1))
    rc, fc = a + b, b + a  # RC: class 1 + few bin {2}; FC: class 2 + rich bin {1}
    classifier = 1.0 * tc + 0.5 * rc + 0.25 * fc
    assert float(parts.ce.detach()) == pytest.approx(ce, rel=1e-12)
    assert float(parts.local.detach()) == pytest.approx(local, rel=1e-12)
    assert float(parts.extractor.detach()) == pytest.approx(extractor, rel=1e-12)
    assert float(parts.classifier.detach()) == pytest.approx(classifier, rel=1e-12)
    assert float(parts.total.detach()) == pytest.approx(ce + 1.4 * local + 0.3 * extractor + 0.2 * classifier, rel=1e-12)


def test_feddistill_gradients_reach_only_what_each_term_trains() -> None:
    torch.manual_seed(1)
    local_head, global_head = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    f_l = torch.randn(5, 4, requires_grad=True)
    f_g = torch.randn(5, 4, requires_grad=True)
    labels, rich = torch.tensor([0, 1, 2, 0, 1]), torch.tensor([True, False, True])
    cfg = _cfg(alpha_t=0.3)

    def grads(term: str) -> dict[str, torch.Tensor | None]:
        for t in (f_l, f_g, *local_head.parameters(), *global_head.parameters()):
            t.grad = None
        y_ll = local_head(f_l)
        parts = feddistill_loss(f_l, y_ll.detach(), local_head, f_g, global_head(f_g), global_head, labels, rich, cfg)
        getattr(parts, term).backward()
        return {"f_l": f_l.grad, "f_g": f_g.grad, "local_head": local_head.weight.grad, "global_head": global_head.weight.grad}

    # L_E (Eq. 8) trains the local extractor through the frozen global classifier.
    g = grads("extractor")
    assert g["f_l"] is not None and g["f_l"].abs().sum() > 0
    assert g["f_g"] is None and g["local_head"] is None and g["global_head"] is None
    # L_FC (Eq. 9) trains the local classifier on the (constant) global features.
    g = grads("classifier")
    assert g["local_head"] is not None and g["local_head"].abs().sum() > 0
    assert g["f_g"] is None and g["f_l"] is None and g["global_head"] is None


# --------------------------------------------------------------------------- #
# models.heads
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", [n for n in list_models() if get_model_spec(n).input_kind == "image"])
def test_features_and_logits_is_the_models_own_forward(name: str) -> None:
    """Every full model of the registry can be FedDistill's (and has the cut Fig. 4 needs)."""
    torch.manual_seed(0)
    model = build_model(name, 10, 1).eval()
    x = torch.randn(3, 1, 28, 28)  # Fashion-MNIST's size (the ConvNets need at least 18 x 18)
    with torch.no_grad():
        features, logits = features_and_logits(model, x)
        out = model(x)
        own = out[0] if isinstance(out, tuple) else out
        head = linear_head(model)
        assert features.shape == (3, head.in_features) and logits.shape == (3, 10)
        assert torch.equal(logits, own)
        assert torch.equal(head(features), logits)


def test_features_and_logits_refuses_a_model_without_the_split() -> None:
    with pytest.raises(TypeError, match="linear head view"):
        linear_head(build_model("resnet55_server", 10, 1))


# --------------------------------------------------------------------------- #
# Configs
# --------------------------------------------------------------------------- #

CTX = ServerContext(run_id="u", num_classes=4, in_channels=1, device="cpu", seed=0)


def test_configs_validate_and_the_round_config_travels() -> None:
    defaults = FedDistillConfig()
    assert (defaults.alpha_t, defaults.alpha_r, defaults.alpha_f) == (0.0, 0.5, 1.0)
    assert (defaults.beta_l, defaults.beta_e, defaults.beta_fc, defaults.few_sample_threshold) == (1.4, 0.3, 0.3, None)
    with pytest.raises(ValueError, match=r"unknown \[feddistill\]"):
        FedDistillConfig.from_dict({"alpha": 1.0})
    with pytest.raises(ValueError, match="alpha_r"):
        FedDistillConfig(alpha_r=-0.1)
    with pytest.raises(ValueError, match="few_sample_threshold"):
        FedDistillConfig(few_sample_threshold=1.5)
    with pytest.raises(ValueError, match="beta_l"):
        FedDistillConfig(beta_l=float("nan"))
    server = FedDistillServer(CTX, {"model": "resnet8", "alpha_t": 0.1, "few_sample_threshold": 0.2})
    config, weights = server.round_config(1, "agent-0", evaluate=False)
    assert weights and FedDistillRoundConfig.from_dict(config["feddistill"]) == _cfg(alpha_t=0.1, few_sample_threshold=0.2)
    # The rest is FedAvg's round config, unchanged.
    FedAvgRoundConfig.from_dict({k: v for k, v in config.items() if k != "feddistill"})
    for bad in ({**config["feddistill"], "gamma": 0.1}, {k: v for k, v in config["feddistill"].items() if k != "beta_e"},
                {**config["feddistill"], "alpha_f": True}, "alpha_f=1"):
        with pytest.raises(ValueRangeError):
            FedDistillRoundConfig.from_dict(bad)
    # An agent pays one teacher forward more per sample than under FedAvg.
    fedavg = FedAvgServer(CTX, {"model": "resnet8"}).model_info()["edge"]["train_flops_per_sample"]
    assert server.model_info()["edge"]["train_flops_per_sample"] > fedavg


# --------------------------------------------------------------------------- #
# The edge step, without a transport
# --------------------------------------------------------------------------- #


def _skewed_shard() -> ArrayDataset:
    """20 samples of 4 classes with counts (10, 6, 4, 0): rich {0, 1} at gamma = 1/4."""
    ds = make_synthetic(48, num_classes=4, in_channels=1, size=8, seed=3)
    keep = np.concatenate([np.flatnonzero(ds.labels == c)[:n] for c, n in ((0, 10), (1, 6), (2, 4))])
    return ArrayDataset(images=ds.images[keep], labels=ds.labels[keep], sample_ids=ds.sample_ids[keep], num_classes=4, name=ds.name)


def test_edge_round_trains_against_the_received_global_model() -> None:
    train = _skewed_shard()
    sent: list[Any] = []
    ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="i", train=train, test=train,
                      settings={"num_classes": 4, "model": "resnet8"}, send=lambda msg, meter, codecs=None: sent.append(msg))
    edge = FedDistillEdge(ctx)
    server = FedDistillServer(CTX, {"model": "resnet8", "batch_size": 64, "optimizer": "sgd", "lr": 0.05, "alpha_t": 0.5})
    config, weights = server.round_config(1, "agent-0", evaluate=False)
    start = RoundStart(run="u", round=1, sender="server", method="feddistill", config=config, deadline_s=60.0, weights=weights)

    # What the loss must be on the one batch of this round (before the step): computed here
    # directly from the two models, with no hooks.
    global_state = join_state(weights, config["int_buffers"])
    local = build_model("resnet8", 4, 1)
    load_arrays_into(local, global_state)
    teacher = copy.deepcopy(local).eval()
    images, labels, _ = next(iter(make_loader(train, 64)))
    local.train()
    f_l, y_ll = features_and_logits(local, images)
    with torch.no_grad():
        f_g, y_gg = features_and_logits(teacher, images)
    rich = torch.tensor([True, True, False, False])
    expected = feddistill_loss(f_l, y_ll, linear_head(local), f_g, y_gg, linear_head(teacher), labels, rich,
                               FedDistillRoundConfig.from_dict(config["feddistill"]))

    result = edge.run_round(start, RoundMeter())
    assert result.metrics["few_sample_classes"] == 2
    for key, part in (("loss_ce", expected.ce), ("loss_local_gd", expected.local), ("loss_extractor_ce", expected.extractor),
                      ("loss_classifier_gd", expected.classifier)):
        assert result.metrics[key] == pytest.approx(float(part.detach()), rel=1e-4, abs=1e-6), key
    assert result.metrics["train_loss"] == pytest.approx(float(expected.total.detach()), rel=1e-4)
    # The teacher is the round's global model, untouched by training; the local model moved.
    for name, value in edge.teacher.state_dict().items():
        assert torch.equal(value, torch.as_tensor(global_state[name])), name
    assert not torch.equal(edge.model.state_dict()["classifier.fc.weight"], edge.teacher.state_dict()["classifier.fc.weight"])
    assert not any(p.requires_grad for p in edge.teacher.parameters())
    (update,) = sent
    assert isinstance(update, FedAvgUpdate) and update.num_samples == 20 and update.model_version == 0


def test_edge_refuses_a_round_without_its_config() -> None:
    train = _skewed_shard()
    ctx = EdgeContext(agent_id="agent-0", run_id="u", instance="i", train=train, test=train,
                      settings={"num_classes": 4, "model": "resnet8"}, send=lambda *a, **k: None)
    edge = FedDistillEdge(ctx)
    config, weights = FedAvgServer(CTX, {"model": "resnet8"}).round_config(1, "agent-0", evaluate=False)
    start = RoundStart(run="u", round=1, sender="server", method="feddistill", config=config, deadline_s=60.0, weights=weights)
    with pytest.raises(ValueRangeError, match="feddistill"):
        edge.run_round(start, RoundMeter())
    bad = {**config, "feddistill": {**_cfg().to_dict(), "alpha_t": -1}}
    with pytest.raises(ValueRangeError, match="alpha_t"):
        edge.run_round(replace(start, config=bad), RoundMeter())


# --------------------------------------------------------------------------- #
# 2 agents x 2 rounds over a real mosquitto
# --------------------------------------------------------------------------- #


@pytest.mark.broker
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "feddistill", {"model": "resnet8", "batch_size": 32}, run_id="fd-mq")
    # Non-iid shards, so each agent has its own rich and few classes.
    agents = [agent_config(cfg.run_id, i, 2) for i in range(2)]
    agents = [replace(a, data=replace(a.data, partition="dirichlet:0.5")) for a in agents]
    fed = mqtt_federation(cfg, agents, mosquitto.url).start()
    fed.join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["method"] == "feddistill"
    assert report["models"]["server"] is None
    assert report["config"]["method_config"]["beta_l"] == 1.4
    for record in report["rounds"]:
        assert record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 160 and record["accuracy"] is not None
        figures = record["method"]
        assert figures["loss_ce"] > 0 and figures["loss_extractor_ce"] > 0
        assert figures["loss_local_gd"] >= 0 and figures["loss_classifier_gd"] >= 0
        assert 0 <= figures["few_sample_classes"] <= 10
    for agent in fed.agents:
        assert agent.method.global_version == 2 and agent.method.name == "feddistill"
    assert fed.coordinator.method.version == 2

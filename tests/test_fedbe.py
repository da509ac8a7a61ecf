"""FedBE: the global model distribution (Eq. 5 / Eq. 7), the ensemble (Eq. 4), SWA
distillation, the server's held-out unlabeled set, the server step, and
2 agents x 2 rounds over a real mosquitto."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cloud_server.aggregation import fit_diagonal_gaussian, sample_dirichlet, sample_gaussian, weighted_mean
from cloud_server.methods import ServerContext, get_server_method
from cloud_server.methods.fedbe import FedBEConfig, FedBEServer, distill_swa, load_server_data
from models.losses import ensemble_probabilities, soft_cross_entropy
from models.swa import SwaAverage, recompute_bn_statistics, swa_collects_after, swa_learning_rate
from cloud_server.report import validate_report
from edge_agent.agent import load_agent_data
from edge_agent.methods import get_edge_method
from edge_agent.methods.fedavg import FedAvgEdge
from models import build_model, state_dict_to_arrays
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedavg import FedAvgUpdate, split_state

from fedhelpers import agent_config, method_server_config, mqtt_federation

CTX = ServerContext(run_id="u", num_classes=10, in_channels=3, device="cpu", seed=0)
# A server step small enough for a unit test: ResNet-8, 64 unlabeled synthetic images.
TINY = {
    "model": "resnet8", "batch_size": 32, "unlabeled_dataset": "synthetic", "agent_train_samples": 160,
    "unlabeled_samples": 64, "sampled_models": 2, "distill_steps": 6, "distill_batch_size": 16,
    "swa_warmup_steps": 2, "swa_cycle_steps": 2,
}


def _states(k: int, shape: tuple[int, ...] = (40,), seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(loc=i, scale=1 + i, size=shape).astype(np.float32),
             "b": rng.normal(size=(3,)).astype(np.float32)} for i in range(k)]


# -- the global model distribution ---------------------------------------------------------- #


def test_gaussian_fit_is_eq5() -> None:
    states, counts = _states(3), [10, 30, 60]
    mean, variance = fit_diagonal_gaussian(states, counts, ["w", "b"])
    p = np.asarray(counts, dtype=np.float64) / 100
    for name in ("w", "b"):
        mu = sum(pi * s[name].astype(np.float64) for pi, s in zip(p, states))
        var = sum(pi * (s[name].astype(np.float64) - mu) ** 2 for pi, s in zip(p, states))
        np.testing.assert_allclose(mean[name], mu, rtol=1e-12)
        np.testing.assert_allclose(variance[name], var, rtol=1e-12)
    # Only the named entries are fitted (BN buffers are recomputed, not sampled).
    assert set(fit_diagonal_gaussian(states, counts, ["w"])[0]) == {"w"}


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_gaussian_samples_have_the_fitted_mean_and_variance(scale: float) -> None:
    states, counts = _states(4), [5, 15, 30, 50]
    mean, variance = fit_diagonal_gaussian(states, counts, ["w"])
    rng = np.random.default_rng(1234)
    n = 4000
    draws = np.stack([sample_gaussian(mean, variance, rng, scale)["w"] for _ in range(n)])  # (n, 40)
    target_var = scale * variance["w"]
    assert np.all(target_var > 0.05)  # the clients differ: a real spread to recover
    # Sample mean: each element's z-score is N(0, 1) under the fitted distribution.
    z = (draws.mean(axis=0) - mean["w"]) / np.sqrt(target_var / n)
    assert np.max(np.abs(z)) < 4.5
    assert 0.5 < np.mean(z**2) < 1.6
    # Sample variance: relative error ~ sqrt(2 / n) = 2.2% per element.
    ratio = draws.var(axis=0, ddof=1) / target_var
    assert np.all(np.abs(ratio - 1) < 0.11)
    assert abs(ratio.mean() - 1) < 0.02
    # Independent draws across elements (a diagonal covariance): correlations are noise.
    corr = np.corrcoef(draws[:, :10].T)[np.triu_indices(10, 1)]
    assert np.max(np.abs(corr)) < 0.08


def test_dirichlet_sample_is_eq7_a_convex_combination() -> None:
    states, counts = _states(3), [10, 30, 60]
    rng = np.random.default_rng(7)
    sample, gamma = sample_dirichlet(states, counts, 0.5, rng)
    assert gamma.shape == (3,) and np.all(gamma >= 0) and math.isclose(gamma.sum(), 1.0)
    coef = gamma * np.asarray(counts) / np.sum(gamma * np.asarray(counts))
    for name in ("w", "b"):
        expected = sum(c * s[name].astype(np.float64) for c, s in zip(coef, states))
        np.testing.assert_allclose(sample[name], expected, rtol=1e-5, atol=1e-6)
    # Many draws of gamma ~ Dir(alpha * 1): mean 1/K per client.
    gammas = np.stack([sample_dirichlet(states, counts, 2.0, rng)[1] for _ in range(3000)])
    np.testing.assert_allclose(gammas.mean(axis=0), np.full(3, 1 / 3), atol=0.015)


# -- the ensemble and distillation ----------------------------------------------------------- #


def test_ensemble_is_the_mean_of_softmax_probabilities() -> None:
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]],
                           [[math.log(3.0), 0.0], [0.0, 2.0]]])  # (M'=2, B=2, K=2)
    probs = ensemble_probabilities(logits)
    # Sample 0: (0.5, 0.5) and (0.75, 0.25) -> (0.625, 0.375); sample 1 is symmetric -> (0.5, 0.5).
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375], [0.5, 0.5]]))
    # Not the softmax of the mean logits (that would be about (0.634, 0.366) for sample 0).
    assert not torch.allclose(probs, F.softmax(logits.mean(0), dim=-1), atol=1e-3)
    with pytest.raises(ValueError, match="models, batch, classes"):
        ensemble_probabilities(logits[0])


def test_soft_cross_entropy_is_the_paper_loss() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 4), F.softmax(torch.randn(5, 4), dim=-1)
    expected = -(targets * torch.log(F.softmax(logits, dim=-1))).sum(1).mean()
    torch.testing.assert_close(soft_cross_entropy(logits, targets), expected)
    labels = torch.tensor([0, 3, 1, 2, 2])
    torch.testing.assert_close(soft_cross_entropy(logits, F.one_hot(labels, 4).float()), F.cross_entropy(logits, labels))


def test_swa_schedule_and_collection_points() -> None:
    lr = [swa_learning_rate(s, warmup_steps=3, cycle_steps=4, lr_max=1e-3, lr_min=4e-4) for s in range(1, 12)]
    assert lr[:3] == [1e-3] * 3  # warm-up
    np.testing.assert_allclose(lr[3:7], [8.5e-4, 7e-4, 5.5e-4, 4e-4])  # a cycle: linear down to lr_min
    np.testing.assert_allclose(lr[7], 8.5e-4)  # the jump back up
    assert [s for s in range(1, 16) if swa_collects_after(s, 3, 4)] == [7, 11, 15]  # ends of cycles
    assert FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=1, distill_steps=15,
                       swa_warmup_steps=3, swa_cycle_steps=4).swa_models_per_round == 3


def test_swa_average_is_the_mean_of_the_collected_weights() -> None:
    states = _states(5, shape=(2, 3), seed=3)
    for s, counter in zip(states, (1, 2, 4, 4, 6)):
        s["n"] = np.asarray(counter, dtype=np.int64)
    swa = SwaAverage()
    for s in states:
        swa.add(s)
    avg = swa.average()
    assert swa.count == 5 and avg["w"].dtype == np.float32 and avg["n"].dtype == np.int64
    np.testing.assert_allclose(avg["w"], np.mean([s["w"] for s in states], axis=0), rtol=1e-6)
    np.testing.assert_allclose(avg["b"], np.mean([s["b"] for s in states], axis=0), rtol=1e-6)
    assert int(avg["n"]) == 3  # rint(17 / 5)


class _TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))  # (B, 3)


def test_distill_swa_ends_with_the_mean_of_the_collected_models_and_fresh_bn_statistics() -> None:
    torch.manual_seed(0)
    model, images = _TinyNet(), torch.randn(40, 3, 8, 8) * 2 + 1
    targets = F.softmax(torch.randn(40, 3) * 3, dim=-1)
    cfg = FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=1, distill_steps=11, distill_batch_size=8,
                      swa_warmup_steps=3, swa_cycle_steps=4, swa_lr_max=0.05, swa_lr_min=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    snapshots: list[dict[str, np.ndarray]] = []
    result = distill_swa(model, images, targets, cfg, torch.Generator().manual_seed(0), snapshots=snapshots)
    assert result.failed is None and result.steps == 11 and result.swa_models == 2 == len(snapshots)  # after steps 7 and 11
    assert not np.allclose(snapshots[0]["fc.weight"], before["fc.weight"].numpy())  # it trained
    for name, param in model.named_parameters():
        expected = np.mean([s[name] for s in snapshots], axis=0)
        np.testing.assert_allclose(param.detach().numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=name)
    # BN statistics were recomputed for the averaged weights over the whole set, not averaged.
    probe = _TinyNet()
    probe.load_state_dict(model.state_dict())
    recompute_bn_statistics(probe, images, batch_size=40)  # one batch: the exact statistics
    torch.testing.assert_close(model.bn.running_mean, probe.bn.running_mean, rtol=1e-4, atol=1e-5)
    assert math.isfinite(result.mean_loss)


def test_distillation_fails_at_the_first_non_finite_loss_with_the_models_collected_before_it() -> None:
    """Losses stay on the device between collections; a NaN is still reported at its own step."""
    torch.manual_seed(0)
    model, images = _TinyNet(), torch.randn(40, 3, 8, 8)
    targets = F.softmax(torch.randn(40, 3), dim=-1)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))  # the first epoch's order
    targets[order[4 * 8 + 1]] = float("nan")  # a sample of step 5's batch
    cfg = FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=1, distill_steps=11, distill_batch_size=8,
                      swa_warmup_steps=3, swa_cycle_steps=1, swa_lr_max=0.05, swa_lr_min=0.01)
    snapshots: list[dict[str, np.ndarray]] = []
    result = distill_swa(model, images, targets, cfg, torch.Generator().manual_seed(0), snapshots=snapshots)
    assert result.failed is not None and "at step 5" in result.failed and "nan" in result.failed
    assert result.steps == 5 and result.swa_models == 1 == len(snapshots)  # collected after step 4 only
    assert math.isnan(result.mean_loss)


def test_distillation_reuses_its_step_across_rounds_with_a_fresh_optimiser() -> None:
    torch.manual_seed(0)
    model, images = _TinyNet(), torch.randn(40, 3, 8, 8)
    targets = F.softmax(torch.randn(40, 3), dim=-1)
    cfg = FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=1, distill_steps=6, distill_batch_size=8,
                      swa_warmup_steps=2, swa_cycle_steps=2, swa_lr_max=0.05, swa_lr_min=0.01)
    first = distill_swa(model, images, targets, cfg, torch.Generator().manual_seed(0))
    optimizer_of_round_1 = first.trainer.optimizer
    second = distill_swa(model, images, targets, cfg, torch.Generator().manual_seed(1), trainer=first.trainer)
    assert second.trainer is first.trainer and second.failed is None
    assert first.trainer.optimizer is not optimizer_of_round_1  # SWA starts each round with a fresh SGD
    assert first.trainer.steps["eager"] == 12
    with pytest.raises(ValueError, match="another model"):
        distill_swa(_TinyNet(), images, targets, cfg, torch.Generator().manual_seed(0), trainer=first.trainer)


def test_distillation_moves_the_student_towards_the_ensemble() -> None:
    torch.manual_seed(1)
    model, images = _TinyNet(), torch.randn(64, 3, 8, 8)
    targets = F.one_hot(torch.randint(0, 3, (64,)), 3).float() * 0.9 + 0.1 / 3
    model.eval()
    with torch.no_grad():
        before = float(soft_cross_entropy(model(images), targets))
    cfg = FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=1, distill_steps=120, distill_batch_size=16,
                      swa_warmup_steps=60, swa_cycle_steps=10, swa_lr_max=0.1, swa_lr_min=0.02)
    distill_swa(model, images, targets, cfg, torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        after = float(soft_cross_entropy(model(images), targets))
    assert after < before - 0.05


# -- the server's data ---------------------------------------------------------------------- #


def test_train_holdout_never_overlaps_the_agents_data() -> None:
    cfg = FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=160, unlabeled_samples=300, validation_samples=50)
    unlabeled, validation = load_server_data(cfg, seed=0)
    assert validation is not None and len(unlabeled) == 300 and len(validation) == 50
    agent_ids: set[int] = set()
    for i in range(3):  # the agents of a local simulation with the same settings (any partition)
        train, _test = load_agent_data(agent_config("r", i, 3, train_samples=160))
        agent_ids |= set(train.sample_ids.tolist())
    assert len(agent_ids) == 160
    assert not agent_ids & set(unlabeled.sample_ids.tolist())
    assert not agent_ids & set(validation.sample_ids.tolist())
    assert not set(unlabeled.sample_ids.tolist()) & set(validation.sample_ids.tolist())
    # The agents' data seed is the server's unless given: another seed holds out other samples.
    other, _ = load_server_data(FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=160, unlabeled_samples=0,
                                            agent_data_seed=5), seed=0)
    assert len(other) == 5000 - 160 and set(other.sample_ids.tolist()) & agent_ids
    # A whole split of a dataset: the test split's ids.
    test_split, _ = load_server_data(FedBEConfig(unlabeled_dataset="synthetic", unlabeled_split="test", unlabeled_samples=100), seed=0)
    assert len(test_split) == 100 and test_split.sample_ids.min() >= 10_000_000


def test_configs_validate() -> None:
    with pytest.raises(ValueError, match="unlabeled_dataset is required"):
        FedBEConfig()
    with pytest.raises(ValueError, match="agent_train_samples"):
        FedBEConfig(unlabeled_dataset="synthetic")
    with pytest.raises(ValueError, match="collect no model"):
        FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=10, distill_steps=10, swa_warmup_steps=5, swa_cycle_steps=6)
    with pytest.raises(ValueError, match="posterior"):
        FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=10, posterior="laplace")
    with pytest.raises(ValueError, match="swa_lr_min"):
        FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=10, swa_lr_min=1e-2)
    with pytest.raises(ValueError, match="ensemble is empty"):
        FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=10, sampled_models=0, ensemble_weight_average=False, ensemble_clients=False)
    with pytest.raises(ValueError, match="unknown"):
        FedBEConfig.from_dict({**TINY, "sampled_modles": 3})
    with pytest.raises(ValueError, match="feature maps"):  # FedAvg's checks still apply
        FedBEConfig(unlabeled_dataset="synthetic", agent_train_samples=10, model="resnet55_server")
    with pytest.raises(ValueError, match="nothing is left"):
        FedBEServer(CTX, {**TINY, "agent_train_samples": 5000})
    with pytest.raises(ValueError, match="channels"):
        FedBEServer(ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu"), TINY)


# -- the server step ------------------------------------------------------------------------- #


def _client_state(seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    state = state_dict_to_arrays(build_model("resnet8", 10, 3))
    return state


def _update(agent: str, state: dict[str, np.ndarray], n: int) -> FedAvgUpdate:
    weights, ints = split_state(state)
    msg = FedAvgUpdate(run="u", round=1, sender=agent, instance=f"{agent}-i", num_samples=n, model_version=0, int_buffers=ints, weights=weights)
    return decode_message(encode_message(msg))  # type: ignore[return-value]


def test_server_step_ensembles_distils_and_reports() -> None:
    assert get_server_method("fedbe") is FedBEServer
    assert issubclass(get_edge_method("fedbe"), FedAvgEdge)
    server = FedBEServer(CTX, TINY)
    assert len(server.unlabeled) == 64 and server.validation is None
    states, counts = [_client_state(1), _client_state(2)], [60, 100]
    for k, (state, n) in enumerate(zip(states, counts)):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", state, n))
    ends = {f"agent-{k}": RoundEnd(run="u", round=1, sender=f"agent-{k}", num_samples=n, instance=f"agent-{k}-i") for k, n in enumerate(counts)}
    outcome = server.complete(1, ends, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"] and server.version == 1
    report = server.round_report(1)
    assert report["ensemble_size"] == 1 + 2 + 2 and report["sampled_models"] == 2 and report["clients"] == 2
    assert report["distill_steps"] == 6 and report["swa_models"] == 2 and report["distill_failed"] is None
    assert report["accuracy_set"] == "unlabeled" and report["unlabeled_samples"] == 64
    for key in ("weight_average_accuracy", "distilled_accuracy", "pseudo_label_accuracy", "client_accuracy_mean", "sampled_accuracy_mean"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["server_flops"] > 0 and report["server_time_s"]["total"] > 0 and report["mean_std"] > 0
    json.dumps(report, allow_nan=False)  # goes into report.json as is
    # The global model is the distilled one, not the weight average.
    average = weighted_mean(states, counts)
    assert set(server.global_state) == set(average)
    assert not np.allclose(server.global_state["classifier.fc.weight"], average["classifier.fc.weight"])
    assert server.round_report(2) == {}
    info = server.model_info()
    assert info["server"]["name"] == "resnet8" and info["server"]["train_flops_per_sample"] > 0


def test_dirichlet_server_with_a_validation_split() -> None:
    server = FedBEServer(CTX, {**TINY, "posterior": "dirichlet", "dirichlet_alpha": 0.5, "validation_samples": 32, "ensemble_clients": False})
    assert server.validation is not None and len(server.validation) == 32
    new = server.aggregate(1, [_client_state(3), _client_state(4)], [10, 30])
    report = server.round_report(1)
    assert report["posterior"] == "dirichlet" and report["ensemble_size"] == 1 + 2 and report["accuracy_set"] == "validation"
    assert 1 / 2 <= report["gamma_max_mean"] <= 1.0
    assert all(np.isfinite(a).all() for a in new.values() if a.dtype.kind == "f")


# -- end to end ------------------------------------------------------------------------------- #


@pytest.mark.broker
def test_two_agents_two_rounds_over_mosquitto(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "fedbe", {**TINY}, run_id="fb-mq")
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url).start()
    fed.join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["method"] == "fedbe"
    assert report["config"]["method_config"]["posterior"] == "gaussian"
    assert report["models"]["server"]["name"] == "resnet8"
    for number, record in enumerate(report["rounds"], start=1):
        assert record["round"] == number and record["status"] == "ok" and record["completed"] == ["agent-0", "agent-1"]
        assert record["accuracy"] is not None  # the distilled model on the agents' test shards
        figures = record["method"]
        assert figures["ensemble_size"] == 5 and figures["swa_models"] == 2 and figures["distill_steps"] == 6
        assert figures["distilled_accuracy"] is not None and figures["server_time_s"]["distill"] > 0
    for agent in fed.agents:
        assert type(agent.method).name == "fedbe" and agent.method.global_version == 2
    assert fed.coordinator.method.version == 2

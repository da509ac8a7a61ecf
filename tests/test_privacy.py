"""Differential privacy (cloud_server/privacy.py, edge_agent/privacy.py): ε from Opacus's
accountant pinned to published figures, the scale of the clipping and of the noise (with
positive controls), the refusals, and DP-FedAvg and DP-SGD end to end over mosquitto."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cloud_server.experiments.results import run_figures
from cloud_server.methods import ServerContext
from cloud_server.methods.fedavg import FedAvgServer
from cloud_server.privacy import PrivacyConfig, PrivacyLedger, client_level_epsilon
from cloud_server.report import validate_report
from edge_agent.privacy import privatise_state
from models import build_model, cached_flops_per_sample
from models.layer_flops import weight_gradient_flops_per_sample
from models.privacy import DpSgdModelError, require_dpsgd_model
from shared_protocol.privacy import DpAgentSettings, clip_update

from fedhelpers import agent_config, method_server_config, mqtt_federation

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)

# TF-Privacy's tutorials/README.md, "Select Parameters": DP-SGD on MNIST (60,000 examples),
# batch 256, delta 1e-5: (noise multiplier, epochs, published epsilon).
TF_PRIVACY_TABLE = [(1.12, 60, 2.92), (0.6, 30, 9.74), (1.2, 10, 1.20)]


def _std_matches(samples: np.ndarray, std: float, tolerance: float = 0.01) -> bool:
    """The sample's standard deviation is within ``tolerance`` (relative) of ``std`` and its mean
    within 6 standard errors of 0 (an N(0, std^2) sample of this size)."""
    return abs(samples.std() / std - 1) < tolerance and abs(samples.mean()) < 6 * std / np.sqrt(samples.size)


# --------------------------------------------------------------------------- #
# ε
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("noise, epochs, published", TF_PRIVACY_TABLE)
def test_the_accountant_reproduces_tf_privacys_published_epsilon(noise: float, epochs: int, published: float) -> None:
    """Opacus's RDP of the subsampled Gaussian is TF-Privacy's: converted to (ε, δ) as TF-Privacy
    converted it (Mironov 2017, Prop. 3: ε = min over orders of RDP - log δ / (α - 1), on
    TF-Privacy's orders) it gives the published ε; the ε reported here uses Opacus's tighter
    conversion (Balle et al. 2020), so it is below the published figure, and pinned."""
    from opacus.accountants.analysis.rdp import compute_rdp

    q, steps, delta = 256 / 60000, int(epochs * 60000 / 256), 1e-5
    orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    rdp = compute_rdp(q=q, noise_multiplier=noise, steps=steps, orders=orders)
    assert float(np.min(rdp - np.log(delta) / (orders - 1))) == pytest.approx(published, abs=0.015)
    reported = client_level_epsilon(noise, q, steps, delta)
    assert 0.7 * published < reported < published
    pinned = {1.12: 2.519, 0.6: 8.769, 1.2: 0.932}[noise]  # Opacus 1.6's RDP accountant
    assert reported == pytest.approx(pinned, abs=0.01)


def test_epsilon_grows_with_rounds_and_falls_with_noise_and_sampling() -> None:
    base = client_level_epsilon(1.0, 0.5, 10, 1e-5)
    assert client_level_epsilon(1.0, 0.5, 20, 1e-5) > base
    assert client_level_epsilon(2.0, 0.5, 10, 1e-5) < base
    assert client_level_epsilon(1.0, 0.1, 10, 1e-5) < base
    assert client_level_epsilon(1.0, 0.5, 0, 1e-5) == 0.0
    assert client_level_epsilon(1.0, 0.5, 10, 1e-5, "prv") == pytest.approx(base, rel=0.25)  # another accountant, close


# --------------------------------------------------------------------------- #
# Clipping and noise have the stated scale
# --------------------------------------------------------------------------- #


def test_clipping_scales_a_long_update_to_c_and_leaves_a_short_one() -> None:
    rng = np.random.default_rng(0)
    update = {"a": rng.normal(size=(30, 20)), "b": rng.normal(size=50)}
    clipped, norm = clip_update(update, 2.0)
    assert norm > 2.0
    assert np.sqrt(sum(np.sum(v**2) for v in clipped.values())) == pytest.approx(2.0, rel=1e-12)
    assert np.allclose(clipped["a"] / update["a"], 2.0 / norm)  # the direction kept
    short, _ = clip_update(update, 10 * norm)
    assert all(np.array_equal(short[k], update[k]) for k in update)


def test_server_noise_on_the_mean_has_std_z_c_over_n_and_positive_controls_fail() -> None:
    z, c, n = 1.3, 0.5, 4
    ledger = PrivacyLedger(PrivacyConfig(dp_fedavg="central", dp_clip_norm=c, dp_noise_multiplier=z), np.random.default_rng(1))
    zeros = [{"w": np.zeros(100_000)} for _ in range(n)]
    noise = ledger.noised_mean(1, [f"a{k}" for k in range(n)], zeros)["w"]
    assert _std_matches(noise, z * c / n)
    # Positive controls: the check refuses the scales a wrong implementation would give.
    for wrong in (z * c, z * c / n * 1.05, z * c / n * 0.95, c / n, z / n):
        assert not _std_matches(noise, wrong), wrong


def test_server_mean_clips_every_update_and_weighs_agents_the_same() -> None:
    c = 1.0
    ledger = PrivacyLedger(PrivacyConfig(dp_fedavg="central", dp_clip_norm=c, dp_noise_multiplier=1e-9), np.random.default_rng(2))
    big, small = {"w": np.full(4, 10.0)}, {"w": np.array([0.1, 0.0, 0.0, 0.0])}
    mean = ledger.noised_mean(3, ["big", "small"], [big, small])["w"]
    expected = (np.full(4, 0.5) + small["w"]) / 2  # big clipped to norm 1: 0.5 per entry; no sample weights
    assert np.allclose(mean, expected, atol=1e-6)
    record = ledger.close_round(3, {"big": {}, "small": {}})["dp_fedavg"]
    assert record["clipped"] == ["big"] and record["update_norms"]["big"] == pytest.approx(20.0)
    assert record["noised_rounds"] == 1 and record["epsilon"] > 0


def test_agent_clips_its_update_and_local_mode_adds_noise_of_std_z_c() -> None:
    rng = np.random.default_rng(3)
    global_state = {"w": np.zeros(200_000, dtype=np.float32), "n": np.asarray(7, dtype=np.int64)}
    trained = {"w": rng.normal(size=200_000).astype(np.float32), "n": np.asarray(9, dtype=np.int64)}
    clipped, norm = privatise_state(trained, global_state, DpAgentSettings(mode="client_clipping", clip_norm=0.5), rng)
    assert norm > 0.5 and np.linalg.norm(clipped["w"].astype(np.float64)) == pytest.approx(0.5, rel=1e-5)
    assert clipped["w"].dtype == np.float32 and int(clipped["n"]) == 9
    z, c = 2.0, 0.5
    local, _ = privatise_state(trained, global_state, DpAgentSettings(mode="local", clip_norm=c, noise_multiplier=z), rng)
    noise = local["w"].astype(np.float64) - clipped["w"].astype(np.float64)
    assert _std_matches(noise, z * c)
    assert not _std_matches(noise, z) and not _std_matches(noise, z * c * 1.05)  # positive controls


def test_dpsgd_adds_each_layers_weight_gradient_once_per_sample() -> None:
    """Opacus computes each sample's weight gradient of a Linear (in x out products) and a
    Conv2d (out x in x k x k at each output position) on top of the usual backward: the FLOPs
    (2 x MACs) DP-SGD adds to an agent's step. Positive control against Opacus itself: one step of
    its hooked conv model under FlopCounterMode, less the same step without the hooks, is the
    conv's figure (the conv's per-sample product is a batched matmul, which FlopCounterMode
    counts; the linear's is an outer product, which it does not)."""
    import torch
    import torch.nn as nn
    from opacus import GradSampleModule

    from models.reference_flops import flops_of

    linear = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    assert weight_gradient_flops_per_sample(linear, (3, 2, 2)) == 2 * 12 * 5
    conv = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    conv_part = 2 * 4 * 2 * 3 * 3 * 6 * 6
    assert weight_gradient_flops_per_sample(conv, (2, 6, 6)) == conv_part + 2 * 4 * 6 * 6 * 3
    x, y = torch.randn(4, 2, 6, 6), torch.zeros(4, dtype=torch.long)
    plain = flops_of(lambda: nn.functional.cross_entropy(conv(x), y).backward())
    hooked = GradSampleModule(conv)
    assert flops_of(lambda: nn.functional.cross_entropy(hooked(x), y).backward()) - plain == 4 * conv_part
    model = build_model("resnet8_gn", 10, 1)
    extra = weight_gradient_flops_per_sample(model, (1, 28, 28))
    flops = cached_flops_per_sample(model, (1, 28, 28))
    assert 0.5 * flops.forward < extra <= flops.forward < flops.training


# --------------------------------------------------------------------------- #
# Refusals
# --------------------------------------------------------------------------- #


def test_dpsgd_refuses_batchnorm_and_names_the_groupnorm_models() -> None:
    with pytest.raises(DpSgdModelError, match=r"BatchNorm.*resnet8_gn"):
        require_dpsgd_model(build_model("resnet8", 10, 1), "resnet8")
    require_dpsgd_model(build_model("resnet8_gn", 10, 1), "resnet8_gn")  # accepted
    ledger = PrivacyLedger(PrivacyConfig(dpsgd=True, dpsgd_noise_multiplier=1.0))
    with pytest.raises(DpSgdModelError, match="resnet8_gn"):
        ledger.check_method(FedAvgServer(CTX, {"model": "resnet8"}), True)
    ledger.check_method(FedAvgServer(CTX, {"model": "resnet8_gn"}), True)


def test_config_refusals_name_the_key() -> None:
    with pytest.raises(ValueError, match="dp_clip_norm"):
        PrivacyConfig(dp_fedavg="central", dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dp_fedavg must be one of"):
        PrivacyConfig(dp_fedavg="on")
    with pytest.raises(ValueError, match="dpsgd_noise_multiplier"):
        PrivacyConfig(dpsgd=True)
    from cloud_server.methods.fedbe import FedBEServer

    central = PrivacyLedger(PrivacyConfig(dp_fedavg="central", dp_clip_norm=1.0, dp_noise_multiplier=1.0))
    fedbe = FedBEServer.__new__(FedBEServer)  # the class's declarations are what is checked
    with pytest.raises(ValueError, match="does not hold for fedbe"):
        central.check_method(fedbe, True)
    with pytest.raises(ValueError, match="aggregation = 'mean'"):
        central.check_method(FedAvgServer(CTX, {"model": "resnet8"}), False)


# --------------------------------------------------------------------------- #
# End to end over mosquitto
# --------------------------------------------------------------------------- #


def _run(mosquitto, tmp_path: Path, model: str, run_id: str, **server: object) -> dict:  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "fedavg", {"model": model, "batch_size": 16, "optimizer": "sgd", "lr": 0.05},
                               run_id=run_id)
    cfg = replace(cfg, **server)
    agents = [agent_config(cfg.run_id, i, 2, train_samples=48, test_samples=16) for i in range(2)]
    mqtt_federation(cfg, agents, mosquitto.url).start().join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished"
    return report


@pytest.mark.broker
def test_dp_fedavg_over_mosquitto_reports_epsilon(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _run(mosquitto, tmp_path, "resnet8", "dp-fa", dp_fedavg="central", dp_clip_norm=0.5, dp_noise_multiplier=1.1)
    section = report["privacy"]["dp_fedavg"]
    assert section["noised_rounds"] == 2 and section["sample_rate"] == 1.0
    assert section["epsilon"] == pytest.approx(client_level_epsilon(1.1, 1.0, 2, 1e-5))
    eps = [r["privacy"]["dp_fedavg"]["epsilon"] for r in report["rounds"]]
    assert eps[0] < eps[1] == section["epsilon"]
    assert all(sorted(r["privacy"]["dp_fedavg"]["update_norms"]) == ["agent-0", "agent-1"] for r in report["rounds"])
    assert "DP-FedAvg (central" in (tmp_path / "run" / "summary.md").read_text()
    figures = run_figures(report)  # what an experiment's results hold of the run
    assert figures["dp_fedavg_epsilon"] == section["epsilon"] and figures["dpsgd_epsilon"] is None


@pytest.mark.broker
def test_dpsgd_over_mosquitto_reports_the_agents_epsilon(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _run(mosquitto, tmp_path, "resnet8_gn", "dp-sgd", dpsgd=True, dpsgd_noise_multiplier=1.0, dpsgd_max_grad_norm=1.0)
    section = report["privacy"]["dpsgd"]
    assert sorted(section["agents"]) == ["agent-0", "agent-1"]
    per_agent_samples = report["rounds"][0]["samples"] // 2
    for figures in section["agents"].values():
        q, steps = figures["dpsgd_sample_rate"], int(figures["dpsgd_steps"])
        # Opacus's Poisson rate: one over the batches of the agent's loader (batch 16).
        assert q == pytest.approx(1 / -(-per_agent_samples // 16)) and steps >= 2
        # The agent's own accountant, the same as the server's function for its steps and rate.
        assert figures["dpsgd_epsilon"] == pytest.approx(client_level_epsilon(1.0, q, steps, 1e-5), rel=1e-6)
    assert section["epsilon"] == max(f["dpsgd_epsilon"] for f in section["agents"].values())
    assert "DP-SGD" in (tmp_path / "run" / "summary.md").read_text()
    # Every step's FLOPs include the per-sample gradients: each agent's count is a whole number of
    # samples at the model's training figure plus Opacus's, not at the model's alone.
    model = build_model("resnet8_gn", 10, 3)  # the agents' synthetic 3 x 32 x 32 images
    plain = cached_flops_per_sample(model, (3, 32, 32)).training
    per_sample = plain + weight_gradient_flops_per_sample(model, (3, 32, 32))
    for round_ in report["rounds"]:
        for agent in round_["per_agent"].values():
            flops = agent["train_flops"]
            assert flops > 0 and flops % per_sample == 0 and flops % plain != 0

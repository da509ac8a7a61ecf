"""The activation defences do what they say (edge_agent/activation_guard.py,
cloud_server/activation_privacy.py, models/resnet_cut.py): clipping norm and noise scale
measured, noise drawn once per release, ε from Opacus's accountant, NoPeek's distance
correlation equal to ``dcor``'s and lowered by training, the deeper cut's shapes, and an
agent-private initialisation the run's seed does not give."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_server.activation_privacy import map_epsilon
from cloud_server.methods.fedgkt_config import FedGktConfig
from cloud_server.methods.splitnn import SplitNNConfig
from edge_agent.activation_guard import NoPeek, agent_key, clip_rows_torch, distance_correlation, protect_maps
from edge_agent.methods.base import EdgeContext
from fldata import ArrayDataset
from models import build_model, check_cut_pair
from shared_protocol.activation_guard import ActivationGuard
from shared_protocol.messages import decode_message
from shared_protocol.methods.fedgkt import GktFeatures, GktReusedMaps

from fedhelpers import agent_config, in_memory_federation, server_config

KEY = b"k" * 32


def _maps(n: int = 64, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random((n, 16, 8, 8)) * scale).astype(np.float32)  # (N, 16, 8, 8), norms about 18 * scale


# -- clipping and noise ------------------------------------------------------------ #


def test_clipping_bounds_every_map_and_leaves_small_ones_alone() -> None:
    big, small = _maps(scale=10.0), _maps(scale=0.01, seed=1)
    clipped = protect_maps(np.concatenate([big, small]), ActivationGuard(map_clip_norm=5.0), KEY, "r", np.arange(128))
    norms = np.linalg.norm(clipped.reshape(128, -1), axis=1)
    assert np.allclose(norms[:64], 5.0, rtol=1e-5)  # large maps scaled to exactly C
    assert np.array_equal(clipped[64:], small)  # maps within C go up unchanged
    # Positive control: without the guard the same maps are far over C.
    assert np.linalg.norm(big.reshape(64, -1), axis=1).min() > 50.0


def test_noise_has_the_configured_scale() -> None:
    guard = ActivationGuard(map_clip_norm=2.0, map_noise_multiplier=1.5)
    maps = _maps(scale=10.0)
    noisy = protect_maps(maps, guard, KEY, "r", np.arange(64))
    clipped = protect_maps(maps, ActivationGuard(map_clip_norm=2.0), KEY, "r", np.arange(64))
    noise = (noisy - clipped).ravel()
    assert abs(noise.mean()) < 0.02 and noise.std() == pytest.approx(3.0, rel=0.02)  # z * C = 3


def test_the_same_release_gets_the_same_noise_and_another_release_fresh_noise() -> None:
    guard = ActivationGuard(map_clip_norm=1.0, map_noise_multiplier=1.0)
    maps, ids = _maps(8), np.arange(100, 108)
    first = protect_maps(maps, guard, KEY, "train/abc", ids)
    again = protect_maps(maps, guard, KEY, "train/abc", ids)
    assert np.array_equal(first, again)  # a resend carries nothing new to average
    # The same sample in another batch position: the noise follows the sample, not the row.
    assert np.array_equal(protect_maps(maps[::-1].copy(), guard, KEY, "train/abc", ids[::-1].copy())[::-1], first)
    other = protect_maps(maps, guard, KEY, "train/def", ids)
    clipped = protect_maps(maps, ActivationGuard(map_clip_norm=1.0), KEY, "train/abc", ids)
    correlation = np.corrcoef((first - clipped).ravel(), (other - clipped).ravel())[0, 1]
    assert abs(correlation) < 0.05  # a new release: independent noise
    assert not np.array_equal(protect_maps(maps, guard, b"x" * 32, "train/abc", ids), first)  # another agent's key


def test_split_learning_clipping_passes_the_gradient_through_the_scale() -> None:
    maps = torch.tensor(_maps(4, scale=10.0), requires_grad=True)
    clipped = clip_rows_torch(maps, 1.0)
    assert torch.allclose(clipped.flatten(1).norm(dim=1), torch.ones(4))
    clipped.sum().backward()
    assert maps.grad is not None and maps.grad.abs().max() < 1.0  # scaled by C / norm, not the identity


# -- ε from Opacus ----------------------------------------------------------------- #


def test_epsilon_per_map_is_opacus_rdp_of_one_gaussian_release() -> None:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    # Sensitivity 2C (a map's neighbour is another image's map): noise z * C is z / 2 of it.
    rdp = compute_rdp(q=1.0, noise_multiplier=1.0, steps=1, orders=orders)
    expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert map_epsilon(2.0, 1e-5) == pytest.approx(expected, rel=1e-6)
    # The Gaussian mechanism's RDP is alpha / (2 sigma^2): the same minimum by hand, as a check.
    by_hand = min(a / 2.0 + math.log(1e5) / (a - 1) for a in orders)
    assert map_epsilon(2.0, 1e-5) <= by_hand + 1e-9
    assert map_epsilon(2.0, 1e-5, releases=4) > map_epsilon(2.0, 1e-5) > map_epsilon(8.0, 1e-5)
    assert map_epsilon(0.0, 1e-5) == math.inf


def test_the_run_report_states_what_was_on_and_its_epsilon() -> None:
    config = FedGktConfig.from_dict({"map_clip_norm": 4.0, "map_noise_multiplier": 2.0, "map_noise_delta": 1e-6})
    report = config.defences_report(rounds=5)
    assert report is not None
    assert report["map_clip_norm"] == 4.0 and report["map_noise_multiplier"] == 2.0 and report["noise_std"] == 8.0
    assert report["epsilon_per_map"] == pytest.approx(map_epsilon(2.0, 1e-6))
    assert report["releases_per_image"] == 1  # a frozen extractor's map is released once
    trained = FedGktConfig.from_dict({"map_clip_norm": 4.0, "map_noise_multiplier": 2.0, "train_extractor": True})
    assert trained.defences_report(rounds=5)["releases_per_image"] == 5
    assert FedGktConfig().defences_report(rounds=5) is None  # nothing on: no section
    sl = SplitNNConfig.from_dict({"map_clip_norm": 1.0, "map_noise_multiplier": 1.0, "local_epochs": 2})
    assert sl.defences_report(rounds=3)["releases_per_image"] == 6


def test_noise_without_a_clipping_norm_and_nopeek_on_a_frozen_extractor_are_refused() -> None:
    with pytest.raises(ValueError, match="map_clip_norm"):
        FedGktConfig.from_dict({"map_noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="train_extractor = true"):
        FedGktConfig.from_dict({"nopeek_alpha": 0.5})
    FedGktConfig.from_dict({"nopeek_alpha": 0.5, "train_extractor": True})
    with pytest.raises(ValueError, match="map_clip_norm"):
        SplitNNConfig.from_dict({"map_clip_norm": -1.0})


# -- NoPeek ------------------------------------------------------------------------ #


def test_distance_correlation_equals_dcor() -> None:
    dcor = pytest.importorskip("dcor")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6))
    for y in (rng.normal(size=(40, 3)), np.tanh(x[:, :3] @ rng.normal(size=(3, 5))), x ** 2):
        ours = float(distance_correlation(torch.from_numpy(x), torch.from_numpy(y)))
        assert ours == pytest.approx(dcor.distance_correlation(x, y), abs=1e-9)
    assert float(distance_correlation(torch.from_numpy(x), torch.from_numpy(2 * x + 1))) == pytest.approx(1.0)


def test_nopeek_lowers_the_distance_correlation_it_penalises() -> None:
    torch.manual_seed(0)
    images = torch.randn(64, 1, 6, 6)
    layer = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Tanh())
    nopeek = NoPeek(1.0).watch(layer)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.02)
    start = float(distance_correlation(images, layer(images)).detach())
    for _ in range(150):
        penalty = nopeek.penalty(layer(images))
        optimizer.zero_grad()
        penalty.backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
        optimizer.step()
    nopeek.close()
    end = float(distance_correlation(images, layer(images)).detach())
    # A convolution's maps stay close to injective: dCor falls, far from zero.
    assert start > 0.9 and end < start - 0.08


# -- the deeper cut ---------------------------------------------------------------- #


def test_the_deeper_cut_uploads_the_stage_and_its_server_model_takes_it() -> None:
    edge = build_model("resnet8_stage1", 10, 1).eval()
    x = torch.randn(3, 1, 28, 28)
    maps = edge.extract(x)
    assert maps.shape == (3, 64, 28, 28)
    logits, same = edge(x)
    assert torch.equal(same, maps) and logits.shape == (3, 10)
    for server in ("resnet55_server_stage1", "resnet109_server_stage1"):
        assert build_model(server, 10).eval()(maps).shape == (3, 10)
    # The stem's model and the cut one hold the same layers; the upload is the stage's output.
    stem = build_model("resnet8", 10, 1).eval()
    stem.load_state_dict({k.replace("extractor.stem.", "extractor.").replace("extractor.stage.", "classifier.stages.layer1.")
                          .replace("classifier.fc", "classifier.fc"): v for k, v in edge.state_dict().items()})
    assert torch.allclose(stem.classifier.stages(stem.extract(x)), maps, atol=1e-6)
    check_cut_pair("resnet8_stage1", "resnet55_server_stage1", "fedgkt")
    with pytest.raises(ValueError, match="resnet55_server_stage1"):
        FedGktConfig.from_dict({"edge_model": "resnet8_stage1"})
    with pytest.raises(ValueError, match="stem"):
        SplitNNConfig.from_dict({"server_model": "resnet55_server_stage1"})


# -- a private extractor --------------------------------------------------------------- #


def _context(key: bytes) -> EdgeContext:
    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.uint8), np.zeros(4, np.int64), np.arange(4), 10, "synthetic")
    return EdgeContext(agent_id="a", run_id="r", instance="i", train=data, test=data, send=lambda *a, **k: None,
                       settings={"num_classes": 10, "edge_init": "per_agent"}, seed=7, private_key=key)


def test_per_agent_init_comes_from_the_agents_key_not_the_run_seed() -> None:
    from edge_agent.methods.fedgkt import FedGktEdge

    def stem(key: bytes) -> torch.Tensor:
        return FedGktEdge(_context(key)).model.extractor.conv.weight.detach().clone()

    assert agent_key() != agent_key()  # os.urandom unless the agent's config fixes it
    assert agent_key(5) == agent_key(5)
    assert torch.equal(stem(agent_key(5)), stem(agent_key(5)))
    # The same run seed and agent index (what the server knows), other keys: other extractors.
    assert not torch.equal(stem(agent_key(5)), stem(agent_key(6)))
    # Positive control: the run seed alone (what a "shared"-less build used) is what the server could rebuild.
    ctx = _context(agent_key(5))
    rebuilt = build_model("resnet8", 10, 1, generator=ctx.weights_generator()).extractor.conv.weight
    assert not torch.equal(stem(agent_key(5)), rebuilt)


# -- the noise-once property in a federation --------------------------------------------- #


def _received(coordinator) -> list:  # type: ignore[no-untyped-def]
    seen: list = []
    receive = coordinator.transport.receive

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        delivery = receive(*args, **kwargs)
        if delivery is not None and coordinator.topics.agent_of(delivery.topic) is not None:
            seen.append((delivery.topic, decode_message(delivery.payload, coordinator.limits)))
        return delivery

    coordinator.transport.receive = spy
    return seen


@pytest.mark.parametrize("reuse_maps", [False, True])
def test_a_frozen_extractors_noisy_maps_go_up_once(tmp_path: Path, reuse_maps: bool) -> None:
    guard = {"map_clip_norm": 3.0, "map_noise_multiplier": 1.0, "reuse_maps": reuse_maps}
    config = server_config(tmp_path, run_id="noise-once", agents=1, rounds=2, eval_every=5, method_config=guard)
    federation = in_memory_federation(config, [agent_config("noise-once", 0, 1, train_samples=48, test_samples=16)])
    seen = _received(federation.coordinator)
    federation.start().join(120)
    by_round: dict[int, dict[int, np.ndarray]] = {}
    reused = 0
    for _topic, msg in seen:
        if isinstance(msg, GktFeatures) and msg.split == "train":
            rows = by_round.setdefault(msg.round, {})
            for i, sample in enumerate(msg.sample_ids):
                rows[int(sample)] = msg.features[i]
        reused += isinstance(msg, GktReusedMaps)
    first = by_round[min(by_round)]
    assert len(first) == 48
    norms = np.array([np.linalg.norm(m) for m in first.values()])
    assert norms.mean() > 3.0 * 10  # noise of std 3 on every coordinate, not the clipped map alone
    if reuse_maps:
        assert len(by_round) == 1 and reused > 0  # round 2 names the held maps, sends none
    else:
        second = by_round[max(by_round)]
        assert len(by_round) == 2
        # The same maps again carry the same noise: nothing to average away (fp16 on the wire, same bytes).
        assert all(np.array_equal(first[s], second[s]) for s in first)


def test_noised_maps_go_up_in_eight_bits_with_u8_affine_zstd(tmp_path: Path) -> None:
    """Noised maps are signed, so u8-zstd cannot carry them; u8-affine-zstd does, in fewer bytes
    than fp16-zstd: every batch's channel arrives on a lattice of at most 256 values (fp16's, the
    positive control, has many more), the maps still noised well beyond the clipped ones."""
    distinct: dict[str, int] = {}
    up_bytes: dict[str, int] = {}
    for codec in ("fp16-zstd", "u8-affine-zstd"):
        guard = {"map_clip_norm": 3.0, "map_noise_multiplier": 1.0, "upload_codec": codec}
        config = server_config(tmp_path / codec, run_id="noise-u8", agents=1, rounds=1, eval_every=5, method_config=guard)
        federation = in_memory_federation(config, [agent_config("noise-u8", 0, 1, train_samples=48, test_samples=16)])
        seen = _received(federation.coordinator)
        report = federation.start().join(120)
        assert report["status"] == "finished"
        up_bytes[codec] = report["rounds"][0]["bytes"]["up_payload"]
        batches = [m.features for _t, m in seen if isinstance(m, GktFeatures) and m.split == "train"]  # (n, C, H, W) each
        assert sum(len(b) for b in batches) == 48 and max(float(np.abs(b).max()) for b in batches) > 3.0
        distinct[codec] = max(len(np.unique(b[:, c])) for b in batches for c in range(b.shape[1]))
    assert distinct["u8-affine-zstd"] <= 256 < distinct["fp16-zstd"]
    assert up_bytes["u8-affine-zstd"] < up_bytes["fp16-zstd"]

"""Attack strength on uploaded maps (FedGKT's features, split learning's activations): each
attack recovers private images from maps of a known ResNet-8 stem, and scores near the
mean-image baseline when what it is given carries nothing of them."""

from __future__ import annotations

import pytest
import torch

from audithelpers import FASHION, IMAGE_SHAPE, fashion_sets, stem
from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit import (ArchitectureOnlyConfig, AttackInputError, FeatureDecoder, InverseNetworkConfig,
                                WhiteBoxConfig, decode_features, invert_features_architecture_only,
                                invert_features_white_box, mean_image_baseline, score_images, train_inverse_network,
                                white_box_candidates)
from cloud_server.audit.audit_run import best_candidate
from cloud_server.audit.audit_updates import match_private

PRIVATE = 8
PUBLIC = 200


@pytest.fixture(scope="module")
def sets() -> tuple[torch.Tensor, torch.Tensor, float]:
    private, _, public = fashion_sets(PRIVATE, PUBLIC)
    return private, public, mean_image_baseline(public, private).psnr_db


def maps(extractor: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return extractor(FASHION.to_model(images))  # (N, 16, 32, 32), as an agent uploads them


# -- white box: the server holds the stem ---------------------------------------------------- #


def test_white_box_recovers_the_images_through_the_known_stem(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, _, _ = sets
    reconstructed = invert_features_white_box(stem(0), maps(stem(0), private), FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=200))
    scores = score_images(reconstructed, private)
    assert scores.psnr_db > 60.0
    assert scores.ssim > 0.999


def test_white_box_tries_several_learning_rates_and_keeps_each_images_best_fit(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    """The deeper cut (the stem and its bottleneck stage) as drawn from one seed: at the first
    learning rate alone the images stall in a poor fit of the maps (the positive control: an
    attack that reports safety where there is none); with the ladder each image keeps the
    reconstruction whose maps fit best, and the images come back."""
    from models import build_model

    private, _, _ = sets
    with torch.random.fork_rng():
        torch.manual_seed(1)
        deeper = build_model("resnet8_stage1", 10, 1).extractor.eval()
    received = maps(deeper, private)
    one_rate = invert_features_white_box(deeper, received, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=400, more_lrs=()))
    assert score_images(one_rate, private).psnr_db < 30.0
    ladder = invert_features_white_box(deeper, received, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=400))
    assert score_images(ladder, private).psnr_db > 60.0


def test_the_audit_reports_the_best_scoring_of_the_white_box_candidates(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    """On noised maps the closest fit of the maps can be the one that fitted the noise: the audit
    scores each learning rate's reconstruction and the per-image best fit, and reports the best,
    named, so the ladder never scores below one of its rates alone. Positive control: a candidate
    that is the private images themselves wins, and is named."""
    private, public, _ = sets
    clean = maps(stem(0), private)
    generator = torch.Generator().manual_seed(0)
    noised = clean + 0.3 * clean.std() * torch.randn(clean.shape, generator=generator)
    candidates = white_box_candidates(stem(0), noised, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=100))
    assert set(candidates) == {"lr 0.05", "lr 0.2", "best map fit"}
    row, images, _ = best_candidate("white_box_inversion", candidates, private, public, 1.0)
    scores = {name: score_images(c, private).psnr_db for name, c in candidates.items()}
    assert row["psnr_db"] == max(scores.values()) and row["candidate"].startswith(max(scores, key=scores.get))
    assert torch.equal(images, candidates[max(scores, key=scores.get)])
    row, images, _ = best_candidate("white_box_inversion", {**candidates, "truth": private.clone()}, private, public, 1.0)
    assert row["candidate"].startswith("truth") and row["psnr_db"] > 90.0
    row, _, _ = best_candidate("inverse_network", {"": candidates["lr 0.05"]}, private, public, 1.0)
    assert "candidate" not in row


def test_without_ids_each_white_box_candidate_is_matched_to_the_private_images_on_its_own(
        sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    """Split learning's uploads carry no ids: a reconstruction is scored against the images of
    the shard it fits best. Each candidate is matched on its own, so a candidate that is the
    shard in another order scores exactly, not against the order another candidate's fit chose;
    what it was scored against comes back with it."""
    private, public, _ = sets
    shard = torch.cat([private, public[-4:]])  # (12, C, H, W)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1))[:8]
    exact = shard[order].clone()
    blurred = 0.5 * shard[order.flip(0)] + 0.5 * public[:8]  # fits the other images best
    row, images, against = best_candidate("white_box_inversion", {"blurred": blurred, "exact": exact},
                                          lambda found: match_private(found, shard), public, 1.0)
    assert row["candidate"].startswith("exact") and row["psnr_db"] > 90.0
    assert torch.equal(images, exact) and torch.equal(against, shard[order])
    # The control: scored against the images the other candidate fits, the same candidate is far off.
    row, _, _ = best_candidate("white_box_inversion", {"exact": exact}, match_private(blurred, shard), public, 1.0)
    assert row["psnr_db"] < 40.0


def test_white_box_recovers_the_images_from_fp16_maps(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    # fp16 is what the default codec (fp16-zstd) leaves of the maps.
    private, _, _ = sets
    received = maps(stem(0), private).half().float()
    scores = score_images(invert_features_white_box(stem(0), received, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=200)), private)
    assert scores.psnr_db > 60.0
    assert scores.ssim > 0.999


def test_white_box_through_the_wrong_weights_scores_near_the_baseline(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, _, baseline = sets
    reconstructed = invert_features_white_box(stem(1), maps(stem(0), private), FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=200))
    scores = score_images(reconstructed, private)
    assert scores.psnr_db < baseline + 2.0
    assert scores.ssim < 0.3


def test_white_box_with_batch_statistics_recovers_a_training_batch(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    # Split learning's agents upload maps of a training forward pass: BatchNorm normalises with
    # the batch's own statistics, and the attack must run the stem the same way.
    private, _, _ = sets
    with torch.no_grad():
        received = stem(0).train()(FASHION.to_model(private))
    as_trained = invert_features_white_box(stem(0), received, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=400, batch_statistics=True))
    in_eval_mode = invert_features_white_box(stem(0), received, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=400))
    assert score_images(as_trained, private).psnr_db > 60.0
    assert score_images(in_eval_mode, private).psnr_db < 30.0


def test_white_box_refuses_maps_the_extractor_cannot_produce(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, _, _ = sets
    with pytest.raises(AttackInputError, match="received maps"):
        invert_features_white_box(stem(0), maps(stem(0), private)[:, :8], FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=1))


# -- an inverse network trained on the public set -------------------------------------------- #


@pytest.fixture(scope="module")
def decoder() -> FeatureDecoder:
    _, _, public = fashion_sets(PRIVATE, PUBLIC)
    return train_inverse_network(stem(0), public, FASHION, InverseNetworkConfig(steps=150))


def test_inverse_network_recovers_the_images(sets: tuple[torch.Tensor, torch.Tensor, float], decoder: FeatureDecoder) -> None:
    private, _, _ = sets
    scores = score_images(decode_features(decoder, maps(stem(0), private)), private)
    assert scores.psnr_db > 25.0
    assert scores.ssim > 0.9


def test_inverse_network_on_maps_of_other_weights_scores_near_the_baseline(
        sets: tuple[torch.Tensor, torch.Tensor, float], decoder: FeatureDecoder) -> None:
    private, _, baseline = sets
    scores = score_images(decode_features(decoder, maps(stem(1), private)), private)
    assert scores.psnr_db < baseline + 2.0
    assert scores.ssim < 0.3


def test_an_untrained_decoder_scores_near_the_baseline(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, _, baseline = sets
    torch.manual_seed(0)
    scores = score_images(decode_features(FeatureDecoder(16, 1), maps(stem(0), private)), private)
    assert scores.psnr_db < baseline + 2.0
    assert scores.ssim < 0.3


# -- architecture only: the server knows the stem's shape, not its weights ------------------- #

SMALL_ARCHITECTURE_ONLY = ArchitectureOnlyConfig(warmup_steps=200, steps=600)


def test_architecture_only_recovers_the_images_without_the_weights(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, public, baseline = sets
    # The surrogate passed in is another draw of the architecture; its weights are re-drawn anyway.
    reconstructed = invert_features_architecture_only(stem(7), maps(stem(0), private), FASHION, public, SMALL_ARCHITECTURE_ONLY)
    scores = score_images(reconstructed, private)
    assert scores.psnr_db > 40.0
    assert scores.psnr_db > baseline + 25.0
    assert scores.ssim > 0.99


def test_architecture_only_recovers_a_label_skewed_agents_images() -> None:
    # One class only (sandals: darker and sparser than the public set on average): the
    # calibration on the public set must not lean on the batch looking like it.
    images, labels, public = fashion_sets(100, PUBLIC)
    private = images[labels == 5][:8]
    reconstructed = invert_features_architecture_only(stem(7), maps(stem(0), private), FASHION, public, SMALL_ARCHITECTURE_ONLY)
    scores = score_images(reconstructed, private)
    assert scores.psnr_db > 40.0
    assert scores.ssim > 0.99


def test_architecture_only_never_uses_the_weights_it_is_given(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    private, public, _ = sets
    config = ArchitectureOnlyConfig(warmup_steps=5, steps=5)
    received = maps(stem(0), private)
    first = invert_features_architecture_only(stem(0), received, FASHION, public, config)
    second = invert_features_architecture_only(stem(3), received, FASHION, public, config)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_architecture_only_on_maps_of_noise_scores_near_the_baseline(sets: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    # Maps that carry nothing of the private images: the calibration on the public set alone
    # must not make a reconstruction out of them.
    private, public, baseline = sets
    noise = torch.rand(private.shape, generator=torch.Generator().manual_seed(1))
    reconstructed = invert_features_architecture_only(stem(7), maps(stem(0), noise), FASHION, public, SMALL_ARCHITECTURE_ONLY)
    scores = score_images(reconstructed, private)
    assert scores.psnr_db < baseline + 2.0
    assert scores.ssim < 0.3

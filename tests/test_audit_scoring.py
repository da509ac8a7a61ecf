"""The audit's scores: PSNR and SSIM in pixel space, the mean-image baseline, the normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from audithelpers import FASHION, fashion_sets
from cloud_server.audit import (MAX_PSNR_DB, AttackInputError, PixelSpace, mean_image_baseline, score_attack,
                                score_images)


def test_identical_images_score_the_cap_and_ssim_one() -> None:
    private, _, _ = fashion_sets(4, 50)
    scores = score_images(private.clone(), private)
    assert scores.psnr_db == MAX_PSNR_DB
    assert scores.ssim == pytest.approx(1.0, abs=1e-9)
    assert scores.num_images == 4


def test_psnr_is_ten_log_of_the_inverse_mse() -> None:
    private = torch.full((2, 1, 32, 32), 0.5)
    shifted = private + 0.1  # mse 0.01 -> 20 dB
    scores = score_images(shifted, private)
    assert scores.psnr_db_per_image == pytest.approx((20.0, 20.0))


def test_ssim_is_pytorch_msssim_per_image() -> None:
    from pytorch_msssim import ssim

    private, _, public = fashion_sets(3, 50)
    guess = public[:3]
    scores = score_images(guess, private)
    expected = ssim(guess.double(), private.double(), data_range=1.0, size_average=False).tolist()
    assert scores.ssim_per_image == pytest.approx(tuple(expected))


def test_the_mean_image_baseline_predicts_the_public_mean() -> None:
    private, _, public = fashion_sets(8, 200)
    baseline = mean_image_baseline(public, private)
    direct = score_images(public.mean(0, keepdim=True).expand_as(private), private)
    assert baseline.psnr_db == pytest.approx(direct.psnr_db)
    # The baseline is far from a reconstruction: the mean image is a blur of every class.
    assert 8.0 < baseline.psnr_db < 16.0 and baseline.ssim < 0.4


def test_to_pixels_undoes_the_loaders_normalisation() -> None:
    private, _, _ = fashion_sets(4, 50)
    normalised = FASHION.to_model(private)
    assert float(normalised.mean()) == pytest.approx(0.0, abs=0.5)
    torch.testing.assert_close(FASHION.to_pixels(normalised), private)
    low, high = FASHION.bounds(private)
    assert float(low.flatten()[0]) == pytest.approx(-0.2190 / 0.3318)
    assert float(high.flatten()[0]) == pytest.approx((1 - 0.2190) / 0.3318)


def test_scores_refuse_normalised_images_and_mismatched_shapes() -> None:
    private, _, _ = fashion_sets(2, 50)
    with pytest.raises(AttackInputError, match="un-normalise"):
        score_images(FASHION.to_model(private), private)
    with pytest.raises(AttackInputError, match="differ in shape"):
        score_images(private[:1], private)
    with pytest.raises(AttackInputError, match="at least 11"):
        score_images(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8))
    with pytest.raises(AttackInputError, match="non-finite"):
        score_images(torch.full_like(private, math.nan), private)


def test_pixel_space_validates_its_statistics() -> None:
    with pytest.raises(AttackInputError):
        PixelSpace((0.5,), (0.0,))
    with pytest.raises(AttackInputError):
        PixelSpace((0.5, 0.5), (0.2,))
    with pytest.raises(AttackInputError, match="expected images"):
        PixelSpace.identity(3).to_model(torch.zeros(1, 1, 32, 32))


def test_an_attack_outcome_carries_its_baseline() -> None:
    private, _, public = fashion_sets(4, 50)
    outcome = score_attack("white_box_inversion", private.clone(), private, public, wall_s=1.5)
    assert outcome.gain_db == pytest.approx(MAX_PSNR_DB - mean_image_baseline(public, private).psnr_db)
    row = outcome.to_dict()
    assert row["attack"] == "white_box_inversion" and row["num_images"] == 4 and row["wall_s"] == 1.5
    assert row["baseline_psnr_db"] < row["psnr_db"]

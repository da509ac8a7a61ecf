"""Attack strength on weight updates (the FedAvg family's uploads): the unrolled schedule is
the agents' own, one image's label and pixels come back from its update, and an update the
attack cannot explain (another start model, noise) gives nothing back."""

from __future__ import annotations

import pytest
import torch

from audithelpers import FASHION, IMAGE_SHAPE, agent_update, agent_update_buffers, fashion_sets, lenet
from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit import (AttackInputError, LocalSchedule, UnsupportedScheduleError, UpdateInversionConfig,
                                infer_single_label, invert_update, mean_image_baseline, score_images, unrolled_update)
from cloud_server.audit.linear_inputs import capture_input, recover_linear_input
from cloud_server.audit.update_matching import batchnorm_distance, observed_running_stats, record_batchnorm, sign_distance
from models.registry import build_model

INVERSION = UpdateInversionConfig(steps=800, restarts=1)


@pytest.mark.parametrize("schedule", [
    LocalSchedule(lr=0.05, local_steps=3, batch_size=2, momentum=0.9, weight_decay=1e-3),
    LocalSchedule(lr=0.01, local_steps=3, batch_size=2, optimizer="adam", weight_decay=1e-4),
], ids=["sgd-momentum", "adam"])
def test_the_unrolled_schedule_is_the_agents_training(schedule: LocalSchedule) -> None:
    private, labels, _ = fashion_sets(4, 50)
    for model in (lenet(0), build_model("resnet8", 10, 1, generator=torch.Generator().manual_seed(0))):
        expected = agent_update(model, private, labels, schedule)
        unrolled = unrolled_update(model, FASHION.to_model(private), labels, schedule)
        assert unrolled.keys() == expected.keys()
        for name, delta in expected.items():
            torch.testing.assert_close(unrolled[name].detach(), delta, rtol=1e-3, atol=1e-4 * float(delta.abs().max()) + 1e-9)


@pytest.mark.parametrize("model_name", ["lenet", "simplecnn", "resnet8"])
def test_the_label_of_one_image_is_read_from_its_update(model_name: str) -> None:
    private, labels, _ = fashion_sets(8, 50)
    model = lenet(0) if model_name == "lenet" else build_model(model_name, 10, 1, generator=torch.Generator().manual_seed(0))
    schedule = LocalSchedule(lr=0.01)
    read = [infer_single_label(model, agent_update(model, private[i : i + 1], labels[i : i + 1], schedule)) for i in range(8)]
    assert read == labels.tolist()


def test_one_image_comes_back_from_its_one_step_update() -> None:
    private, labels, public = fashion_sets(1, 200)
    model, schedule = lenet(0), LocalSchedule(lr=0.01)
    result = invert_update(model, agent_update(model, private, labels, schedule), FASHION, IMAGE_SHAPE, 1, schedule,
                           config=INVERSION)
    assert result.labels_inferred and result.labels.tolist() == labels.tolist()
    scores = score_images(result.images, private)
    assert scores.psnr_db > 30.0
    assert scores.psnr_db > mean_image_baseline(public, private).psnr_db + 15.0
    assert scores.ssim > 0.85


def test_one_image_comes_back_through_an_unrolled_momentum_schedule() -> None:
    private, labels, _ = fashion_sets(1, 200)
    model = lenet(0)
    schedule = LocalSchedule(lr=0.01, local_steps=3, momentum=0.9, weight_decay=1e-4)
    result = invert_update(model, agent_update(model, private, labels, schedule), FASHION, IMAGE_SHAPE, 1, schedule,
                           config=INVERSION)
    scores = score_images(result.images, private)
    assert scores.psnr_db > 28.0
    assert scores.ssim > 0.8


def test_an_update_from_another_start_model_gives_nothing_back() -> None:
    private, labels, public = fashion_sets(1, 200)
    schedule = LocalSchedule(lr=0.01)
    update = agent_update(lenet(0), private, labels, schedule)
    result = invert_update(lenet(1), update, FASHION, IMAGE_SHAPE, 1, schedule, labels=labels, config=INVERSION)
    scores = score_images(result.images, private)
    assert scores.psnr_db < mean_image_baseline(public, private).psnr_db + 2.0
    assert scores.ssim < 0.3


def test_a_noise_update_gives_nothing_back() -> None:
    private, labels, public = fashion_sets(1, 200)
    model, schedule = lenet(0), LocalSchedule(lr=0.01)
    generator = torch.Generator().manual_seed(3)
    noise = {name: torch.randn(p.shape, generator=generator) * 1e-3 for name, p in model.named_parameters()}
    result = invert_update(model, noise, FASHION, IMAGE_SHAPE, 1, schedule, labels=labels, config=INVERSION)
    scores = score_images(result.images, private)
    assert scores.psnr_db < mean_image_baseline(public, private).psnr_db + 2.0
    assert scores.ssim < 0.3


def test_invert_update_refuses_what_it_cannot_use() -> None:
    private, labels, _ = fashion_sets(2, 50)
    model, schedule = lenet(0), LocalSchedule(lr=0.01)
    update = agent_update(model, private[:1], labels[:1], schedule)
    with pytest.raises(AttackInputError, match="lacks"):
        invert_update(model, {k: v for k, v in update.items() if not k.startswith("0.")}, FASHION, IMAGE_SHAPE, 1, schedule)
    with pytest.raises(AttackInputError, match="one image only"):
        invert_update(model, update, FASHION, IMAGE_SHAPE, 2, schedule)
    with pytest.raises(AttackInputError, match="expected 2 labels"):
        invert_update(model, update, FASHION, IMAGE_SHAPE, 2, schedule, labels=labels[:1])
    with pytest.raises(AttackInputError, match="zero everywhere"):
        invert_update(model, {k: torch.zeros_like(v) for k, v in update.items()}, FASHION, IMAGE_SHAPE, 1, schedule,
                      labels=labels[:1], config=UpdateInversionConfig(steps=1))
    with pytest.raises(UnsupportedScheduleError):
        LocalSchedule(lr=0.01, optimizer="rmsprop")
    with pytest.raises(AttackInputError):
        UpdateInversionConfig(weighting="layerwise")


@pytest.mark.parametrize("model_name", ["simplecnn", "resnet8"])
def test_a_linear_layers_input_is_read_exactly_off_a_one_step_update(model_name: str) -> None:
    private, labels, _ = fashion_sets(1, 50)
    model = build_model(model_name, 10, 1, generator=torch.Generator().manual_seed(0))
    schedule = LocalSchedule(lr=0.01, weight_decay=1e-3)
    recovered = recover_linear_input(model, agent_update(model, private, labels, schedule), schedule)
    assert recovered is not None
    with capture_input(model, recovered.module_name) as seen:
        model.train()(FASHION.to_model(private))
    true_input = seen[0].detach().flatten()
    assert float((recovered.values - true_input).norm() / true_input.norm()) < 1e-4


def test_no_linear_input_is_read_where_the_update_does_not_give_it() -> None:
    private, labels, _ = fashion_sets(2, 50)
    model = lenet(0)
    for schedule in (LocalSchedule(lr=0.01, local_steps=2), LocalSchedule(lr=0.01, optimizer="adam")):
        assert recover_linear_input(model, agent_update(model, private[:1], labels[:1], schedule), schedule) is None


def test_two_images_come_back_from_a_batch_of_two_with_known_labels() -> None:
    private, labels, public = fashion_sets(2, 200)
    model, schedule = lenet(0), LocalSchedule(lr=0.01, batch_size=2)
    result = invert_update(model, agent_update(model, private, labels, schedule), FASHION, IMAGE_SHAPE, 2, schedule,
                           labels=labels, config=INVERSION)
    assert not result.labels_inferred
    scores = score_images(result.images, private)
    assert scores.psnr_db > 25.0
    assert scores.psnr_db > mean_image_baseline(public, private).psnr_db + 10.0
    assert scores.ssim > 0.75


# -- the project's own model at the agents' defaults: ResNet-8 (FedKD's mentee), BatchNorm in train mode -- #

ADAM_DEFAULT = LocalSchedule(lr=0.001, optimizer="adam", weight_decay=1e-4)  # FedAvgRoundConfig's, one image
SGD_ONE_STEP = LocalSchedule(lr=0.01, momentum=0.9, weight_decay=1e-4)


def _resnet8_update(schedule: LocalSchedule, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """ResNet-8's update with BatchNorm's running statistics, as a FedAvg upload carries them."""
    model = build_model("resnet8", 10, 1, generator=torch.Generator().manual_seed(0))
    update = agent_update(model, images, labels, schedule)
    trained_stats = agent_update_buffers(model, images, labels, schedule)
    return model, {**update, **trained_stats}


def test_one_adam_step_gives_every_gradient_sign_and_only_the_private_image_has_them() -> None:
    private, labels, _ = fashion_sets(4, 50)
    other = next(i for i in range(1, 4) if labels[i] != labels[0])
    model, update = _resnet8_update(ADAM_DEFAULT, private[:1], labels[:1])
    observed = {k: v for k, v in update.items() if not k.endswith(("running_mean", "running_var"))}
    sign_step = LocalSchedule(lr=1.0, weight_decay=ADAM_DEFAULT.weight_decay)  # minus the first gradient
    def distance(images: torch.Tensor) -> float:
        gradient = {k: -v for k, v in unrolled_update(model, FASHION.to_model(images), labels[:1], sign_step).items()}
        return float(sign_distance(gradient, observed, "per_tensor").detach())
    assert distance(private[:1]) < 1e-6
    assert distance(private[other : other + 1]) > 0.3


def test_the_running_statistics_in_an_upload_pin_the_batch() -> None:
    private, labels, _ = fashion_sets(2, 50)
    model, update = _resnet8_update(SGD_ONE_STEP, private[:1], labels[:1])
    observed = observed_running_stats(model, update)
    assert observed
    def distance(images: torch.Tensor) -> float:
        with record_batchnorm(model) as moments:
            unrolled_update(model, FASHION.to_model(images), labels[:1], SGD_ONE_STEP)
        return float(batchnorm_distance(model, moments, observed).detach())
    assert distance(private[:1]) < 1e-6
    assert distance(private[1:2]) > 0.02


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [ADAM_DEFAULT, SGD_ONE_STEP], ids=["adam-default", "sgd"])
def test_resnet8_one_image_update_gives_more_than_the_mean_image_and_another_update_does_not(schedule: LocalSchedule) -> None:
    private, labels, public = fashion_sets(2, 200)
    config = UpdateInversionConfig(steps=150, lr=0.03, restarts=1)
    model, update = _resnet8_update(schedule, private[:1], labels[:1])
    result = invert_update(model, update, FASHION, IMAGE_SHAPE, 1, schedule, start=public.mean(0), config=config)
    assert result.labels.tolist() == labels[:1].tolist()
    assert result.match == ("sign" if schedule.optimizer == "adam" else "cosine")
    scores, baseline = score_images(result.images, private[:1]), mean_image_baseline(public, private[:1])
    assert scores.psnr_db > baseline.psnr_db + 1.0
    assert scores.ssim > baseline.ssim + 0.1
    _, other_update = _resnet8_update(schedule, private[1:2], labels[1:2])
    other = invert_update(model, other_update, FASHION, IMAGE_SHAPE, 1, schedule, labels=labels[:1], start=public.mean(0),
                          config=config)
    other_scores = score_images(other.images, private[:1])
    assert other_scores.psnr_db < baseline.psnr_db + 0.5 and other_scores.ssim < baseline.ssim
    assert other.loss > 2 * result.loss

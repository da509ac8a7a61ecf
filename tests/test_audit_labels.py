"""Label-distribution inference: exact from labels in the clear, close from an SGD update's
bias, the classes present from an Adam update's; and an update of other data does not
pass for this agent's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from audithelpers import FASHION, agent_update, fashion_sets
from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit import (AttackInputError, LocalSchedule, histogram_error, label_histogram_from_bias_update,
                                label_histogram_from_labels, label_histogram_from_logits, last_linear_layer,
                                true_histogram, uniform_guess_error)
from models.registry import build_model

SGD = LocalSchedule(lr=0.01, batch_size=8, local_steps=4)


def skewed_agent(classes_below: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """32 private images, most of classes ``< classes_below``, a few of others (a label-skewed agent)."""
    private, labels, _ = fashion_sets(100, 200)
    keep = torch.nonzero((labels < classes_below) | (torch.arange(100) % 10 == 0)).flatten()[:32]
    return private[keep], labels[keep]


def bias_estimate(model_name: str, images: torch.Tensor, labels: torch.Tensor, schedule: LocalSchedule) -> np.ndarray:
    model = build_model(model_name, 10, 1, generator=torch.Generator().manual_seed(0))
    update = agent_update(model, images, labels, schedule)
    _, _, public = fashion_sets(100, 200)
    with torch.no_grad():
        output = model.eval()(FASHION.to_model(public))
        logits = output[0] if isinstance(output, tuple) else output
    mean_probabilities = torch.softmax(logits, 1).mean(0).numpy()  # the global model on the public set
    name, _ = last_linear_layer(model)
    return label_histogram_from_bias_update(update[f"{name}.bias"].numpy(), schedule, mean_probabilities).shares


def test_labels_in_the_clear_give_the_exact_histogram() -> None:
    _, labels = skewed_agent()
    estimate = label_histogram_from_labels(labels.numpy(), 10)
    assert estimate.exact and estimate.source == "labels"
    assert estimate.error(labels.numpy()) == 0.0


def test_the_logits_argmax_histogram() -> None:
    labels = np.array([0, 0, 1, 3, 3, 3])
    logits = np.eye(10)[labels] * 5.0 + 0.01
    estimate = label_histogram_from_logits(logits)
    assert not estimate.exact
    assert estimate.error(labels) == pytest.approx(0.0)


@pytest.mark.parametrize(("model_name", "bound"), [("simplecnn", 0.1), ("resnet8", 0.25)])
def test_an_sgd_update_reveals_the_label_distribution(model_name: str, bound: float) -> None:
    images, labels = skewed_agent()
    shares = bias_estimate(model_name, images, labels, SGD)
    truth = true_histogram(labels.numpy(), 10)
    uniform_error = histogram_error(np.ones(10), truth)
    assert histogram_error(shares, truth) < bound < uniform_error - 0.3


def test_an_adam_update_reveals_the_classes_present() -> None:
    images, labels = skewed_agent()
    shares = bias_estimate("simplecnn", images, labels, LocalSchedule(lr=0.001, batch_size=8, local_steps=4, optimizer="adam"))
    present = set(labels.tolist())
    assert {c for c in range(10) if shares[c] > 0} <= present
    assert histogram_error(shares, true_histogram(labels.numpy(), 10)) < 0.25


def test_an_update_of_other_data_does_not_pass_for_this_agents() -> None:
    images, labels = skewed_agent()
    others_images, others_labels = fashion_sets(100, 200)[0], fashion_sets(100, 200)[1]
    other = torch.nonzero(others_labels >= 5).flatten()[:32]
    shares = bias_estimate("simplecnn", others_images[other], others_labels[other], SGD)
    assert histogram_error(shares, true_histogram(labels.numpy(), 10)) > 0.6


def test_histogram_error_is_the_total_variation_distance() -> None:
    assert histogram_error(np.array([1, 0, 0]), np.array([2, 0, 0])) == 0.0
    assert histogram_error(np.array([1, 0]), np.array([0, 1])) == 1.0
    assert histogram_error(np.array([1, 1]), np.array([1, 0])) == pytest.approx(0.5)
    # The baseline: a uniform guess is exact on a balanced shard and 1 - 1/K off on a one-class one.
    assert uniform_guess_error(np.arange(10), 10) == pytest.approx(0.0)
    assert uniform_guess_error(np.full(7, 3), 10) == pytest.approx(0.9)


def test_label_inference_refuses_what_it_cannot_use() -> None:
    with pytest.raises(AttackInputError, match="cannot be compared"):
        histogram_error(np.ones(3), np.ones(4))
    with pytest.raises(AttackInputError, match="labels must be in"):
        true_histogram(np.array([0, 10]), 10)
    with pytest.raises(AttackInputError, match="logits"):
        label_histogram_from_logits(np.zeros(5))
    with pytest.raises(AttackInputError, match="mean_probabilities"):
        label_histogram_from_bias_update(np.zeros(10), SGD, np.ones(3) / 3)
    with pytest.raises(AttackInputError, match="finite"):
        label_histogram_from_bias_update(np.array([np.nan, 0.0]), SGD)

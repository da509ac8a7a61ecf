"""What uploads reveal about an agent's label distribution.

Three readings, by what crossed the wire:

- labels in the clear (FedGKT's and split learning's uploads carry them): the histogram is
  exact;
- logits (every KD method's uploads): the histogram of their argmax, the classes the agent's
  model predicts for its own images;
- a weight update (the FedAvg family): the last linear layer's bias. One SGD step on a batch
  moves bias ``c`` by ``lr * (share of class c - mean predicted probability of c)``, so the
  summed update over the schedule, divided by the learning rate and the steps, plus the
  model's mean prediction, is the class shares (Wainakh et al.'s bias-based label leakage).
  Adam rescales every coordinate, which keeps only the sign: the classes whose bias rose.

The error of an estimate against the true histogram is the total variation distance between
the two distributions: half the L1 distance, in ``[0, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import AttackInputError
from .schedule import LocalSchedule

__all__ = [
    "LabelDistributionEstimate",
    "histogram_error",
    "label_histogram_from_bias_update",
    "label_histogram_from_labels",
    "label_histogram_from_logits",
    "true_histogram",
    "uniform_guess_error",
]


@dataclass(frozen=True)
class LabelDistributionEstimate:
    """An estimated class distribution of one agent's data.

    Attributes:
        shares: ``(K,)`` estimated share of each class, summing to 1.
        source: what it was read from: ``"labels"``, ``"logits"``, ``"bias_update"`` or
            ``"bias_update_sign"``.
        exact: whether the shares are the agent's own (labels in the clear), not an estimate.
    """

    shares: np.ndarray
    source: str
    exact: bool

    @property
    def num_classes(self) -> int:
        return int(self.shares.shape[0])

    def error(self, true_labels: np.ndarray) -> float:
        """Total variation distance from the histogram of ``true_labels`` (``(N,)`` class indices)."""
        return histogram_error(self.shares, true_histogram(true_labels, self.num_classes))


def _shares(counts: np.ndarray, what: str) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise AttackInputError(f"{what}: expected a non-empty vector of class counts, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise AttackInputError(f"{what}: class counts must be finite and >= 0")
    total = counts.sum()
    if total <= 0:
        raise AttackInputError(f"{what}: no class has a positive count")
    return counts / total


def true_histogram(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Class shares ``(K,)`` of ``labels``.

    Raises:
        AttackInputError: no labels, or labels outside ``[0, num_classes)``.
    """
    labels = np.asarray(labels).reshape(-1)
    if labels.size == 0:
        raise AttackInputError("no labels")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise AttackInputError(f"labels must be in [0, {num_classes}), got values in [{labels.min()}, {labels.max()}]")
    return _shares(np.bincount(labels.astype(np.int64), minlength=num_classes), "labels")


def histogram_error(estimate: np.ndarray, truth: np.ndarray) -> float:
    """Total variation distance between two class distributions of the same length."""
    estimate, truth = np.asarray(estimate, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    if estimate.shape != truth.shape:
        raise AttackInputError(f"histograms of {estimate.shape} and {truth.shape} classes cannot be compared")
    return float(0.5 * np.abs(_shares(estimate, "estimate") - _shares(truth, "truth")).sum())


def uniform_guess_error(true_labels: np.ndarray, num_classes: int) -> float:
    """The error of a server that received nothing and guesses equal class shares (the public
    set's, which is balanced): the baseline a label attack is read against."""
    return histogram_error(np.full(num_classes, 1.0 / num_classes), true_histogram(true_labels, num_classes))


def label_histogram_from_labels(labels: np.ndarray, num_classes: int) -> LabelDistributionEstimate:
    """The exact histogram of labels the agent uploaded in the clear."""
    return LabelDistributionEstimate(true_histogram(labels, num_classes), "labels", exact=True)


def label_histogram_from_logits(logits: np.ndarray) -> LabelDistributionEstimate:
    """The histogram of the uploaded logits' argmax, ``logits`` ``(N, K)``."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise AttackInputError(f"expected logits (N, K), got shape {logits.shape}")
    if not np.all(np.isfinite(logits)):
        raise AttackInputError("the logits contain non-finite values")
    counts = np.bincount(logits.argmax(axis=1), minlength=logits.shape[1])
    return LabelDistributionEstimate(_shares(counts, "logits"), "logits", exact=False)


def label_histogram_from_bias_update(bias_update: np.ndarray, schedule: LocalSchedule,
                                     mean_probabilities: np.ndarray | None = None) -> LabelDistributionEstimate:
    """The class shares an update of the last layer's bias implies.

    Args:
        bias_update: ``(K,)`` uploaded minus global bias of the classifier's last layer.
        schedule: the agent's local training, as the server configured it.
        mean_probabilities: ``(K,)`` the model's mean predicted probabilities over the
            agent's training (e.g. the global model's mean softmax on the public set);
            ``None`` takes them as uniform, as for an untrained model.

    With SGD the shares are ``bias_update / (lr * W) + mean_probabilities``, clipped at 0
    and renormalised, where ``W`` is the steps' total weight (``local_steps`` without
    momentum; each step's gradient counts ``(1 - m^k) / (1 - m)`` times with momentum ``m``,
    ``k`` the steps from it to the end). The bias's weight decay is neglected. With Adam
    only the sign is read: equal shares over the classes whose bias rose.

    Raises:
        AttackInputError: a bias that is not a finite vector, or probabilities of another length.
    """
    delta = np.asarray(bias_update, dtype=np.float64).reshape(-1)
    if delta.size == 0 or not np.all(np.isfinite(delta)):
        raise AttackInputError(f"expected a finite bias update (K,), got shape {np.shape(bias_update)}")
    k = delta.size
    if schedule.optimizer == "adam":
        rose = (delta > 0).astype(np.float64)
        return LabelDistributionEstimate(_shares(rose if rose.any() else np.ones(k), "bias update"), "bias_update_sign", exact=False)
    probabilities = np.full(k, 1.0 / k) if mean_probabilities is None else np.asarray(mean_probabilities, dtype=np.float64)
    if probabilities.shape != (k,):
        raise AttackInputError(f"mean_probabilities has shape {probabilities.shape}, the bias update ({k},)")
    m = schedule.momentum
    steps_to_end = np.arange(schedule.local_steps, 0, -1, dtype=np.float64)
    weight = float(steps_to_end.size if m == 0 else ((1.0 - m**steps_to_end) / (1.0 - m)).sum())
    shares = np.clip(delta / (schedule.lr * weight) + probabilities, 0.0, None)
    return LabelDistributionEstimate(_shares(shares if shares.any() else np.ones(k), "bias update"), "bias_update", exact=False)

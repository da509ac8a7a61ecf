"""What the server received, as the attacks take it: decoded messages (after the codec, as
the server holds them) turned into tensors.

- activations: FedGKT's :class:`GktFeatures` and split learning's :class:`SplitActivations`
  of one agent, stacked in arrival order with their labels (and, for FedGKT, logits and
  sample ids);
- weight updates: a FedAvg-family :class:`FedAvgUpdate` minus the global model it started
  from, and FedKD's factored :class:`FedKdUpdate` rebuilt to dense tensors, both as
  ``uploaded - global`` per parameter name, the form :func:`invert_update` reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from shared_protocol.methods.fedavg import FedAvgUpdate
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.fedkd import FedKdUpdate, unfactor_state
from shared_protocol.methods.splitnn import SplitActivations

from .errors import AttackInputError

__all__ = ["ReceivedActivations", "activations_from_messages", "update_from_fedavg", "update_from_fedkd"]


@dataclass(frozen=True)
class ReceivedActivations:
    """One agent's uploaded maps of one split, in arrival order.

    Attributes:
        features: ``(N, C, H, W)`` float32, as decoded.
        labels: ``(N,)`` the labels that travelled with them.
        logits: ``(N, K)`` the edge model's logits (FedGKT), else ``None``.
        sample_ids: ``(N,)`` stable sample ids (FedGKT), else ``None``.
    """

    features: torch.Tensor
    labels: np.ndarray
    logits: np.ndarray | None
    sample_ids: np.ndarray | None

    def __len__(self) -> int:
        return int(self.features.shape[0])


def activations_from_messages(messages: Iterable[GktFeatures | SplitActivations], split: str = "train") -> ReceivedActivations:
    """Stack the ``split`` batches of one agent's activation uploads.

    Raises:
        AttackInputError: no batch of ``split``, messages of more than one kind or sender, or
            maps of different shapes.
    """
    batches = [m for m in messages if m.split == split]
    if not batches:
        raise AttackInputError(f"no {split!r} activations among the messages")
    kinds = {type(m).__name__ for m in batches}
    senders = {m.sender for m in batches}
    if len(kinds) > 1 or len(senders) > 1:
        raise AttackInputError(f"expected one agent's uploads of one kind, got {sorted(kinds)} from {sorted(senders)}")
    arrays = [m.features if isinstance(m, GktFeatures) else m.activations for m in batches]
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise AttackInputError(f"the batches' maps differ in shape: {sorted(shapes)}")
    gkt = [m for m in batches if isinstance(m, GktFeatures)]
    return ReceivedActivations(
        features=torch.from_numpy(np.concatenate(arrays).astype(np.float32, copy=False)),  # (N, C, H, W)
        labels=np.concatenate([m.labels for m in batches]),
        logits=np.concatenate([m.logits for m in gkt]) if gkt else None,
        sample_ids=np.concatenate([m.sample_ids for m in gkt]) if gkt else None,
    )


def _difference(uploaded: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], what: str) -> dict[str, torch.Tensor]:
    missing = sorted(set(uploaded) - set(start))
    if missing:
        raise AttackInputError(f"{what}: the global model has no {missing[:3]}")
    update = {}
    for name, array in uploaded.items():
        if np.shape(start[name]) != np.shape(array):
            raise AttackInputError(f"{what}: {name!r} is {np.shape(array)}, the global model's {np.shape(start[name])}")
        update[name] = torch.from_numpy(np.asarray(array, dtype=np.float32) - np.asarray(start[name], dtype=np.float32))
    return update


def update_from_fedavg(message: FedAvgUpdate, start_weights: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``uploaded - global`` for every float tensor of a FedAvg-family upload (BatchNorm's
    running statistics included: :func:`invert_update` reads the parameters it needs).

    Raises:
        AttackInputError: a tensor the global model lacks or has in another shape.
    """
    return _difference(message.weights, start_weights, message.TYPE)


def update_from_fedkd(message: FedKdUpdate, learning_rate: float = 1.0) -> dict[str, torch.Tensor]:
    """FedKD's factored upload rebuilt to dense tensors, as ``uploaded - global``.

    An ``"update"`` payload is that difference already. A ``"gradient"`` payload is the mean
    gradient at the global mentee, returned as ``-learning_rate * gradient``: the direction
    one SGD step would move (its scale does not matter to a cosine distance).
    """
    dense = {name: packed.reconstruct() for name, packed in unfactor_state(message.TYPE, message.layout, message.factors).items()}
    scale = 1.0 if message.payload == "update" else -learning_rate
    return {name: torch.from_numpy(array * np.float32(scale)) for name, array in dense.items()}

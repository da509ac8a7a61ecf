"""Model weights as plain numpy arrays, for the wire and for checkpoints.

Weights travel between agents and the server as named numpy arrays that the
protocol encodes with ``allow_pickle=False`` codecs; nothing here pickles.
Every entry of ``state_dict()`` is included -- parameters *and* buffers
(BatchNorm running mean/var and ``num_batches_tracked``) -- because a FedAvg
global model with stale BN statistics evaluates badly even when its weights are
right.

Loading is all-or-nothing: every name, shape, dtype kind and value is checked
before the first tensor is written, so a malformed update from one agent can
never leave a model half overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn as nn

__all__ = ["WeightsMismatchError", "load_arrays_into", "state_dict_to_arrays"]


class WeightsMismatchError(ValueError):
    """Arrays do not fit the model: wrong names, shapes, dtype kinds or non-finite values.

    Attributes:
        missing: State-dict names the model has and the arrays lack.
        unexpected: Array names the model does not have.
    """

    def __init__(self, message: str, missing: tuple[str, ...] = (), unexpected: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


def state_dict_to_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """All parameters and buffers of ``model`` as C-contiguous numpy copies, in state-dict order.

    The arrays own their memory: changing them does not touch the model and
    training the model further does not change them.
    """
    return {name: tensor.detach().cpu().numpy().copy(order="C") for name, tensor in model.state_dict().items()}


def _dtype_kind(dtype: torch.dtype) -> str:
    """numpy-style kind letter of a torch dtype: 'f' float, 'i' integer, 'b' bool."""
    if dtype.is_floating_point:
        return "f"
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    return "i"


def _array_kind(array: np.ndarray) -> str:
    # Unsigned and signed integers are interchangeable for counters such as
    # num_batches_tracked; a codec may well pick either.
    return "i" if array.dtype.kind in "iu" else array.dtype.kind


def load_arrays_into(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy ``arrays`` (as produced by :func:`state_dict_to_arrays`) into ``model`` in place.

    Names must match the model's state dict exactly. Values are cast to each
    tensor's dtype, but only within a kind (float to float, integer to
    integer), and floats must be finite.

    Raises:
        TypeError: a value is not a numpy array.
        WeightsMismatchError: (a ``ValueError``) missing or unexpected names,
            a shape or dtype-kind mismatch, or a non-finite value. Nothing has
            been written to the model when it is raised.
    """
    state = model.state_dict()
    missing = tuple(name for name in state if name not in arrays)
    unexpected = tuple(name for name in arrays if name not in state)
    if missing or unexpected:
        raise WeightsMismatchError(
            f"weights do not match {type(model).__name__}: "
            f"missing {len(missing)} {list(missing)}, unexpected {len(unexpected)} {list(unexpected)}",
            missing=missing,
            unexpected=unexpected,
        )

    tensors: dict[str, torch.Tensor] = {}
    for name, target in state.items():
        array = arrays[name]
        if not isinstance(array, (np.ndarray, np.generic)):
            raise TypeError(f"weight {name!r} must be a numpy array, got {type(array).__name__}")
        array = np.asarray(array)
        if tuple(array.shape) != tuple(target.shape):
            raise WeightsMismatchError(
                f"weight {name!r} has shape {tuple(array.shape)}, model expects {tuple(target.shape)}"
            )
        expected_kind = _dtype_kind(target.dtype)
        if _array_kind(array) != expected_kind:
            raise WeightsMismatchError(f"weight {name!r} has dtype {array.dtype}, model expects {target.dtype}")
        if expected_kind == "f" and not np.isfinite(array).all():
            raise WeightsMismatchError(f"weight {name!r} contains NaN or infinite values")
        # Native byte order, contiguous and writable: what torch.from_numpy
        # needs. Arrays decoded from a wire buffer are often read-only.
        native = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
        tensors[name] = torch.from_numpy(native)

    # strict=True cannot fail after the checks above; copy_ casts dtypes.
    model.load_state_dict(tensors, strict=True)

"""An agent that misbehaves on purpose (``[agent] fault``; the kinds in :mod:`shared_protocol.faults`),
so that the server's defences can be tried against a bad device over the real transport.

Two places only, both called by :class:`edge_agent.agent.EdgeAgent`: :meth:`AgentFault.train_set`
when the agent loads its shard (``random_labels``), and :meth:`AgentFault.upload` on every
message a method hands to the agent for sending (``sign_flip``, ``scale``, ``nan``). The methods
know nothing of it: the agent corrupts what a method produced honestly, as a compromised device
between the training code and the network would.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from fldata import ArrayDataset
from shared_protocol.faults import FaultSpec
from shared_protocol.messages import Message
from shared_protocol.methods.fedavg import FedAvgUpdate

__all__ = ["AgentFault", "HeldGlobal", "sign_flipped"]

log = logging.getLogger("edge_agent.faults")

#: The global model (name -> array) the agent started the round of ``model_version`` from, or None.
HeldGlobal = Callable[[int], "dict[str, np.ndarray] | None"]


def sign_flipped(base: np.ndarray, trained: np.ndarray, scale: float) -> np.ndarray:
    """``base - scale x (trained - base)``: the update negated and scaled, in float64, back in ``trained``'s dtype."""
    base64 = base.astype(np.float64)
    return (base64 - scale * (trained.astype(np.float64) - base64)).astype(trained.dtype)


class AgentFault:
    """The fault ``spec`` one agent commits. ``label_seed`` seeds the permutation of
    ``random_labels`` (the agent's data seed: a rerun shuffles alike)."""

    def __init__(self, spec: FaultSpec, agent_id: str, label_seed: int = 0) -> None:
        self.spec = spec
        self.agent_id = agent_id
        self.label_seed = label_seed
        self.corrupted = 0  # messages changed so far
        self._untouched: set[str] = set()  # message types the fault found nothing to change in (logged once each)

    @property
    def skips_checks(self) -> bool:
        """Whether the agent sends what its own frame checks would refuse (non-finite values)."""
        return self.spec.kind == "nan"

    def announce(self) -> None:
        log.warning("FAULTY ON PURPOSE: agent %s is configured to misbehave ([agent] fault = %s): it %s. "
                    "Never run this on a device of a real federation.", self.agent_id, self.spec.describe(),
                    _what(self.spec))

    def train_set(self, train: ArrayDataset) -> ArrayDataset:
        """``random_labels``: the shard with its labels permuted (class counts unchanged); otherwise as it is."""
        if self.spec.kind != "random_labels":
            return train
        labels = np.random.default_rng(self.label_seed).permutation(train.labels)
        return dataclasses.replace(train, labels=labels)

    def upload(self, msg: Message, held_global: HeldGlobal) -> Message:
        """``msg`` as this agent sends it."""
        kind = self.spec.kind
        if kind == "sign_flip":
            out = self._sign_flip(msg, held_global)
        elif kind in ("scale", "nan"):
            out = _map_floats(msg, self._scaled if kind == "scale" else _with_nan)
        else:
            return msg
        if out is msg:
            if msg.TYPE not in self._untouched:
                self._untouched.add(msg.TYPE)
                log.warning("fault %s: nothing to change in %s; sent as it is", self.spec.describe(), msg.TYPE)
            return msg
        self.corrupted += 1
        log.warning("FAULTY ON PURPOSE: %s of round %d sent with fault %s", msg.TYPE, msg.round, self.spec.describe())
        return out

    def _scaled(self, array: np.ndarray) -> np.ndarray:
        return (array.astype(np.float64) * self.spec.factor).astype(array.dtype)

    def _sign_flip(self, msg: Message, held_global: HeldGlobal) -> Message:
        """A FedAvg-family update flipped against the global model this round started from:
        every float tensor, BatchNorm's running statistics included."""
        if not isinstance(msg, FedAvgUpdate):
            return msg
        base = held_global(msg.model_version)
        if base is None:
            raise RuntimeError(f"fault sign_flip: agent {self.agent_id} does not hold global model version "
                               f"{msg.model_version}, the one its update starts from")
        missing = sorted(set(msg.weights) - set(base))
        if missing:
            raise RuntimeError(f"fault sign_flip: the global model lacks {missing[:5]} of the update")
        return dataclasses.replace(msg, weights={k: sign_flipped(base[k], v, self.spec.factor) for k, v in msg.weights.items()})


def _what(spec: FaultSpec) -> str:
    from shared_protocol.faults import FAULT_KINDS

    return FAULT_KINDS[spec.kind].replace("SCALE", f"{spec.factor:g}")


def _with_nan(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.reshape(-1)[0] = np.nan
    return out


def _map_floats(msg: Message, fn: Callable[[np.ndarray], np.ndarray]) -> Message:
    """``msg`` with ``fn`` applied to every non-empty float tensor (its tensor and tensor-dict
    fields); ``msg`` itself when it holds none."""
    changes: dict[str, object] = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if "tensor" in f.metadata and _is_float(value):
            changes[f.name] = fn(value)
        elif "tensor_dict" in f.metadata and isinstance(value, dict):
            mapped = {k: fn(v) if _is_float(v) else v for k, v in value.items()}
            if any(mapped[k] is not value[k] for k in value):
                changes[f.name] = mapped
    return dataclasses.replace(msg, **changes) if changes else msg  # type: ignore[arg-type]


def _is_float(value: object) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size > 0

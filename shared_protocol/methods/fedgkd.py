"""FedGKD messages (Yao et al., "FedGKD: Local-Global Knowledge Distillation in
Heterogeneous Federated Learning"): FedAvg's, plus the teachers of the round.

The global model travels as in FedAvg (``RoundStart.weights``, or the version
the agent kept from the last evaluation). The round's *teachers* (historical
global models) travel in the same RoundStart:

* ``RoundStart.config["fedgkd"]`` is a :class:`FedGkdTeachers`: for each
  teacher its distillation coefficient (the paper's gamma, or gamma_m for the
  vote; the loss uses half of it, Eqs. 3-5), the global versions it is made of,
  and where the agent finds it:

  - ``"global"``: it *is* the round's global model (FedGKD with one model in the
    buffer; the newest teacher of FedGKD-Vote), so no extra bytes travel;
  - ``"sent"``: its float tensors are in ``RoundStart.weights`` under
    ``teacher<i>/<name>`` (:func:`teacher_prefix`), its integer buffers in the
    entry's ``int_buffers``;
  - ``"held"``: a global model the agent received earlier and confirmed using
    (FedGKD-Vote only; the agent keeps the newest ``buffer_size`` versions).

* The rest of ``RoundStart.config`` is a :class:`FedAvgRoundConfig` unchanged.

After an evaluated round agents answer the server's evaluation request
(``EvalReport``) with FedAvg's correct / total plus ``loss_sum``, the summed
cross-entropy of the global model on the agent's test shard, which is the
validation loss the vote coefficients are computed from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ValueRangeError
from ..registry import MethodSpec, register_method
from .fedavg import WHOLE_MODEL_FLAGS

#: ``RoundStart.config`` key of the teacher description.
CONFIG_KEY = "fedgkd"
VARIANTS = ("avg", "vote")
SOURCES = ("global", "sent", "held")


def teacher_prefix(index: int) -> str:
    """Prefix of teacher ``index``'s tensors in ``RoundStart.weights``."""
    return f"teacher{index}/"


def _int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher of the round: ``coefficient`` is gamma (or gamma_m), the KL weight is half of it."""

    source: str
    coefficient: float
    versions: tuple[int, ...]  # the global versions it is (the average of), newest first
    int_buffers: dict = field(default_factory=dict)  # "sent" only: the teacher's integer buffers

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"teacher source must be one of {SOURCES}, got {self.source!r}")
        if isinstance(self.coefficient, bool) or not isinstance(self.coefficient, (int, float)) or not math.isfinite(self.coefficient) or self.coefficient < 0:
            raise ValueError(f"teacher coefficient must be finite and >= 0, got {self.coefficient!r}")
        if not self.versions:
            raise ValueError("a teacher names at least one global version")
        for v in self.versions:
            _int("teacher version", v, 0)
        if len(set(self.versions)) != len(self.versions):
            raise ValueError(f"teacher versions repeat: {list(self.versions)}")
        if self.source != "sent" and self.int_buffers:
            raise ValueError(f"only sent teachers carry int_buffers, this one is {self.source!r}")
        for name, value in self.int_buffers.items():
            _int(f"teacher int_buffers[{name!r}]", value, 0)
        if self.source in ("global", "held") and len(self.versions) != 1:
            raise ValueError(f"a {self.source!r} teacher is one global version, got {list(self.versions)}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "coefficient": float(self.coefficient), "versions": list(self.versions), "int_buffers": dict(self.int_buffers)}


@dataclass(frozen=True)
class FedGkdTeachers:
    """``RoundStart.config["fedgkd"]``: the round's teachers and what the agent keeps.

    ``measure_start_loss`` asks the agent for the validation loss of the round's
    starting global model (its test-shard cross-entropy, in RoundEnd metrics
    ``start_loss_sum`` / ``start_loss_total``): the vote needs the loss of every
    buffered model, and a model never evaluated (the initial one) has none yet.
    """

    variant: str
    buffer_size: int
    teachers: tuple[TeacherSpec, ...]
    measure_start_loss: bool = False

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        _int("buffer_size", self.buffer_size, 1)
        if not self.teachers:
            # Training without a teacher would silently be FedAvg.
            raise ValueError("a FedGKD round needs at least one teacher")
        if self.variant == "avg" and len(self.teachers) != 1:
            raise ValueError(f"FedGKD (avg) has one teacher, got {len(self.teachers)}")
        if len(self.teachers) > self.buffer_size:
            raise ValueError(f"{len(self.teachers)} teachers for a buffer of {self.buffer_size}")
        if sum(t.source == "global" for t in self.teachers) > 1:
            raise ValueError("at most one teacher can be the round's global model")
        if not isinstance(self.measure_start_loss, bool):
            raise ValueError(f"measure_start_loss must be a bool, got {self.measure_start_loss!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "buffer_size": self.buffer_size, "teachers": [t.to_dict() for t in self.teachers],
                "measure_start_loss": self.measure_start_loss}

    @classmethod
    def from_dict(cls, raw: Any) -> "FedGkdTeachers":
        """Parse the JSON form; any problem is a ValueRangeError (a bad message, not a crash)."""
        if not isinstance(raw, dict):
            raise ValueRangeError(f"fedgkd teachers must be an object, got {type(raw).__name__}")
        unknown = set(raw) - {"variant", "buffer_size", "teachers", "measure_start_loss"}
        if unknown:
            raise ValueRangeError(f"fedgkd teachers have unknown keys {sorted(unknown)}")
        try:
            teachers = raw["teachers"]
            if not isinstance(teachers, list):
                raise ValueError(f"teachers must be a list, got {type(teachers).__name__}")
            specs = []
            for t in teachers:
                if not isinstance(t, dict) or set(t) - {"source", "coefficient", "versions", "int_buffers"}:
                    raise ValueError(f"bad teacher entry {t!r}")
                versions = t["versions"]
                if not isinstance(versions, list):
                    raise ValueError(f"teacher versions must be a list, got {versions!r}")
                int_buffers = t.get("int_buffers", {})
                if not isinstance(int_buffers, dict):
                    raise ValueError(f"teacher int_buffers must be an object, got {int_buffers!r}")
                specs.append(TeacherSpec(source=t["source"], coefficient=t["coefficient"], versions=tuple(versions), int_buffers=dict(int_buffers)))
            return cls(variant=raw["variant"], buffer_size=raw["buffer_size"], teachers=tuple(specs),
                       measure_start_loss=raw.get("measure_start_loss", False))
        except KeyError as exc:
            raise ValueRangeError(f"fedgkd teachers miss key {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValueRangeError(f"fedgkd teachers invalid: {exc}") from None


# -- the registry's entry ------------------------------------------------------------ #

register_method(MethodSpec(
    name="fedgkd",
    summary="FedGKD and FedGKD-Vote: distillation from a buffer of past global models",
    server="cloud_server.methods.fedgkd",
    edge="edge_agent.methods.fedgkd",
    config="cloud_server.methods.fedgkd:FedGkdConfig",
    messages=("shared_protocol.methods.fedavg", "shared_protocol.secagg_messages", __name__),  # FedAvg's messages plus the teachers
    flags=WHOLE_MODEL_FLAGS,
    docs="docs/methods/fedgkd.md",
))

"""Which attacks apply to which method, and what the server is assumed to know.

Every method declares once what its agents upload (:class:`MethodExposure`: the payloads,
training and evaluation traffic alike) and what its server holds by default
(:class:`ServerKnowledge`). An attack (:class:`AttackSpec`) applies to a method when the
method uploads a payload the attack reads and the server knows everything the attack
needs. :func:`attacks_for` answers that for a method by name, under its default knowledge
or under another one (a deployment whose server does not hold the extractor, say).

A duplicate registration is a ``ValueError``; a method without an entry is an
:class:`~cloud_server.audit.errors.UnknownAuditMethodError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .errors import UnknownAuditMethodError

__all__ = [
    "ATTACKS",
    "PAYLOADS",
    "AttackSpec",
    "AuditPlan",
    "MethodExposure",
    "ServerKnowledge",
    "attacks_for",
    "audited_methods",
    "register_exposure",
]

#: What can cross the wire, as the attacks read it.
PAYLOADS = ("activations", "weight_update", "factored_update", "labels", "logits")


@dataclass(frozen=True)
class ServerKnowledge:
    """What the server holds besides the uploads themselves.

    Attributes:
        extractor_weights: the weights of the extractor that produced uploaded activations
            (sent by the server, passed through it, or uploaded with an evaluation report).
        start_model: the global model a weight update started from (the server sent it).
        local_schedule: the agents' optimiser, learning rate, local steps and batch size
            (the server configured them).
        public_images: a public image set of the agents' kind (the global test set the
            server evaluates on).
        architecture: the agents' model architecture.
        note: where this knowledge comes from in the method, in words.
    """

    extractor_weights: bool = False
    start_model: bool = False
    local_schedule: bool = False
    public_images: bool = True
    architecture: bool = True
    note: str = ""

    def holds(self, item: str) -> bool:
        """Whether the server knows ``item`` (a field name)."""
        if item not in _KNOWLEDGE_ITEMS:
            raise ValueError(f"unknown knowledge item {item!r}; expected one of {_KNOWLEDGE_ITEMS}")
        return bool(getattr(self, item))


_KNOWLEDGE_ITEMS = tuple(f.name for f in fields(ServerKnowledge) if f.name != "note")


@dataclass(frozen=True)
class AttackSpec:
    """One attack the audit can run.

    Attributes:
        name: the attack's name in reports.
        reads: the payloads it works on (any one of them).
        needs: the :class:`ServerKnowledge` items it requires.
        scores: ``"images"`` (PSNR / SSIM against the private images) or ``"labels"``
            (the error of a class histogram).
        description: what it does, in one line.
    """

    name: str
    reads: tuple[str, ...]
    needs: tuple[str, ...]
    scores: str
    description: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.reads) - set(PAYLOADS))
        if unknown or not self.reads:
            raise ValueError(f"attack {self.name!r} reads unknown payloads {unknown}; expected some of {PAYLOADS}")
        missing = sorted(set(self.needs) - set(_KNOWLEDGE_ITEMS))
        if missing:
            raise ValueError(f"attack {self.name!r} needs unknown knowledge {missing}; expected some of {_KNOWLEDGE_ITEMS}")
        if self.scores not in ("images", "labels"):
            raise ValueError(f"attack {self.name!r}: scores must be 'images' or 'labels', got {self.scores!r}")

    def applies(self, uploads: tuple[str, ...], knowledge: ServerKnowledge) -> bool:
        """Whether a method uploading ``uploads`` to a server knowing ``knowledge`` is open to this attack."""
        return bool(set(self.reads) & set(uploads)) and all(knowledge.holds(item) for item in self.needs)


#: Every attack, by name (the functions that run them are named in each description).
ATTACKS: dict[str, AttackSpec] = {spec.name: spec for spec in (
    AttackSpec("white_box_inversion", ("activations",), ("extractor_weights",), "images",
               "optimise images through the extractor the server holds (invert_features_white_box)"),
    AttackSpec("inverse_network", ("activations",), ("extractor_weights", "public_images"), "images",
               "a decoder trained on the public set's maps, applied to the received maps (train_inverse_network)"),
    AttackSpec("architecture_only", ("activations",), ("architecture", "public_images"), "images",
               "images and a surrogate extractor optimised together, calibrated on the public set "
               "(invert_features_architecture_only)"),
    AttackSpec("update_inversion", ("weight_update", "factored_update"), ("start_model", "local_schedule", "architecture"),
               "images", "dummy images whose unrolled local update points the received update's way (invert_update)"),
    AttackSpec("labels_in_the_clear", ("labels",), (), "labels",
               "the histogram of the uploaded labels (label_histogram_from_labels)"),
    AttackSpec("logit_histogram", ("logits",), (), "labels",
               "the histogram of the uploaded logits' argmax (label_histogram_from_logits)"),
    AttackSpec("bias_update_labels", ("weight_update", "factored_update"), ("start_model", "local_schedule"), "labels",
               "class shares from the last layer's bias update (label_histogram_from_bias_update)"),
)}


@dataclass(frozen=True)
class MethodExposure:
    """What one method's agents upload and what its server knows by default.

    Attributes:
        method: the registered method's name.
        uploads: the payloads its agents send, training and evaluation alike.
        knowledge: what its server holds at its defaults.
    """

    method: str
    uploads: tuple[str, ...]
    knowledge: ServerKnowledge

    def __post_init__(self) -> None:
        unknown = sorted(set(self.uploads) - set(PAYLOADS))
        if unknown or not self.uploads:
            raise ValueError(f"method {self.method!r} uploads unknown payloads {unknown}; expected some of {PAYLOADS}")

    def attacks(self, knowledge: ServerKnowledge | None = None) -> tuple[AttackSpec, ...]:
        """The attacks that apply, under ``knowledge`` (default: the method's own)."""
        known = self.knowledge if knowledge is None else knowledge
        return tuple(spec for spec in ATTACKS.values() if spec.applies(self.uploads, known))


_EXPOSURES: dict[str, MethodExposure] = {}


def register_exposure(exposure: MethodExposure) -> MethodExposure:
    """Add a method's entry. Raises ``ValueError`` for a name already registered."""
    if exposure.method in _EXPOSURES:
        raise ValueError(f"method {exposure.method!r} already has an audit entry")
    _EXPOSURES[exposure.method] = exposure
    return exposure


def audited_methods() -> tuple[str, ...]:
    """The methods with an audit entry, sorted."""
    return tuple(sorted(_EXPOSURES))


@dataclass(frozen=True)
class AuditPlan:
    """What the audit of one method runs, and under which assumptions.

    Attributes:
        method: the method's name.
        uploads: the payloads its agents send.
        knowledge: what the server is assumed to hold.
        attacks: the attacks that apply, in :data:`ATTACKS` order.
    """

    method: str
    uploads: tuple[str, ...]
    knowledge: ServerKnowledge
    attacks: tuple[AttackSpec, ...]

    @property
    def attack_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.attacks)


def attacks_for(method: str, knowledge: ServerKnowledge | None = None) -> AuditPlan:
    """The attacks that apply to ``method``, under its default knowledge or ``knowledge``.

    Raises:
        UnknownAuditMethodError: no entry for ``method`` (the message lists those there are).
    """
    if method not in _EXPOSURES:
        raise UnknownAuditMethodError(f"no audit entry for method {method!r}; audited: {', '.join(audited_methods())}")
    exposure = _EXPOSURES[method]
    known = exposure.knowledge if knowledge is None else knowledge
    return AuditPlan(method, exposure.uploads, known, exposure.attacks(known))


_WEIGHT_SHARING = ServerKnowledge(
    start_model=True, local_schedule=True,
    note="the server sends the global model each update starts from and configures the local training")

register_exposure(MethodExposure("fedgkt", ("activations", "logits", "labels"), ServerKnowledge(
    extractor_weights=True,
    note="edge_init = 'shared' sends every agent its initial ResNet-8 and train_extractor = false keeps the stem "
         "there; every agent also uploads its ResNet-8 with each evaluation report")))
register_exposure(MethodExposure("splitnn", ("activations", "labels"), ServerKnowledge(
    extractor_weights=True,
    note="the extractor travels from agent to agent through the server (SplitExtractorWeights): the server holds "
         "it at the start and end of every turn; within a turn it moves every batch, and training activations "
         "come from a training forward pass (the batch's own normalisation statistics)")))
for _name in ("fedavg", "fedbe", "feddistill", "fedgkd"):
    register_exposure(MethodExposure(_name, ("weight_update",), _WEIGHT_SHARING))
register_exposure(MethodExposure("fedkd", ("factored_update",), replace(
    _WEIGHT_SHARING, note="the server sends the global mentee each SVD-factored update or gradient starts from")))

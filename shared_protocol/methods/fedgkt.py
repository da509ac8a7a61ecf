"""FedGKT messages: feature maps up, server logits down, keyed by sample id."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..activation_guard import ActivationGuard
from ..configs import check_codec, check_optimizer, round_config_from_wire
from ..errors import ShapeMismatchError, ValueRangeError
from ..message_base import Message, check_same_length, check_seqs, check_split, register_message, tensor, tensor_dict
from ..registry import LauncherFlag, MethodSpec, register_method

SPLITS = ("train", "test")

_DIGEST = re.compile(r"[0-9a-f]{64}")


def check_maps_digest(type_name: str, digest: str, allow_empty: bool) -> None:
    """A maps digest is 64 lowercase hex characters (sha256); ``""`` where ``allow_empty``."""
    if (digest == "" and allow_empty) or (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        return
    raise ValueRangeError(f"{type_name}: maps_digest must be 64 lowercase hex characters (sha256)"
                          f"{' or empty' if allow_empty else ''}, got {digest!r}")


@register_message
@dataclass(kw_only=True)
class GktFeatures(Message):
    """Agent -> server: one batch of extracted feature maps, streamed as extracted.

    ``features`` (N, C, H, W) is the extractor output H; ``logits`` (N, K) the edge
    classifier's logits z_c; ``labels`` (N,); ``sample_ids`` (N,) stable ids that
    the server's logits come back keyed by. ``instance`` names the agent process,
    so uploads of a killed process are never mixed with its successor's.
    ``maps_digest``: sha256 of what determined the maps (the extractor's weights and
    BatchNorm buffers, and the upload codec; :func:`edge_agent.fedgkt_edge.maps_digest`);
    ``""`` from an agent that does not say, whose maps the server never keeps for reuse.
    """

    TYPE: ClassVar[str] = "fedgkt.features"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {
        "features": "fp16-zstd",
        "logits": "zstd",
        "labels": "zstd",
        "sample_ids": "zstd",
    }
    split: str
    seq: int
    instance: str
    features: np.ndarray = tensor(("float32",), ndim=4)
    logits: np.ndarray = tensor(("float32",), ndim=2)
    labels: np.ndarray = tensor(("int64",), ndim=1)
    sample_ids: np.ndarray = tensor(("int64",), ndim=1)
    maps_digest: str = ""

    @property
    def for_evaluation(self) -> bool:
        """Test maps are sent to answer an evaluation request (their bytes are evaluation's)."""
        return self.split == "test"

    def validate(self) -> None:
        check_split(self.TYPE, self.split, SPLITS, self.seq)
        check_maps_digest(self.TYPE, self.maps_digest, allow_empty=True)
        check_same_length(self.TYPE, features=self.features, logits=self.logits, labels=self.labels, sample_ids=self.sample_ids)
        if len(np.unique(self.sample_ids)) != len(self.sample_ids):
            raise ValueRangeError(f"{self.TYPE}: duplicate sample ids in one batch")


@register_message
@dataclass(kw_only=True)
class GktReusedMaps(Message):
    """Agent -> server: one batch as :class:`GktFeatures` would carry it, without the maps and
    labels, which the server holds from an earlier upload made with the same ``maps_digest``
    (the round config's ``held_maps`` said so). ``logits`` (N, K) are this round's edge logits
    (the classifier trains every round); ``sample_ids`` (N,) name the rows of the held maps.
    A server that does not hold them answers with :class:`GktMapsRequest`."""

    TYPE: ClassVar[str] = "fedgkt.reused_maps"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"logits": "zstd", "sample_ids": "zstd"}
    split: str
    seq: int
    instance: str
    maps_digest: str
    logits: np.ndarray = tensor(("float32",), ndim=2)
    sample_ids: np.ndarray = tensor(("int64",), ndim=1)

    @property
    def for_evaluation(self) -> bool:
        return self.split == "test"

    def validate(self) -> None:
        check_split(self.TYPE, self.split, SPLITS, self.seq)
        check_maps_digest(self.TYPE, self.maps_digest, allow_empty=False)
        n = check_same_length(self.TYPE, logits=self.logits, sample_ids=self.sample_ids)
        if n == 0:
            raise ValueRangeError(f"{self.TYPE}: a batch names at least one sample")
        if len(np.unique(self.sample_ids)) != n:
            raise ValueRangeError(f"{self.TYPE}: duplicate sample ids in one batch")


@register_message
@dataclass(kw_only=True)
class GktMapsRequest(Message):
    """Server -> one agent: it does not hold the maps these batches of the round claimed to
    reuse (``reason`` says why: lost with a restart, another digest, unknown sample ids);
    extract and send them in full (:class:`GktFeatures`), then the round_end again."""

    TYPE: ClassVar[str] = "fedgkt.maps_request"
    split: str
    seqs: list
    reason: str = ""

    def validate(self) -> None:
        check_split(self.TYPE, self.split, SPLITS)
        check_seqs(self.TYPE, self.seqs)


@register_message
@dataclass(kw_only=True)
class GktServerLogits(Message):
    """Server -> one agent: server logits z_s for that agent's samples, by sample id."""

    TYPE: ClassVar[str] = "fedgkt.server_logits"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"logits": "zstd", "sample_ids": "zstd"}
    logits: np.ndarray = tensor(("float32",), ndim=2)
    sample_ids: np.ndarray = tensor(("int64",), ndim=1)

    def validate(self) -> None:
        n = check_same_length(self.TYPE, logits=self.logits, sample_ids=self.sample_ids)
        if n and len(np.unique(self.sample_ids)) != n:
            raise ShapeMismatchError(f"{self.TYPE}: duplicate sample ids")


@register_message
@dataclass(kw_only=True)
class GktResendRequest(Message):
    """Server -> one agent: these batches of your round's upload never arrived; send them again."""

    TYPE: ClassVar[str] = "fedgkt.resend_request"
    split: str
    seqs: list

    def validate(self) -> None:
        check_split(self.TYPE, self.split, SPLITS)
        check_seqs(self.TYPE, self.seqs)


@register_message
@dataclass(kw_only=True)
class GktEvalModel(Message):
    """Server -> one agent whose extractor is private, just before its ``EvalRequest``: the
    server model (``weights``, its state dict) the agent needs to score its extractor +
    server model itself, and, when the round's personalised evaluation is due, the agent's
    own BatchNorm statistics for it (``bn``: ``LAYER/mean`` and ``LAYER/var`` per BatchNorm
    layer of the server model, in order). Its bytes are evaluation's."""

    TYPE: ClassVar[str] = "fedgkt.eval_model"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"weights": "zstd", "bn": "zstd"}
    weights: dict = tensor_dict()
    bn: dict = tensor_dict()

    @property
    def for_evaluation(self) -> bool:
        return True

    def validate(self) -> None:
        if not self.weights:
            raise ValueRangeError(f"{self.TYPE}: no server model weights")
        for field_name, arrays in (("weights", self.weights), ("bn", self.bn)):
            for name, array in arrays.items():
                if array.dtype.kind == "f" and not np.isfinite(array).all():
                    raise ValueRangeError(f"{self.TYPE}: {field_name} {name!r} holds non-finite values")
        layers = {name.rsplit("/", 1)[0] for name in self.bn}
        if set(self.bn) != {f"{layer}/{part}" for layer in layers for part in ("mean", "var")}:
            raise ValueRangeError(f"{self.TYPE}: bn must hold LAYER/mean and LAYER/var for every layer, got {sorted(self.bn)[:6]}")


@dataclass(frozen=True)
class GktRoundConfig:
    """The per-round settings the server sends agents in ``RoundStart.config``.

    This is the wire contract between the two sides of FedGKT; both parse it
    with these defaults (FedML's FedGKT defaults: T = 3, alpha = 1), and the
    server's ``[fedgkt]`` config holds one (``FedGktConfig.edge``) rather than
    repeating its fields. ``upload_codec`` defaults to what :class:`GktFeatures`
    declares for its maps, and must be a registered codec.
    """

    edge_epochs: int = 1
    edge_optimizer: str = "adam"
    edge_lr: float = 0.001
    edge_momentum: float = 0.9
    edge_weight_decay: float = 1e-4
    batch_size: int = 64
    temperature: float = 3.0
    alpha: float = 1.0
    edge_kd: bool = True  # False for the "no KD" ablation
    # False (default): the extractor (conv stem, its BatchNorm statistics included) keeps the
    # weights the agent started from (the server's shared initialisation) and only the classifier
    # trains, so every agent's maps stay in one feature space; True: Algorithm 1 line 22, the
    # whole ResNet-8 trains (the paper presets). See docs/methods/fedgkt.md.
    train_extractor: bool = False
    upload_codec: str = GktFeatures.DEFAULT_CODECS["features"]
    upload_batch_samples: int = 256
    # True: an agent whose maps the server holds (``held_maps`` names their digest, and the
    # agent's extractor and codec give the same one) sends its logits and sample ids per batch
    # (GktReusedMaps), not the maps again; False: every round uploads its maps in full.
    reuse_maps: bool = True
    # Set by the server per agent, never in the [fedgkt] table: split -> the maps digest of this
    # agent's maps it holds, that a batch may reuse.
    held_maps: dict = field(default_factory=dict)
    # The activation defences (shared_protocol/activation_guard.py), all off at 0.
    map_clip_norm: float = 0.0
    map_noise_multiplier: float = 0.0
    nopeek_alpha: float = 0.0

    def __post_init__(self) -> None:
        if ActivationGuard.of(self).nopeek and not self.train_extractor:
            raise ValueError(f"nopeek_alpha = {self.nopeek_alpha} trains the extractor against the distance correlation "
                             "of images and maps, and the extractor is frozen (train_extractor = false): set "
                             "train_extractor = true, or nopeek_alpha = 0")
        if self.edge_epochs < 1 or self.batch_size < 1 or self.upload_batch_samples < 1:
            raise ValueError("edge_epochs, batch_size and upload_batch_samples must be >= 1")
        check_optimizer(self.edge_optimizer, "edge_optimizer")
        if self.edge_lr <= 0 or self.temperature <= 0 or self.alpha < 0:
            raise ValueError("edge_lr and temperature must be > 0 and alpha >= 0")
        check_codec(self.upload_codec)
        if not isinstance(self.held_maps, dict) or not set(self.held_maps) <= set(SPLITS):
            raise ValueError(f"held_maps must map splits {SPLITS} to digests, got {self.held_maps!r}")
        for digest in self.held_maps.values():
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise ValueError(f"held_maps: a digest is 64 lowercase hex characters (sha256), got {digest!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "GktRoundConfig":
        return round_config_from_wire(cls, raw, "fedgkt round config")


# -- the registry's entry ------------------------------------------------------------ #

register_method(MethodSpec(
    name="fedgkt",
    summary="FedGKT, sync or async: ResNet-8 edges upload feature maps, a large server model trains on them, "
            "knowledge flows both ways",
    server="cloud_server.methods.fedgkt",
    edge="edge_agent.methods.fedgkt",
    config="cloud_server.methods.fedgkt_config:FedGktConfig",
    messages=(__name__, "shared_protocol.methods.fedgkt_ort"),  # torch-free agents ask for their artifacts
    flags=(
        LauncherFlag("--mode", "sync", "sync | async", choices=("sync", "async")),
        LauncherFlag("--kd", "bidirectional", "the knowledge transfer: bidirectional | s2e | none",
                     choices=("bidirectional", "s2e", "none")),
        LauncherFlag("--server-model", "resnet55_server", "the server's model: resnet55_server | resnet109_server"),
        LauncherFlag("--server-epochs", 1, "the server's epochs per round", type="int", minimum=1),
        LauncherFlag("--edge-epochs", 1, "epochs of local training per round", type="int", minimum=1),
        LauncherFlag("--codec", None, "feature maps: raw | fp16-zstd (default) | u8-zstd | u8-affine-zstd"),
    ),
    backends={"ort": "edge_agent.backends.ort_fedgkt:OrtFedGktEdge"},
    docs="docs/methods/fedgkt.md",
))

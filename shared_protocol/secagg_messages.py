"""Secure aggregation's messages (shared_protocol/secagg.py, docs/protocol.md).

Four exchanges inside a round of a summing method (FedAvg, FedGKD, FedDistill), each an
agent's upload and the server's answer once the stage closes:

1. :class:`SecAggAdvertise` up (two X25519 public keys) -> :class:`SecAggRoster` down
   (every advertiser's keys, the Shamir threshold, the weight scale);
2. :class:`SecAggShareKeys` up (one AES-GCM ciphertext per other roster member, holding
   its Shamir shares of this agent's two seeds) -> :class:`SecAggShares` down (the
   ciphertexts addressed to the agent, relayed);
3. :class:`SecAggMaskedInput` up (the masked fixed-point update) -> :class:`SecAggUnmask`
   down (who survived, who dropped);
4. :class:`SecAggUnmaskShares` up (shares of the survivors' self-mask seeds and of the
   dropped agents' mask-key seeds); the server then holds the sum and nothing else.

Keys and ciphertexts travel as uint8 tensors, the masked vector as uint32 / uint64; all
raw (a masked vector is uniform noise: no codec shrinks it). The ring's elements travel as
int32 / int64, the same bits as their unsigned values (the wire has no unsigned wide types). A non-empty ``reason`` on a
server message means the server abandoned the round's secure aggregation and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .errors import ShapeMismatchError, ValueRangeError
from .message_base import Message, register_message, tensor

KEY_BYTES = 32  # an X25519 public key
SHARE_BYTES = 16  # a Shamir share of a 16-byte seed (pycryptodome's GF(2^128) scheme)
NONCE_BYTES = 12  # AES-GCM
TAG_BYTES = 16
# One ciphertext: nonce, then the two shares (self-mask seed, mask-key seed) sealed with their tag.
CIPHERTEXT_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES
RAW = "raw"


def _unique_names(type_name: str, what: str, names: list) -> None:
    if not all(isinstance(n, str) and n for n in names):
        raise ValueRangeError(f"{type_name}: {what} must be agent ids, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueRangeError(f"{type_name}: {what} names an agent twice: {sorted(names)}")


def _rows(type_name: str, what: str, array: np.ndarray, rows: int, width: int) -> None:
    if array.shape != (rows, width):
        raise ShapeMismatchError(f"{type_name}: {what} must be ({rows}, {width}), got {array.shape}")


@register_message
@dataclass(kw_only=True)
class SecAggAdvertise(Message):
    """Agent -> server: my public keys for this round (``c_public``: the channel key the shares
    to me are encrypted under; ``s_public``: the mask key my pairwise masks come from) and my
    sample count (the weight of my update; it travels in clear as in a plain FedAvg upload)."""

    TYPE: ClassVar[str] = "secagg.advertise"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"c_public": RAW, "s_public": RAW}
    num_samples: int
    c_public: np.ndarray = tensor("uint8", 1)
    s_public: np.ndarray = tensor("uint8", 1)

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ValueRangeError(f"{self.TYPE}: num_samples must be >= 1, got {self.num_samples}")
        for name in ("c_public", "s_public"):
            if getattr(self, name).shape != (KEY_BYTES,):
                raise ShapeMismatchError(f"{self.TYPE}: {name} must be {KEY_BYTES} bytes, got shape {getattr(self, name).shape}")


@register_message
@dataclass(kw_only=True)
class SecAggRoster(Message):
    """Server -> each advertiser: the round's roster (agent ids in the order that numbers their
    Shamir shares 1..n), their public keys row by row, the threshold ``t`` of shares that
    rebuild a seed, and ``weight_scale`` (an agent weighs its update by num_samples / weight_scale)."""

    TYPE: ClassVar[str] = "secagg.roster"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"c_public": RAW, "s_public": RAW}
    agents: list = field(default_factory=list)
    threshold: int = 0
    weight_scale: int = 1
    reason: str = ""
    c_public: np.ndarray = tensor("uint8", 2)
    s_public: np.ndarray = tensor("uint8", 2)

    def validate(self) -> None:
        _unique_names(self.TYPE, "agents", self.agents)
        for name in ("c_public", "s_public"):
            _rows(self.TYPE, name, getattr(self, name), len(self.agents), KEY_BYTES)
        if self.reason:
            return
        if not 2 <= self.threshold <= len(self.agents):
            raise ValueRangeError(f"{self.TYPE}: threshold must be in [2, {len(self.agents)}], got {self.threshold}")
        if self.weight_scale < 1:
            raise ValueRangeError(f"{self.TYPE}: weight_scale must be >= 1, got {self.weight_scale}")


@register_message
@dataclass(kw_only=True)
class SecAggShareKeys(Message):
    """Agent -> server: for each other roster member, one ciphertext only that member can open
    (row k is for ``recipients[k]``)."""

    TYPE: ClassVar[str] = "secagg.share_keys"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"ciphertexts": RAW}
    recipients: list = field(default_factory=list)
    ciphertexts: np.ndarray = tensor("uint8", 2)

    def validate(self) -> None:
        _unique_names(self.TYPE, "recipients", self.recipients)
        _rows(self.TYPE, "ciphertexts", self.ciphertexts, len(self.recipients), CIPHERTEXT_BYTES)
        if self.sender in self.recipients:
            raise ValueRangeError(f"{self.TYPE}: an agent keeps its own shares; {self.sender!r} is among the recipients")


@register_message
@dataclass(kw_only=True)
class SecAggShares(Message):
    """Server -> each agent that shared: the ciphertexts addressed to it (row k from
    ``senders[k]``); ``senders`` is every other agent whose shares the server holds."""

    TYPE: ClassVar[str] = "secagg.shares"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"ciphertexts": RAW}
    senders: list = field(default_factory=list)
    reason: str = ""
    ciphertexts: np.ndarray = tensor("uint8", 2)

    def validate(self) -> None:
        _unique_names(self.TYPE, "senders", self.senders)
        _rows(self.TYPE, "ciphertexts", self.ciphertexts, len(self.senders), CIPHERTEXT_BYTES)


@register_message
@dataclass(kw_only=True)
class SecAggMaskedInput(Message):
    """Agent -> server: the weighted, fixed-point update plus the agent's self mask and its
    pairwise masks, in the ring of ``ring_bits`` bits (its bits as int32 or int64, one entry per
    model float and a last one for the weight). ``int_buffers``: BatchNorm's batch counters, in clear
    (they follow from the sample count, batch size and epochs the server already knows)."""

    TYPE: ClassVar[str] = "secagg.masked_input"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"masked": RAW}
    model_version: int
    int_buffers: dict = field(default_factory=dict)
    masked: np.ndarray = tensor(("int32", "int64"), 1)

    def validate(self) -> None:
        if self.masked.size < 2:
            raise ShapeMismatchError(f"{self.TYPE}: masked must hold the update and its weight, got {self.masked.size} entries")
        for name, value in self.int_buffers.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueRangeError(f"{self.TYPE}: int_buffers[{name!r}] must be an int >= 0, got {value!r}")


@register_message
@dataclass(kw_only=True)
class SecAggUnmask(Message):
    """Server -> each survivor: whose masked input arrived (``survivors``) and who shared keys
    but sent none (``dropped``): shares of the survivors' self-mask seeds and of the dropped
    agents' mask-key seeds are asked for, never both of one agent."""

    TYPE: ClassVar[str] = "secagg.unmask"
    survivors: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    reason: str = ""

    def validate(self) -> None:
        _unique_names(self.TYPE, "survivors", self.survivors)
        _unique_names(self.TYPE, "dropped", self.dropped)
        if set(self.survivors) & set(self.dropped):
            raise ValueRangeError(f"{self.TYPE}: agents both surviving and dropped: {sorted(set(self.survivors) & set(self.dropped))}")


@register_message
@dataclass(kw_only=True)
class SecAggUnmaskShares(Message):
    """Agent -> server: its Shamir share of each named agent's seed (row k is ``owners[k]``'s),
    ``kinds[k]`` ``"b"`` (a survivor's self-mask seed) or ``"s"`` (a dropped agent's mask-key seed)."""

    TYPE: ClassVar[str] = "secagg.unmask_shares"
    DEFAULT_CODECS: ClassVar[dict[str, str]] = {"shares": RAW}
    owners: list = field(default_factory=list)
    kinds: list = field(default_factory=list)
    shares: np.ndarray = tensor("uint8", 2)

    def validate(self) -> None:
        _unique_names(self.TYPE, "owners", self.owners)
        if len(self.kinds) != len(self.owners) or not all(k in ("b", "s") for k in self.kinds):
            raise ValueRangeError(f"{self.TYPE}: kinds must be 'b' or 's', one per owner; got {self.kinds!r}")
        _rows(self.TYPE, "shares", self.shares, len(self.owners), SHARE_BYTES)


#: What an agent uploads in a secure-aggregation round (the server's method takes them as uploads).
SECAGG_UPLOADS = (SecAggAdvertise, SecAggShareKeys, SecAggMaskedInput, SecAggUnmaskShares)
#: What the server answers with, the edge's request waits for one of these.
SECAGG_ANSWERS = (SecAggRoster, SecAggShares, SecAggUnmask)

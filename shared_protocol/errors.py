"""Protocol error types.

Every way an inbound frame or chunk can be bad has its own exception type, all
deriving from :class:`ProtocolError`, so a receiver can log the specific reason,
count it, and carry on. Nothing else may escape the decoders for bad input.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error raised for a malformed or unacceptable message."""

    code = "protocol_error"


class TruncatedFrameError(ProtocolError):
    code = "truncated_frame"


class BadMagicError(ProtocolError):
    code = "bad_magic"


class UnsupportedVersionError(ProtocolError):
    code = "unsupported_version"


class LengthMismatchError(ProtocolError):
    """Header or body length disagrees with the bytes that arrived."""

    code = "length_mismatch"


class SizeLimitError(ProtocolError):
    """A declared or actual size is over a configured limit."""

    code = "size_limit"


class BudgetError(SizeLimitError):
    """A chunk arrived while its sender's (or the receiver's) reassembly budget was
    full. Not the sender's fault: the transfer stays open and the chunk is asked for
    again once the budget has room."""

    code = "over_budget"


class SenderIgnoredError(ProtocolError):
    """A chunk from a sender the receiver ignores: it kept sending invalid transfers,
    or its owner dropped it."""

    code = "ignored_sender"


class HeaderError(ProtocolError):
    """The JSON header is not valid JSON or lacks / mistypes a required field."""

    code = "bad_header"


class ShapeMismatchError(ProtocolError):
    """A tensor's shape or dtype is not what was announced or expected."""

    code = "shape_mismatch"


class NonFiniteError(ProtocolError):
    code = "non_finite"


class UnknownCodecError(ProtocolError):
    code = "unknown_codec"


class CodecError(ProtocolError):
    """A codec could not decode its payload (corrupt compressed data, bad params)."""

    code = "codec_error"


class HashMismatchError(ProtocolError):
    code = "hash_mismatch"


class UnknownEvalSetError(ProtocolError):
    """A message names (or carries) a public evaluation set other than the run's."""

    code = "unknown_eval_set"


class UnknownMessageTypeError(ProtocolError):
    code = "unknown_message_type"


class ValueRangeError(ProtocolError):
    """A value is outside its allowed range (e.g. a label >= num_classes)."""

    code = "value_range"


class ChunkError(ProtocolError):
    """A chunk's metadata is missing, inconsistent, or conflicts with its transfer."""

    code = "bad_chunk"


class ChunkVersionError(ChunkError):
    """A chunk in another chunk format version than this build's (a sender on an older or newer
    build): counted as ``bad_chunk``, its message names both versions."""


class StaleMessageError(ProtocolError):
    """A message for a round that is not the current one (replay or straggler)."""

    code = "stale_round"


class UnknownSenderError(ProtocolError):
    code = "unknown_sender"


class MapsNotHeldError(ProtocolError):
    """A claim to reuse uploaded data (maps sent once) that the receiver does not hold: another
    digest than the one it staged, sample ids it never received, or nothing staged at all
    (a restart, a resume). The sender is asked for the data in full; never used as it is."""

    code = "maps_not_held"


__all__ = [name for name in dir() if name.endswith("Error")]


class SecAggError(ProtocolError):
    """A secure-aggregation step that cannot go on as asked (shared_protocol/secagg.py): a
    message for a stage that closed, a list that contradicts the roster, too few agents left."""

    code = "secagg"


class SecAggReplayError(SecAggError):
    """A second, different message for a secure-aggregation stage the sender already took part
    in (a repeat of the same message is answered, not refused)."""

    code = "secagg_replay"


class SecAggShareError(SecAggError):
    """An encrypted share that does not decrypt or authenticate, or a share that names an agent
    outside the roster."""

    code = "secagg_bad_share"

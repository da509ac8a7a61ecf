"""The frame: the unit every EdgeSplit message travels in.

Layout (all integers big-endian)::

    offset  size  field
    0       4     magic  b"ESPL"
    4       1     protocol version (1)
    5       1     flags (0; reserved)
    6       4     header length H (bytes of UTF-8 JSON)
    10      8     body length B
    18      H     header: JSON object
    18+H    B     body: the encoded tensors, back to back

The header holds the message type, run, round, sender, message id, the
message's scalar fields, and one descriptor per tensor (name, dtype, shape,
codec, codec params, offset, length, sha256 of the encoded bytes). The format
is pinned by golden files in ``tests/golden/``; docs/protocol.md specifies it
for implementers in other languages.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codecs
from .errors import (
    BadMagicError,
    HashMismatchError,
    HeaderError,
    LengthMismatchError,
    NonFiniteError,
    ProtocolError,
    ShapeMismatchError,
    SizeLimitError,
    TruncatedFrameError,
    UnsupportedVersionError,
)

MAGIC = b"ESPL"
PROTOCOL_VERSION = 1
_PREFIX = struct.Struct(">4sBBIQ")
PREFIX_BYTES = _PREFIX.size  # 18

# dtypes allowed on the wire; anything else (object, void, ...) is refused.
ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"}
)


@dataclass(frozen=True)
class FrameLimits:
    """Upper bounds a receiver applies before it allocates anything."""

    max_header_bytes: int = 1 << 20  # 1 MiB of JSON is already absurd
    max_body_bytes: int = 1 << 30
    max_tensors: int = 4096
    max_tensor_elements: int = 1 << 28
    require_finite: bool = True

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_body_bytes", "max_tensors", "max_tensor_elements"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FrameLimits.{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = FrameLimits()


@dataclass(frozen=True)
class TensorDescriptor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    offset: int
    length: int
    sha256: str
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "codec": self.codec,
            "params": self.params,
            "offset": self.offset,
            "length": self.length,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, obj: Any) -> "TensorDescriptor":
        if not isinstance(obj, dict):
            raise HeaderError(f"tensor descriptor must be an object, got {type(obj).__name__}")
        try:
            name, dtype, shape = obj["name"], obj["dtype"], obj["shape"]
            codec, offset, length, digest = obj["codec"], obj["offset"], obj["length"], obj["sha256"]
        except KeyError as missing:
            raise HeaderError(f"tensor descriptor lacks field {missing}") from None
        params = obj.get("params", {})
        if not isinstance(name, str) or not isinstance(codec, str) or not isinstance(digest, str):
            raise HeaderError("tensor descriptor name/codec/sha256 must be strings")
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise ShapeMismatchError(f"tensor {name!r}: dtype {dtype!r} is not allowed on the wire")
        if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
            raise HeaderError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
        if not _is_nonneg_int(offset) or not _is_nonneg_int(length):
            raise HeaderError(f"tensor {name!r}: offset/length must be non-negative ints")
        if not isinstance(params, dict):
            raise HeaderError(f"tensor {name!r}: params must be an object")
        return cls(name, dtype, tuple(shape), codec, offset, length, digest, params)


def _is_nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode_frame(
    header_fields: dict[str, Any],
    tensors: dict[str, np.ndarray],
    codec_for: dict[str, str] | None = None,
    default_codec: str = "raw",
) -> bytes:
    """Encode a header dict and named arrays into one frame.

    ``codec_for`` maps tensor names to codec names; others use ``default_codec``.
    """
    codec_for = codec_for or {}
    descriptors: list[dict[str, Any]] = []
    parts: list[bytes] = []
    offset = 0
    for name, array in tensors.items():
        array = np.asarray(array)
        codec = codecs.get_codec(codec_for.get(name, default_codec))
        payload, params, decoded_dtype = codec.encode(array)
        if decoded_dtype not in ALLOWED_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {decoded_dtype} cannot go on the wire")
        desc = TensorDescriptor(
            name=name,
            dtype=decoded_dtype,
            shape=tuple(int(d) for d in array.shape),
            codec=codec.name,
            offset=offset,
            length=len(payload),
            sha256=hashlib.sha256(payload).hexdigest(),
            params=params,
        )
        descriptors.append(desc.to_json())
        parts.append(payload)
        offset += len(payload)
    header = dict(header_fields)
    header["tensors"] = descriptors
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    prefix = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header_bytes), offset)
    return b"".join([prefix, header_bytes, *parts])


@dataclass(frozen=True)
class DecodedFrame:
    header: dict[str, Any]
    descriptors: tuple[TensorDescriptor, ...]
    body: memoryview

    def tensor(self, name: str, limits: FrameLimits = DEFAULT_LIMITS) -> np.ndarray:
        for desc in self.descriptors:
            if desc.name == name:
                return decode_tensor(desc, self.body, limits)
        raise ShapeMismatchError(f"frame has no tensor named {name!r}")

    def tensors(self, limits: FrameLimits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
        return {d.name: decode_tensor(d, self.body, limits) for d in self.descriptors}


def decode_frame(data: bytes | bytearray | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> DecodedFrame:
    """Parse and check a frame's structure; tensors are decoded lazily.

    Raises a :class:`ProtocolError` subclass for every kind of malformed input.
    """
    view = memoryview(data)
    if len(view) < PREFIX_BYTES:
        raise TruncatedFrameError(f"frame is {len(view)} bytes, shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, flags, header_len, body_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadMagicError(f"expected magic {MAGIC!r}, got {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersionError(f"frame protocol version {version}; this build speaks {PROTOCOL_VERSION}")
    if flags != 0:
        # Reserved: a future flag must not be silently misread by this version.
        raise UnsupportedVersionError(f"frame flags {flags:#04x} are not understood by protocol version {PROTOCOL_VERSION}")
    if header_len > limits.max_header_bytes:
        raise SizeLimitError(f"header declares {header_len} bytes, limit {limits.max_header_bytes}")
    if body_len > limits.max_body_bytes:
        raise SizeLimitError(f"body declares {body_len} bytes, limit {limits.max_body_bytes}")
    expected = PREFIX_BYTES + header_len + body_len
    if len(view) < expected:
        raise TruncatedFrameError(f"frame declares {expected} bytes, only {len(view)} arrived")
    if len(view) > expected:
        raise LengthMismatchError(f"frame declares {expected} bytes but {len(view)} arrived")
    try:
        header = json.loads(
            bytes(view[PREFIX_BYTES : PREFIX_BYTES + header_len]).decode("utf-8"), parse_constant=_refuse_constant
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise HeaderError(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"header must be a JSON object, got {type(header).__name__}")
    raw_tensors = header.pop("tensors", [])
    if not isinstance(raw_tensors, list):
        raise HeaderError("header field 'tensors' must be a list")
    if len(raw_tensors) > limits.max_tensors:
        raise SizeLimitError(f"{len(raw_tensors)} tensors, limit {limits.max_tensors}")
    descriptors = tuple(TensorDescriptor.from_json(t) for t in raw_tensors)
    names = set()
    for desc in descriptors:
        if desc.name in names:
            raise HeaderError(f"tensor name {desc.name!r} appears twice")
        names.add(desc.name)
        if desc.offset + desc.length > body_len:
            raise LengthMismatchError(
                f"tensor {desc.name!r} spans [{desc.offset}, {desc.offset + desc.length}) past the {body_len}-byte body"
            )
        # Python ints: a crafted shape must not overflow int64 on its way to the check.
        elements = math.prod(desc.shape)
        if elements > limits.max_tensor_elements or any(d > limits.max_tensor_elements for d in desc.shape):
            raise SizeLimitError(f"tensor {desc.name!r} has {elements} elements, limit {limits.max_tensor_elements}")
    return DecodedFrame(header, descriptors, view[PREFIX_BYTES + header_len :])


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"header contains the non-JSON constant {name}")


def decode_tensor(desc: TensorDescriptor, body: memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Verify one tensor's hash, decode it, and check shape, dtype and finiteness."""
    payload = body[desc.offset : desc.offset + desc.length]
    if len(payload) != desc.length:
        raise LengthMismatchError(f"tensor {desc.name!r}: expected {desc.length} bytes, have {len(payload)}")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != desc.sha256:
        raise HashMismatchError(f"tensor {desc.name!r}: sha256 {digest[:16]}... != declared {desc.sha256[:16]}...")
    codec = codecs.get_codec(desc.codec)
    array = codec.decode(payload, desc.dtype, desc.shape, desc.params)
    if array.shape != desc.shape:
        raise ShapeMismatchError(f"tensor {desc.name!r}: decoded shape {array.shape}, declared {desc.shape}")
    if str(array.dtype) != desc.dtype:
        raise ShapeMismatchError(f"tensor {desc.name!r}: decoded dtype {array.dtype}, declared {desc.dtype}")
    if limits.require_finite and array.dtype.kind == "f" and not np.isfinite(array).all():
        raise NonFiniteError(f"tensor {desc.name!r} contains NaN or Inf")
    return array


__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "PREFIX_BYTES",
    "FrameLimits",
    "DEFAULT_LIMITS",
    "TensorDescriptor",
    "DecodedFrame",
    "encode_frame",
    "decode_frame",
    "decode_tensor",
    "ProtocolError",
]

"""Tensor codecs, registered by name.

A codec turns an array into bytes plus small JSON params (stored in the frame's
tensor descriptor) and back. Lossy codecs declare the dtype they decode to
(float32), which is what the descriptor announces. Decoders never trust the
payload: sizes are checked before anything is allocated, and every failure is a
:class:`~shared_protocol.errors.ProtocolError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import zstandard

from . import svd as _svd
from .errors import CodecError, LengthMismatchError, UnknownCodecError


class Codec(Protocol):
    name: str
    lossless: bool

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        """Return (payload, params, dtype the payload decodes to)."""
        ...

    def decode(self, payload: memoryview | bytes, dtype: str, shape: tuple[int, ...], params: dict[str, Any]) -> np.ndarray:
        ...


_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    """Add a codec to the registry; a second codec with the same name is an error."""
    if codec.name in _REGISTRY:
        raise ValueError(f"codec {codec.name!r} is already registered")
    _REGISTRY[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r}; known: {sorted(_REGISTRY)}") from None


def list_codecs() -> list[str]:
    return sorted(_REGISTRY)


def _num_elements(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _le(dtype: str) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _from_bytes(payload: memoryview | bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    wire_dtype = _le(dtype)
    expected = _num_elements(shape) * wire_dtype.itemsize
    if len(payload) != expected:
        raise LengthMismatchError(f"payload is {len(payload)} bytes; {dtype}{list(shape)} needs {expected}")
    # Copy: the frame buffer may be reused, and callers expect writable arrays.
    return np.frombuffer(payload, dtype=wire_dtype).astype(np.dtype(dtype), copy=True).reshape(shape)


def _to_le_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


# zstd contexts are not thread-safe; create per call (cheap next to the data).
def _zstd_compress(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def _zstd_decompress(payload: memoryview | bytes, expected_bytes: int) -> bytes:
    # Check the declared size before allocating: a tiny frame can claim gigabytes.
    try:
        declared = zstandard.frame_content_size(bytes(payload[:18]))
    except zstandard.ZstdError as exc:
        raise CodecError(f"not a zstd frame: {exc}") from None
    if declared != expected_bytes:
        raise LengthMismatchError(f"zstd frame declares {declared} bytes, tensor needs {expected_bytes}")
    try:
        out = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=expected_bytes)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd payload: {exc}") from None
    if len(out) != expected_bytes:
        raise LengthMismatchError(f"zstd payload decoded to {len(out)} bytes, expected {expected_bytes}")
    return out


def byte_shuffle(data: bytes, itemsize: int) -> bytes:
    """Group the k-th byte of every element together (helps zstd on floats)."""
    if itemsize == 1:
        return data
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()


def byte_unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize == 1:
        return data
    return np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()


@dataclass(frozen=True)
class RawCodec:
    """Little-endian bytes of the array, any allowed dtype, unchanged."""

    name: str = "raw"
    lossless: bool = True

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        return _to_le_bytes(array), {}, str(array.dtype)

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        return _from_bytes(payload, dtype, shape)


@dataclass(frozen=True)
class ZstdCodec:
    """Lossless: byte-shuffled little-endian bytes through zstd (weights, ids, labels)."""

    name: str = "zstd"
    lossless: bool = True
    level: int = 3

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        raw = _to_le_bytes(array)
        return _zstd_compress(byte_shuffle(raw, array.dtype.itemsize), self.level), {}, str(array.dtype)

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        itemsize = np.dtype(dtype).itemsize
        raw = byte_unshuffle(_zstd_decompress(payload, _num_elements(shape) * itemsize), itemsize)
        return _from_bytes(raw, dtype, shape)


@dataclass(frozen=True)
class Fp16ZstdCodec:
    """Floats as fp16, byte-shuffled, zstd level 1; decodes to float32.

    Values beyond fp16's range (|x| > 65504) are refused at encode time rather
    than silently turned into inf.
    """

    name: str = "fp16-zstd"
    lossless: bool = False
    level: int = 1

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        if array.dtype.kind != "f":
            raise ValueError(f"fp16-zstd encodes floating arrays, got {array.dtype}")
        with np.errstate(over="ignore"):
            half = array.astype("<f2")
        if not np.isfinite(half).all() and np.isfinite(array).all():
            raise ValueError("fp16-zstd: values exceed the fp16 range; use 'raw' or 'zstd' for this tensor")
        return _zstd_compress(byte_shuffle(half.tobytes(), 2), self.level), {}, "float32"

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        if dtype != "float32":
            raise CodecError(f"fp16-zstd decodes to float32, descriptor says {dtype}")
        raw = byte_unshuffle(_zstd_decompress(payload, _num_elements(shape) * 2), 2)
        return _from_bytes(raw, "float16", shape).astype(np.float32)


def _check_quantisable(codec: str, array: np.ndarray) -> None:
    """What an 8-bit quantiser refuses: a non-floating array, NaN or Inf, a scalar."""
    if array.dtype.kind != "f":
        raise ValueError(f"{codec} encodes floating arrays, got {array.dtype}")
    if not np.isfinite(array).all():
        raise ValueError(f"{codec} cannot encode NaN or Inf")
    if array.ndim == 0:
        raise ValueError(f"{codec} needs an array of rank >= 1")


def _channels_first(array: np.ndarray) -> tuple[int, np.ndarray]:
    """(the channel axis: 1 for rank >= 2, else 0; the array as float32 (C, rest) rows)."""
    axis = 1 if array.ndim >= 2 else 0
    moved = np.moveaxis(array.astype(np.float32), axis, 0)  # (C, ...)
    return axis, moved.reshape(moved.shape[0], -1)


def _channels_back(rows: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray:
    moved_shape = (shape[axis], *[d for i, d in enumerate(shape) if i != axis])
    return np.ascontiguousarray(np.moveaxis(rows.reshape(moved_shape), 0, axis))


@dataclass(frozen=True)
class U8ZstdCodec:
    """Per-channel uint8 quantisation of non-negative maps, then zstd.

    Channel axis is 1 for arrays of rank >= 2 (N, C, ...), else 0. Each channel c
    is stored as round(x / scale_c) with scale_c = max_c / 255, so the absolute
    error is at most max_c / 510. The scales travel in the descriptor's params.
    """

    name: str = "u8-zstd"
    lossless: bool = False
    level: int = 1

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        _check_quantisable(self.name, array)
        if array.size and float(array.min()) < 0:
            raise ValueError("u8-zstd needs non-negative values (e.g. post-ReLU maps); got a negative minimum")
        axis, flat = _channels_first(array)  # (C, rest)
        channels = flat.shape[0]
        maxima = flat.max(axis=1) if flat.shape[1] else np.zeros(channels, np.float32)
        scale = np.where(maxima > 0, maxima / 255.0, 1.0).astype(np.float32)
        quantised = np.clip(np.rint(flat / scale[:, None]), 0, 255).astype(np.uint8)
        payload = _zstd_compress(quantised.tobytes(), self.level)
        return payload, {"axis": axis, "scale": [float(s) for s in scale]}, "float32"

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        if dtype != "float32":
            raise CodecError(f"u8-zstd decodes to float32, descriptor says {dtype}")
        axis, scale = params.get("axis"), params.get("scale")
        if axis not in (0, 1) or (axis == 1 and len(shape) < 2) or (axis == 0 and len(shape) > 1):
            raise CodecError(f"u8-zstd: bad axis {axis!r} for shape {list(shape)}")
        channels = shape[axis] if shape else 1
        if not isinstance(scale, list) or len(scale) != channels or not all(isinstance(s, (int, float)) for s in scale):
            raise CodecError(f"u8-zstd: expected {channels} numeric scales, got {scale!r}")
        moved_shape = (channels, *[d for i, d in enumerate(shape) if i != axis])
        quantised = _from_bytes(_zstd_decompress(payload, _num_elements(shape)), "uint8", moved_shape)
        scales = np.asarray(scale, dtype=np.float32).reshape((channels,) + (1,) * (len(moved_shape) - 1))
        values = quantised.astype(np.float32) * scales
        return np.ascontiguousarray(np.moveaxis(values, 0, axis) if shape else values.reshape(shape))


def _float_list(params: dict[str, Any], key: str, channels: int, codec: str) -> np.ndarray:
    values = params.get(key)
    if not isinstance(values, list) or len(values) != channels or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise CodecError(f"{codec}: expected {channels} finite numbers in {key!r}, got {values!r}")
    return np.asarray(values, dtype=np.float32)


@dataclass(frozen=True)
class U8AffineZstdCodec:
    """Per-channel affine uint8 quantisation of any finite floating array, then zstd.

    Like ``u8-zstd`` but for signed values (maps with Gaussian noise added, activations before a
    ReLU): channel c is stored as round((x - offset_c) / scale_c) with offset_c its minimum and
    scale_c = (max_c - min_c) / 255, so the absolute error is at most (max_c - min_c) / 510.
    """

    name: str = "u8-affine-zstd"
    lossless: bool = False
    level: int = 1

    def encode(self, array: np.ndarray) -> tuple[bytes, dict[str, Any], str]:
        _check_quantisable(self.name, array)
        axis, flat = _channels_first(array)  # (C, rest)
        channels = flat.shape[0]
        lows = flat.min(axis=1) if flat.shape[1] else np.zeros(channels, np.float32)
        highs = flat.max(axis=1) if flat.shape[1] else np.zeros(channels, np.float32)
        with np.errstate(over="ignore"):
            spans = (highs - lows).astype(np.float32)
        if not np.isfinite(spans).all():
            raise ValueError("u8-affine-zstd: a channel's range exceeds float32; use 'raw' or 'zstd' for this tensor")
        scale = np.where(spans > 0, spans / np.float32(255.0), np.float32(1.0)).astype(np.float32)
        quantised = np.clip(np.rint((flat - lows[:, None]) / scale[:, None]), 0, 255).astype(np.uint8)
        payload = _zstd_compress(quantised.tobytes(), self.level)
        return payload, {"axis": axis, "offset": [float(v) for v in lows], "scale": [float(v) for v in scale]}, "float32"

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        if dtype != "float32":
            raise CodecError(f"u8-affine-zstd decodes to float32, descriptor says {dtype}")
        axis = params.get("axis")
        if len(shape) == 0 or axis not in (0, 1) or (axis == 1 and len(shape) < 2) or (axis == 0 and len(shape) > 1):
            raise CodecError(f"u8-affine-zstd: bad axis {axis!r} for shape {list(shape)}")
        channels = shape[axis]
        offset = _float_list(params, "offset", channels, self.name)
        scale = _float_list(params, "scale", channels, self.name)
        quantised = _from_bytes(_zstd_decompress(payload, _num_elements(shape)), "uint8", (channels, _num_elements(shape) // max(channels, 1)))
        values = offset[:, None] + quantised.astype(np.float32) * scale[:, None]  # (C, rest)
        return _channels_back(values, tuple(shape), axis)


@dataclass(frozen=True)
class SvdCodec:
    """Truncated SVD of the tensor viewed as a matrix (FedKD, Eqs. 8-9); decodes to float32.

    Encode (the array must be floating and finite; :mod:`shared_protocol.svd` has
    the details): a tensor of rank >= 2 is viewed as ``d0 x (d1 * ... * dn)``
    and factored with the smallest rank K (>= 1) whose share of the squared
    singular values exceeds ``threshold``; if ``K * (P + Q + 1) >= P * Q`` the
    factors are not smaller and it goes dense, as do tensors of rank 0 or 1.

    Payload: float32 little-endian, ``U`` (P x K, row-major), then ``S`` (K),
    then ``V`` (K x Q, row-major); or the dense values in C order. ``params``:
    ``{"mode": "factored", "rank": K, "threshold": T, "energy": retained}`` or
    ``{"mode": "dense", "rank": 0, "threshold": T}``. Decoding needs only mode,
    rank and the descriptor's shape, never T.

    The registered instance uses T = 0.95 (FedKD's default T_start). A sender
    that needs another T per call uses :meth:`with_threshold` or
    ``encode(array, threshold=T)``; the frame layer looks codecs up by name, so
    a per-round T (Eq. 9) cannot reach this instance through ``encode_message``
    -- FedKD therefore carries the payloads in its own messages
    (``shared_protocol/methods/fedkd.py``).
    """

    name: str = "svd"
    lossless: bool = False
    threshold: float = 0.95

    def __post_init__(self) -> None:
        _svd.check_threshold(self.threshold)

    def with_threshold(self, threshold: float) -> "SvdCodec":
        """The same codec with another energy threshold T (not registered; same name on the wire)."""
        return SvdCodec(name=self.name, lossless=self.lossless, threshold=threshold)

    def encode(self, array: np.ndarray, threshold: float | None = None) -> tuple[bytes, dict[str, Any], str]:
        t = self.threshold if threshold is None else _svd.check_threshold(threshold)
        packed = _svd.factorize(array, t)
        params: dict[str, Any] = {"mode": packed.mode, "rank": packed.rank, "threshold": t}
        if packed.mode == "factored":
            params["energy"] = packed.energy
        return _to_le_bytes(packed.values), params, "float32"

    def decode(self, payload, dtype, shape, params):  # type: ignore[no-untyped-def]
        if dtype != "float32":
            raise CodecError(f"svd decodes to float32, descriptor says {dtype}")
        if len(payload) % 4:
            raise LengthMismatchError(f"svd payload is {len(payload)} bytes, not a whole number of float32 values")
        values = _from_bytes(payload, "float32", (len(payload) // 4,))
        try:
            packed = _svd.unpack(values, tuple(shape), params.get("mode"), params.get("rank"))
        except ValueError as exc:
            raise CodecError(f"svd: {exc}") from None
        return packed.reconstruct()


register_codec(RawCodec())
register_codec(ZstdCodec())
register_codec(Fp16ZstdCodec())
register_codec(U8ZstdCodec())
register_codec(U8AffineZstdCodec())
register_codec(SvdCodec())

__all__ = [
    "Codec",
    "register_codec",
    "get_codec",
    "list_codecs",
    "byte_shuffle",
    "byte_unshuffle",
    "RawCodec",
    "ZstdCodec",
    "Fp16ZstdCodec",
    "U8ZstdCodec",
    "U8AffineZstdCodec",
    "SvdCodec",
]

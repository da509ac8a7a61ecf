"""Codec round trips and registry behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from shared_protocol import codecs
from shared_protocol.errors import CodecError, LengthMismatchError, UnknownCodecError


def relu_maps(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(rng.normal(0.2, 1.0, size=(8, 16, 32, 32)), 0).astype(np.float32)  # (N, C, H, W)


@pytest.mark.parametrize("name", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint8", "bool", "float16"])
def test_lossless_codecs_round_trip_exactly(name: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    array = (rng.normal(size=(3, 5, 7)) * 100).astype(dtype)
    codec = codecs.get_codec(name)
    payload, params, decoded_dtype = codec.encode(array)
    out = codec.decode(memoryview(payload), decoded_dtype, array.shape, params)
    assert out.dtype == array.dtype
    np.testing.assert_array_equal(out, array)


def test_fp16_zstd_relative_error_and_ratio() -> None:
    maps = relu_maps()
    codec = codecs.get_codec("fp16-zstd")
    payload, params, dtype = codec.encode(maps)
    out = codec.decode(payload, dtype, maps.shape, params)
    assert out.dtype == np.float32
    rel = np.abs(out - maps).max() / np.abs(maps).max()
    assert rel < 1e-3
    assert len(payload) < maps.nbytes / 2  # at least the fp16 halving, zstd adds on real maps


def test_fp16_refuses_out_of_range_values() -> None:
    with pytest.raises(ValueError, match="fp16 range"):
        codecs.get_codec("fp16-zstd").encode(np.array([1e6], np.float32))


def test_u8_zstd_error_within_one_percent_per_channel() -> None:
    maps = relu_maps(2)
    maps[:, 3] *= 50.0  # channels with very different ranges
    maps[:, 5] = 0.0  # an all-zero channel must not divide by zero
    codec = codecs.get_codec("u8-zstd")
    payload, params, dtype = codec.encode(maps)
    out = codec.decode(payload, dtype, maps.shape, params)
    assert out.shape == maps.shape
    channel_max = maps.max(axis=(0, 2, 3))
    err = np.abs(out - maps).max(axis=(0, 2, 3))
    assert np.all(err <= np.maximum(channel_max, 1e-12) * 1e-2)
    np.testing.assert_array_equal(out[:, 5], 0.0)
    assert len(params["scale"]) == 16


def test_u8_zstd_refuses_negative_values() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        codecs.get_codec("u8-zstd").encode(np.array([[-1.0, 2.0]], np.float32))


def test_u8_zstd_rejects_bad_params() -> None:
    maps = relu_maps()[:1]
    codec = codecs.get_codec("u8-zstd")
    payload, params, dtype = codec.encode(maps)
    with pytest.raises(CodecError):
        codec.decode(payload, dtype, maps.shape, {"axis": 1, "scale": [1.0] * 3})
    with pytest.raises(CodecError):
        codec.decode(payload, dtype, maps.shape, {"axis": 7, "scale": params["scale"]})


def test_zstd_decoder_checks_declared_size_before_allocating() -> None:
    codec = codecs.get_codec("zstd")
    payload, params, dtype = codec.encode(np.zeros(10, np.float32))
    with pytest.raises(LengthMismatchError):
        codec.decode(payload, dtype, (1_000_000_000,), params)
    with pytest.raises(CodecError):
        codec.decode(b"not zstd at all, not at all", dtype, (10,), params)


def test_registry_refuses_duplicates_and_names_unknowns() -> None:
    with pytest.raises(ValueError, match="already registered"):
        codecs.register_codec(codecs.RawCodec())
    with pytest.raises(UnknownCodecError, match="nope"):
        codecs.get_codec("nope")
    assert {"raw", "zstd", "fp16-zstd", "u8-zstd"} <= set(codecs.list_codecs())


def test_u8_zstd_refuses_non_finite_and_scalars() -> None:
    codec = codecs.get_codec("u8-zstd")
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(ValueError, match="Inf"):
        codec.encode(np.array([[1.0, np.inf]], np.float32))
    with pytest.raises(ValueError, match="rank"):
        codec.encode(np.array(1.0, np.float32))

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


def test_u8_affine_zstd_takes_signed_maps_within_half_a_step_per_channel() -> None:
    rng = np.random.default_rng(3)
    maps = relu_maps(3) + rng.normal(0.0, 0.3, size=(8, 16, 32, 32)).astype(np.float32)  # noised: negatives too
    maps[:, 3] *= 50.0
    maps[:, 5] = -2.5  # a constant channel: no division by zero, decoded exactly
    codec = codecs.get_codec("u8-affine-zstd")
    payload, params, dtype = codec.encode(maps)
    out = codec.decode(payload, dtype, maps.shape, params)
    assert out.shape == maps.shape and out.dtype == np.float32
    span = maps.max(axis=(0, 2, 3)) - maps.min(axis=(0, 2, 3))
    err = np.abs(out - maps).max(axis=(0, 2, 3))
    assert np.all(err <= span / 510 * (1 + 1e-5) + 1e-6)
    np.testing.assert_array_equal(out[:, 5], -2.5)
    # Positive control: u8-zstd refuses these maps; fp16-zstd takes them at more bytes.
    with pytest.raises(ValueError, match="non-negative"):
        codecs.get_codec("u8-zstd").encode(maps)
    assert len(payload) < len(codecs.get_codec("fp16-zstd").encode(maps)[0])
    vector = np.array([-1.0, 0.5, 2.0], np.float32)  # rank 1: each entry its own channel, as in u8-zstd
    p, pa, d = codec.encode(vector)
    assert pa["axis"] == 0 and pa["offset"] == [-1.0, 0.5, 2.0]
    np.testing.assert_array_equal(codec.decode(p, d, vector.shape, pa), vector)


def test_u8_affine_zstd_refuses_what_it_cannot_carry_and_bad_params() -> None:
    codec = codecs.get_codec("u8-affine-zstd")
    for bad, said in ((np.array([[1.0, np.nan]], np.float32), "NaN"), (np.array(1.0, np.float32), "rank"),
                      (np.array([1, 2], np.int64), "floating"), (np.array([[-3e38], [3e38]], np.float32), "range")):
        with pytest.raises(ValueError, match=said):
            codec.encode(bad)
    maps = relu_maps()[:1] - 0.5
    payload, params, dtype = codec.encode(maps)
    for broken in ({**params, "offset": params["offset"][:3]}, {**params, "scale": [float("nan")] * 16},
                   {**params, "axis": 0}, {**params, "offset": None}, {**params, "scale": [True] * 16}):
        with pytest.raises(CodecError):
            codec.decode(payload, dtype, maps.shape, broken)
    with pytest.raises(CodecError, match="float32"):
        codec.decode(payload, "float64", maps.shape, params)


def test_the_protocol_docs_test_vectors() -> None:
    """docs/protocol.md's codec test vectors: each row's content before zstd and params are what
    the reference encoder makes of the table's x, and its reference payload decodes back to what
    the doc says (every registered codec but svd, whose vectors are in tests/test_svd_codec.py)."""
    import json
    import re
    from pathlib import Path

    import zstandard

    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    table = text.split("### Test vectors", 1)[1].split("## 5.", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `?([0-9a-f-]+)`? \| `([0-9a-f]+)` \| `(\{.*\})` \|$", table, re.M)
    assert {r[0] for r in rows} == set(codecs.list_codecs()) - {"svd"}
    x = np.array([[[0.0, 1.5], [3.0, 0.25]]], np.float32)
    for name, content, reference, params_json in rows:
        codec = codecs.get_codec(name)
        payload, params, dtype = codec.encode(x)
        made = payload if content == "-" else zstandard.ZstdDecompressor().decompress(payload)
        assert made.hex() == (reference if content == "-" else content), name
        doc_params = json.loads(params_json)
        assert params.keys() == doc_params.keys(), name
        for key, value in doc_params.items():
            np.testing.assert_allclose(params[key], value, rtol=1e-12, err_msg=name)
        decoded = codec.decode(bytes.fromhex(reference), dtype, x.shape, doc_params)
        tolerance = {"u8-zstd": 0.0059, "fp16-zstd": 1e-3}.get(name, 0.0)
        np.testing.assert_allclose(decoded, x, atol=tolerance, err_msg=name)

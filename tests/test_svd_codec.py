"""The ``svd`` codec and the factorisation under it (FedKD, Eqs. 8-9; shared_protocol/svd.py).

Checked against numpy's SVD: the rank is Eq. 8's (smallest K whose share of the
squared singular values exceeds T), the squared reconstruction error equals the
discarded energy, K >= 1 always, the dense fallback triggers exactly when the
factors would not be smaller, and none of the public FedKD code's bugs (4-D
conv weights factored as they are, rank 0 when T is never reached, ``U @ S @ V``
with S a vector).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_protocol import codecs, svd
from shared_protocol.errors import CodecError, LengthMismatchError, ProtocolError
from shared_protocol.messages import RoundStart, decode_message, encode_message


def matrix_with_spectrum(p: int, q: int, singular_values: np.ndarray, seed: int = 0) -> np.ndarray:
    """A (p, q) float64 matrix with exactly the given singular values (random singular vectors)."""
    rng = np.random.default_rng(seed)
    k = len(singular_values)
    u, _ = np.linalg.qr(rng.normal(size=(p, k)))  # (p, k) orthonormal columns
    v, _ = np.linalg.qr(rng.normal(size=(q, k)))  # (q, k)
    return (u * singular_values) @ v.T  # (p, q)


def rank_by_definition(s: np.ndarray, threshold: float) -> int:
    """Eq. 8 spelled out: the smallest K with sum_{i<=K} s_i^2 / sum s_i^2 > T (full rank if none)."""
    total = float(np.sum(s.astype(np.float64) ** 2))
    for k in range(1, len(s) + 1):
        if float(np.sum(s[:k].astype(np.float64) ** 2)) / total > threshold:
            return k
    return len(s)


# (tensor shape, its 2-D view): conv out x (in*kh*kw), linear, tall, wide.
SHAPES = [
    ((32, 8, 3, 3), (32, 72)),
    ((40, 60), (40, 60)),
    ((300, 24), (300, 24)),
    ((24, 300), (24, 300)),
]


@pytest.mark.parametrize("shape,view", SHAPES, ids=["conv", "linear", "tall", "wide"])
@pytest.mark.parametrize("threshold", [0.5, 0.9, 0.95, 0.98])
def test_reconstruction_error_is_the_discarded_energy(shape: tuple[int, ...], view: tuple[int, int], threshold: float) -> None:
    p, q = view
    n = min(p, q)
    spectrum = 10.0 * 0.8 ** np.arange(n)  # decaying, all distinct
    array = matrix_with_spectrum(p, q, spectrum, seed=n).reshape(shape).astype(np.float32)
    codec = codecs.get_codec("svd").with_threshold(threshold)  # type: ignore[attr-defined]

    payload, params, dtype = codec.encode(array)
    decoded = codec.decode(payload, dtype, array.shape, params)

    s = np.linalg.svd(array.astype(np.float64).reshape(p, q), compute_uv=False)  # numpy's, on the 2-D view
    k = rank_by_definition(s, threshold)
    assert params["mode"] == "factored" and params["rank"] == k >= 1
    assert len(payload) == 4 * k * (p + q + 1)  # U is (out, in*kh*kw): the conv was reshaped, not factored per kernel
    discarded = float(np.sum(s[k:] ** 2))
    error = float(np.sum((decoded.astype(np.float64) - array.astype(np.float64)) ** 2))
    total = float(np.sum(s**2))
    assert error == pytest.approx(discarded, rel=1e-3, abs=1e-6 * total)
    assert params["energy"] == pytest.approx(1.0 - discarded / total, abs=1e-9)
    assert params["energy"] > threshold
    assert decoded.dtype == np.float32 and decoded.shape == shape


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    p=st.integers(2, 40), q=st.integers(2, 40), threshold=st.floats(0.01, 1.0),
    decay=st.floats(0.3, 1.0), seed=st.integers(0, 10_000),
)
def test_rank_and_error_for_any_matrix(p: int, q: int, threshold: float, decay: float, seed: int) -> None:
    spectrum = decay ** np.arange(min(p, q))
    array = matrix_with_spectrum(p, q, spectrum, seed).astype(np.float32)
    packed = svd.factorize(array, threshold)
    s = np.linalg.svd(array.astype(np.float64), compute_uv=False)
    k = rank_by_definition(s, threshold)
    if k * (p + q + 1) >= p * q:
        assert packed.mode == "dense" and packed.rank == 0
        np.testing.assert_array_equal(packed.reconstruct(), array)
    else:
        assert packed.mode == "factored" and packed.rank == k >= 1
        error = float(np.sum((packed.reconstruct().astype(np.float64) - array) ** 2))
        assert error == pytest.approx(float(np.sum(s[k:] ** 2)), rel=1e-3, abs=1e-6 * float(np.sum(s**2)))


def test_rank_is_at_least_one_and_at_most_full() -> None:
    s = np.array([4.0, 2.0, 1.0, 0.5])
    assert svd.choose_rank(s, 1e-9) == 1
    assert svd.choose_rank(s, 16 / 21.25) == 2  # exactly the first value's share: "> T" needs a second
    assert svd.choose_rank(s, 1.0) == 4  # never strictly exceeded: full rank, not 0
    assert svd.choose_rank(np.zeros(5), 0.95) == 1  # nothing to keep, still one component
    # The public code's loop, for k in range(len(s)): if sum(s[:k]^2) > T * total, never looks at
    # all values; on a flat spectrum with T = 0.99 it falls through with K = 0 (a zero update).
    flat = np.ones(4)
    assert svd.choose_rank(flat, 0.99) == 4
    zero = svd.factorize(np.zeros((20, 30), np.float32), 0.95)
    assert zero.mode == "factored" and zero.rank == 1
    np.testing.assert_array_equal(zero.reconstruct(), 0.0)
    with pytest.raises(ValueError):
        svd.choose_rank(np.array([]), 0.5)


@pytest.mark.parametrize("p,q", [(2, 3), (3, 2), (3, 8), (8, 3), (4, 5), (5, 4), (6, 9), (16, 16), (16, 144), (64, 16), (10, 64)])
def test_dense_fallback_exactly_when_factors_are_not_smaller(p: int, q: int) -> None:
    """For every K: factored iff K * (P + Q + 1) < P * Q. The first five shapes include
    the boundary K * (P + Q + 1) == P * Q (K = 1 at 2 x 3, K = 2 at 3 x 8 and 4 x 5)."""
    n = min(p, q)
    for k in range(1, n + 1):
        # K equal singular values of 1, the rest tiny: T = 0.999 keeps exactly K (K - 1 of them hold <= 99.9%).
        spectrum = np.concatenate([np.ones(k), np.full(n - k, 1e-4)])
        array = matrix_with_spectrum(p, q, spectrum, seed=k).astype(np.float32)
        assert svd.choose_rank(np.linalg.svd(array.astype(np.float64), compute_uv=False), 0.999) == k
        packed = svd.factorize(array, 0.999)
        smaller = k * (p + q + 1) < p * q
        assert packed.mode == ("factored" if smaller else "dense"), (p, q, k)
        assert packed.payload_elements == (k * (p + q + 1) if smaller else p * q)
        assert packed.payload_elements <= p * q
        # Eq. 8's K is kept for the report even when the tensor went dense (None: no SVD was
        # needed, since not even rank-1 factors are smaller than a 2 x 3 matrix).
        assert packed.eq8_rank == (None if p + q + 1 >= p * q else k)


def test_boundary_cases_are_dense() -> None:
    assert 1 * (2 + 3 + 1) == 2 * 3 and 2 * (4 + 5 + 1) == 4 * 5  # equal sizes: not smaller
    assert svd.factorize(matrix_with_spectrum(2, 3, np.array([1.0, 1e-4])).astype(np.float32), 0.5).mode == "dense"
    assert svd.factorize(matrix_with_spectrum(4, 5, np.array([1.0, 1.0, 1e-4, 1e-4])).astype(np.float32), 0.9).mode == "dense"
    assert svd.factorize(matrix_with_spectrum(4, 6, np.array([1.0, 1.0, 1e-4, 1e-4])).astype(np.float32), 0.9).mode == "factored"


@pytest.mark.parametrize("shape", [(), (7,), (64,), (0, 5), (3, 0, 2), (1, 50), (50, 1)])
def test_scalars_vectors_empty_and_degenerate_tensors_go_dense(shape: tuple[int, ...]) -> None:
    array = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    codec = codecs.get_codec("svd")
    payload, params, dtype = codec.encode(array)
    assert params["mode"] == "dense" and params["rank"] == 0
    assert len(payload) == array.nbytes
    np.testing.assert_array_equal(codec.decode(payload, dtype, shape, params), array)


def test_factors_rebuild_as_u_times_diag_s_times_v() -> None:
    array = matrix_with_spectrum(12, 20, 2.0 ** -np.arange(12)).astype(np.float32)
    packed = svd.factorize(array, 0.99)
    u, s, v = packed.factors()  # (P, K), (K,), (K, Q)
    assert u.shape == (12, packed.rank) and s.shape == (packed.rank,) and v.shape == (packed.rank, 20)
    assert np.all(s[:-1] >= s[1:]) and np.all(s > 0)
    np.testing.assert_allclose(packed.reconstruct(), u @ np.diag(s) @ v, rtol=1e-5, atol=1e-6)
    # With S a vector, U @ S @ V is not the product of the factors: U @ S is already a (P,) vector.
    assert (u @ s).shape == (12,)


def test_codec_is_registered_and_usable_by_any_message() -> None:
    codec = codecs.get_codec("svd")
    assert "svd" in codecs.list_codecs() and codec.name == "svd" and not codec.lossless
    assert codec.threshold == 0.95  # type: ignore[attr-defined]
    weights = {"w": matrix_with_spectrum(32, 48, 0.5 ** np.arange(32)).astype(np.float32), "b": np.arange(5, dtype=np.float32)}
    msg = RoundStart(run="r", round=1, sender="server", method="any", deadline_s=1.0, weights=weights)
    blob = encode_message(msg, codecs={"weights": "svd"})
    out = decode_message(blob)
    assert isinstance(out, RoundStart)
    np.testing.assert_array_equal(out.weights["b"], weights["b"])
    s = np.linalg.svd(weights["w"].astype(np.float64), compute_uv=False)
    k = rank_by_definition(s, 0.95)
    assert float(np.sum((out.weights["w"] - weights["w"]) ** 2)) == pytest.approx(float(np.sum(s[k:] ** 2)), rel=1e-3)
    assert len(blob) < len(encode_message(msg, codecs={"weights": "raw"}))


def test_per_call_threshold() -> None:
    array = matrix_with_spectrum(30, 40, 0.8 ** np.arange(30)).astype(np.float32)
    codec = codecs.get_codec("svd")
    low = codec.encode(array, threshold=0.5)[1]["rank"]  # type: ignore[call-arg]
    high = codec.with_threshold(0.99).encode(array)[1]["rank"]  # type: ignore[attr-defined]
    assert 1 <= low < high
    assert codec.threshold == 0.95  # type: ignore[attr-defined]  (the registered instance is unchanged)
    for bad in (0.0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError):
            codec.with_threshold(bad)  # type: ignore[attr-defined]
        with pytest.raises(ValueError):
            svd.factorize(array, bad)  # type: ignore[arg-type]


def test_encoder_refuses_non_float_and_non_finite() -> None:
    codec = codecs.get_codec("svd")
    with pytest.raises(ValueError, match="floating"):
        codec.encode(np.ones((4, 4), np.int64))
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([[1.0, np.nan], [0.0, 1.0]], np.float32))


def test_decoder_rejects_inconsistent_payloads() -> None:
    codec = codecs.get_codec("svd")
    array = matrix_with_spectrum(20, 30, 0.5 ** np.arange(20)).astype(np.float32)
    payload, params, dtype = codec.encode(array)
    k = params["rank"]
    assert params["mode"] == "factored"
    bad_params = [
        {**params, "rank": 0},  # the public code's rank 0
        {**params, "rank": 21},  # above min(P, Q)
        {**params, "rank": k + 1},  # payload too short for it
        {**params, "rank": "3"},
        {**params, "mode": "lowrank"},
        {**params, "mode": "dense"},  # dense needs rank 0 and P * Q values
        {},
    ]
    for p in bad_params:
        with pytest.raises(CodecError):
            codec.decode(payload, dtype, array.shape, p)
    with pytest.raises(CodecError):
        codec.decode(payload, "float64", array.shape, params)
    with pytest.raises(LengthMismatchError):
        codec.decode(payload[:-2], dtype, array.shape, params)
    with pytest.raises(CodecError):
        codec.decode(payload, dtype, (600,), params)  # a vector cannot be factored
    with pytest.raises(ProtocolError):
        codec.decode(payload[:-4], dtype, array.shape, params)


def test_threshold_schedule() -> None:
    """Eq. 9: T(t) = T_start + (T_end - T_start) t; t runs from 0 (round 1) to 1 (last round)."""
    assert svd.threshold_at(0.0, 0.95, 0.98) == 0.95
    assert svd.threshold_at(1.0, 0.95, 0.98) == pytest.approx(0.98)
    assert svd.threshold_at(0.5, 0.95, 0.98) == pytest.approx(0.965)
    assert [svd.round_progress(r, 5) for r in range(1, 6)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert svd.round_progress(1, 1) == 0.0
    assert svd.round_progress(9, 5) == 1.0  # past the horizon: T stays at T_end
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError):
            svd.threshold_at(bad, 0.95, 0.98)
    with pytest.raises(ValueError):
        svd.threshold_at(0.5, 0.0, 0.98)
    with pytest.raises(ValueError):
        svd.round_progress(0, 5)


def test_payload_sizes_by_formula() -> None:
    assert svd.matrix_shape((64, 16, 1, 1)) == (64, 16)
    assert svd.matrix_shape((16, 16, 3, 3)) == (16, 144)
    assert svd.matrix_shape((16,)) is None and svd.matrix_shape(()) is None and svd.matrix_shape((0, 3)) is None
    assert svd.payload_elements((16, 16, 3, 3), "factored", 5) == 5 * (16 + 144 + 1)
    assert svd.payload_elements((16, 16, 3, 3), "dense", 0) == math.prod((16, 16, 3, 3))
    for mode, rank in (("factored", 0), ("factored", 17), ("dense", 1), ("other", 1)):
        with pytest.raises(ValueError):
            svd.payload_elements((16, 16, 3, 3), mode, rank)


def test_protocol_doc_test_vectors() -> None:
    """The `svd` test vectors docs/protocol.md §4 points to: fixed payloads decode to the
    expected tensors, and the encoder makes the specified choices (mode, rank, energy, payload size).
    Factored payload bytes are not compared: singular vectors are unique only up to sign."""
    codec = codecs.get_codec("svd")
    twos = np.full((4, 1, 2, 2), 2.0, np.float32)  # the 4 x 4 matrix of 2s: s = (8, 0, 0, 0)
    payload = bytes.fromhex("000000bf" * 4 + "00000041" + "000000bf" * 4)  # U = -0.5, s = 8, V = -0.5
    np.testing.assert_array_equal(codec.decode(payload, "float32", twos.shape, {"mode": "factored", "rank": 1}), twos)
    encoded, params, _ = codec.encode(twos)
    assert (params["mode"], params["rank"], params["energy"], len(encoded)) == ("factored", 1, 1.0, 36)

    small = np.array([[1, 2, 3], [4, 5, 6]], np.float32)  # 2 + 3 + 1 >= 2 * 3: never factored
    dense_hex = "0000803f0000004000004040000080400000a0400000c040"
    for threshold in (0.01, 0.95, 1.0):
        encoded, params, _ = codec.encode(small, threshold=threshold)  # type: ignore[call-arg]
        assert (params["mode"], params["rank"], encoded.hex()) == ("dense", 0, dense_hex)
    np.testing.assert_array_equal(codec.decode(bytes.fromhex(dense_hex), "float32", (2, 3), {"mode": "dense", "rank": 0}), small)

    diag = np.zeros((6, 5), np.float32)
    diag[0, 0], diag[1, 1], diag[2, 2] = 3.0, 2.0, 1.0  # s = (3, 2, 1, 0, 0): energies 9/14, 13/14, 1
    u = "0000803f00000000" + "000000000000803f" + "00000000" * 8  # (6, 2): rows e1, e2, then zeros
    s = "00004040" + "00000040"  # (3, 2)
    v = "0000803f" + "00000000" * 4 + "000000000000803f" + "00000000" * 3  # (2, 5): rows e1, e2
    rank2 = codec.decode(bytes.fromhex(u + s + v), "float32", (6, 5), {"mode": "factored", "rank": 2})
    expected = diag.copy()
    expected[2, 2] = 0.0
    np.testing.assert_array_equal(rank2, expected)
    for threshold, mode, rank, energy, size in ((0.5, "factored", 1, 9 / 14, 48), (0.9, "factored", 2, 13 / 14, 96),
                                                (0.95, "dense", 0, None, 120)):
        encoded, params, _ = codec.encode(diag, threshold=threshold)  # type: ignore[call-arg]
        assert (params["mode"], params["rank"], len(encoded)) == (mode, rank, size)
        assert params.get("energy") == (None if energy is None else pytest.approx(energy))
        decoded = codec.decode(encoded, "float32", diag.shape, params)
        assert float(np.sum((decoded - diag) ** 2)) == pytest.approx({1: 5.0, 2: 1.0, 0: 0.0}[rank], abs=1e-6)

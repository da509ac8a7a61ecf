"""Truncated SVD of tensors for the wire (FedKD, Wu et al. 2022, Eqs. 8-9).

Every tensor is sent either *factored* or *dense*:

* A tensor of rank >= 2 and shape ``(d0, d1, ..., dn)`` is viewed as the matrix
  ``(P, Q) = (d0, d1 * ... * dn)``: a conv weight ``(out, in, kh, kw)`` becomes
  ``out x (in * kh * kw)``, a linear weight stays ``out x in``. (Factoring the
  4-D array as it is would make numpy decompose each ``kh x kw`` kernel on its
  own, which is what the public FedKD code does by accident.)
* Its singular values ``s_1 >= s_2 >= ... >= s_Q'`` (``Q' = min(P, Q)``) are
  computed in float64, and the rank is Eq. 8 read literally: the smallest ``K``
  with ``sum_{i<=K} s_i^2 / sum_i s_i^2 > T`` (energy = *squared* singular
  values; strictly greater, as the paper writes it). ``K`` is at least 1 and,
  when the ratio never exceeds ``T`` (``T = 1``, or rounding just below it),
  it is ``Q'``: the full, exact factorisation, never the zero update that the
  public code sends when its loop falls through with ``K = 0``. A zero matrix
  has no energy to keep and gets ``K = 1`` (its factors reconstruct zeros).
* The factors go as ``U (P x K)``, ``S (K,)`` -- the singular values as a
  vector, the diagonal of Sigma -- and ``V (K x Q)``; the tensor is rebuilt as
  ``(U * S) @ V``. (``U @ S @ V`` with ``S`` a vector, as in the public code,
  is a matrix-vector product and silently computes something else.)
* Dense fallback: when ``K * (P + Q + 1) >= P * Q`` the factors are not
  smaller than the matrix, and it goes dense. (The paper's condition
  ``PK + K^2 + KQ < PQ`` counts Sigma as a full K x K matrix; only its
  diagonal travels here.) Tensors of rank 0 or 1 (biases, norms, BatchNorm
  statistics) and empty tensors always go dense.

Values travel as float32. :class:`SvdTensor` packs one tensor into one flat
float32 vector -- ``U`` row-major, then ``S``, then ``V`` row-major; or the
dense values in C order -- which is the ``svd`` codec's payload
(:mod:`shared_protocol.codecs`) and what FedKD messages carry per tensor.

numpy only (no torch): both the agent and the server use this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "SvdTensor",
    "SvdMode",
    "matrix_shape",
    "choose_rank",
    "factorize",
    "unpack",
    "payload_elements",
    "threshold_at",
    "round_progress",
    "check_threshold",
]

SvdMode = Literal["factored", "dense"]


def check_threshold(threshold: float) -> float:
    """``threshold`` as a float if it is a valid energy threshold T in (0, 1], else ValueError."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"SVD energy threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The 2-D view ``(d0, d1 * ... * dn)`` of a tensor, or None for tensors sent dense
    (rank < 2, or no elements)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def choose_rank(singular_values: np.ndarray, threshold: float) -> int:
    """Eq. 8: the smallest K with ``sum_{i<=K} s_i^2 / sum_i s_i^2 > threshold``.

    ``singular_values`` must be sorted in decreasing order (as numpy returns them).
    Always in ``[1, len(singular_values)]``: 1 for a zero matrix, the full count
    when the energy ratio never exceeds ``threshold``.
    """
    threshold = check_threshold(threshold)
    s = np.asarray(singular_values, dtype=np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"need a non-empty vector of singular values, got shape {s.shape}")
    energy = np.cumsum(s * s)  # (Q',)
    total = float(energy[-1])
    if total <= 0.0:
        return 1  # nothing to keep; one (zero) component is the smallest valid rank
    # First index whose retained fraction is strictly above T; past the end: full rank.
    k = int(np.searchsorted(energy / total, threshold, side="right")) + 1
    return min(k, s.size)


def threshold_at(progress: float, start: float, end: float) -> float:
    """Eq. 9: ``T(t) = T_start + (T_end - T_start) * t`` for training progress t in [0, 1]."""
    start, end = check_threshold(start), check_threshold(end)
    if isinstance(progress, bool) or not 0.0 <= float(progress) <= 1.0:
        raise ValueError(f"training progress t must be in [0, 1], got {progress!r}")
    return start + (end - start) * float(progress)


def round_progress(round_: int, rounds: int) -> float:
    """Training progress of round ``round_`` (1-based) of ``rounds``: 0 in the first
    round, 1 in the last, linear in between (so T(t) runs exactly from T_start to T_end)."""
    if rounds < 1 or round_ < 1:
        raise ValueError(f"need 1 <= round and 1 <= rounds, got round {round_} of {rounds}")
    if rounds == 1:
        return 0.0
    return min(1.0, (round_ - 1) / (rounds - 1))


@dataclass(frozen=True, eq=False)
class SvdTensor:
    """One tensor as it travels: factored (``U``, ``S``, ``V``) or dense.

    ``values`` is the flat float32 payload (see the module docstring); ``rank`` is
    K for a factored tensor and 0 for a dense one. ``energy`` is the retained
    fraction of the squared singular values (1.0 when dense; None when received,
    since the discarded values never travel). ``eq8_rank`` is the K Eq. 8 chose
    for a matrix, also when it then went dense (None for vectors, for matrices
    too small for any factors to pay, and for received tensors).
    """

    shape: tuple[int, ...]
    mode: SvdMode
    rank: int
    values: np.ndarray  # (n,) float32
    energy: float | None = 1.0
    eq8_rank: int | None = None

    @property
    def dense_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_elements(self) -> int:
        return int(self.values.size)

    @property
    def payload_bytes(self) -> int:
        return 4 * self.payload_elements

    def factors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``U (P, K)``, ``S (K,)``, ``V (K, Q)`` as float32 views of ``values``."""
        if self.mode != "factored":
            raise ValueError("a dense tensor has no factors")
        p, q = matrix_shape(self.shape)  # type: ignore[misc]
        k = self.rank
        u = self.values[: p * k].reshape(p, k)  # (P, K)
        s = self.values[p * k : p * k + k]  # (K,)
        v = self.values[p * k + k :].reshape(k, q)  # (K, Q)
        return u, s, v

    def reconstruct(self) -> np.ndarray:
        """The tensor, float32, in its original shape."""
        if self.mode == "dense":
            return self.values.astype(np.float32, copy=True).reshape(self.shape)
        u, s, v = self.factors()
        # Scale U's columns by S (a vector: the diagonal of Sigma), then one matmul.
        # float32 throughout: the result is no larger than the tensor itself, so a
        # small payload claiming a huge shape costs no more memory than with any
        # other codec (the frame's element limit bounds it).
        matrix = (u * s[None, :]) @ v  # (P, K) * (1, K) -> (P, K); @ (K, Q) -> (P, Q)
        return np.ascontiguousarray(matrix, dtype=np.float32).reshape(self.shape)


def factorize(array: np.ndarray, threshold: float) -> SvdTensor:
    """Factor ``array`` with the rank of Eq. 8 at ``threshold``, or keep it dense (see module docs).

    Raises ValueError for non-floating or non-finite input and a bad threshold.
    """
    threshold = check_threshold(threshold)
    array = np.asarray(array)
    if array.dtype.kind != "f":
        raise ValueError(f"SVD encodes floating arrays, got {array.dtype}")
    if not np.isfinite(array).all():
        raise ValueError("SVD cannot encode NaN or Inf")
    shape = tuple(int(d) for d in array.shape)
    dims = matrix_shape(shape)
    if dims is None:
        return _dense(array, shape)
    p, q = dims
    if (p + q + 1) >= p * q:
        return _dense(array, shape)  # even rank 1 is not smaller (e.g. a 1 x n or 2 x 2 matrix)
    matrix = array.astype(np.float64).reshape(p, q)  # (P, Q)
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)  # (P, Q'), (Q',), (Q', Q)
    k = choose_rank(s, threshold)
    if k * (p + q + 1) >= p * q:
        return _dense(array, shape, eq8_rank=k)
    total = float(np.sum(s * s))
    energy = float(np.sum(s[:k] * s[:k]) / total) if total > 0 else 1.0
    values = np.concatenate([u[:, :k].ravel(), s[:k], vt[:k].ravel()]).astype(np.float32)
    return SvdTensor(shape, "factored", k, values, energy, eq8_rank=k)


def _dense(array: np.ndarray, shape: tuple[int, ...], eq8_rank: int | None = None) -> SvdTensor:
    return SvdTensor(shape, "dense", 0, np.ascontiguousarray(array, dtype=np.float32).reshape(-1), 1.0, eq8_rank)


def payload_elements(shape: tuple[int, ...], mode: str, rank: int) -> int:
    """Float32 values the payload of a tensor of ``shape`` sent as ``mode`` at ``rank`` has;
    ValueError if that combination is not valid (K must be in [1, min(P, Q)] when factored,
    0 when dense)."""
    shape = tuple(int(d) for d in shape)
    if mode == "dense":
        if rank != 0 or isinstance(rank, bool):
            raise ValueError(f"a dense tensor has rank 0, got {rank!r}")
        return math.prod(shape)
    if mode != "factored":
        raise ValueError(f"SVD mode must be 'factored' or 'dense', got {mode!r}")
    dims = matrix_shape(shape)
    if dims is None:
        raise ValueError(f"a tensor of shape {list(shape)} cannot be factored")
    p, q = dims
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(p, q):
        raise ValueError(f"rank must be an int in [1, {min(p, q)}] for a {p} x {q} matrix, got {rank!r}")
    return rank * (p + q + 1)


def unpack(values: np.ndarray, shape: tuple[int, ...], mode: str, rank: int) -> SvdTensor:
    """An :class:`SvdTensor` from a received payload; ValueError if it is not consistent.

    Checks that the mode fits the shape, that ``1 <= rank <= min(P, Q)`` for a
    factored tensor, and that the payload has exactly the elements the shape
    and rank need, before anything is reshaped.
    """
    values = np.asarray(values)
    if values.ndim != 1 or values.dtype != np.float32:
        raise ValueError(f"SVD payload must be a float32 vector, got {values.dtype} {values.shape}")
    shape = tuple(int(d) for d in shape)
    expected = payload_elements(shape, mode, rank)
    if values.size != expected:
        raise ValueError(f"{mode} payload has {values.size} values; shape {list(shape)} at rank {rank} needs {expected}")
    if mode == "dense":
        return SvdTensor(shape, "dense", 0, values, 1.0)
    return SvdTensor(shape, "factored", rank, values, None)

"""Secure aggregation by pairwise masking with dropout recovery (Bonawitz et al., CCS 2017),
the pieces both sides compute: parameters, keys, encrypted Shamir shares, masks, fixed point.

An agent u holds two X25519 key pairs per round: ``c`` (its shares are encrypted to it
under HKDF(X25519(c_u, c_v)) with AES-GCM) and ``s`` (its pairwise mask with v is the
ChaCha20 keystream under HKDF(X25519(s_u, s_v))), and a self-mask seed ``b_u``. The ``s``
private key is derived from a 16-byte seed by HKDF, so that both secrets an agent splits
are 16 bytes: pycryptodome's Shamir scheme (GF(2^128)) shares exactly that, and nothing
here re-implements secret sharing. The masked input is::

    y_u = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)    (mod 2^ring_bits)

so pairwise masks cancel in the sum over the survivors; the server removes the survivors'
self masks (rebuilt from t shares of each b_u) and the survivors' masks with the agents that
dropped after sharing (rebuilt from t shares of each dropped agent's s seed).

``x_u`` is the agent's update (model minus the global model it started from) times its
weight ``w_u = n_u / weight_scale``, in fixed point with ``fraction_bits``, followed by
``w_u`` itself; the server divides the summed update by the summed weight: the sample-
weighted mean of plain FedAvg over the survivors. An entry beyond the per-agent bound
(the ring's half divided by the roster's size, so that no sum wraps) is clipped and counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .errors import SecAggError, SecAggShareError
from .secagg_messages import NONCE_BYTES, SHARE_BYTES
from .secagg_params import SUMMING_METHODS, SecAggParams

__all__ = ["SUMMING_METHODS", "SecAggParams", "AgentKeys"]

SEED_BYTES = 16  # what pycryptodome's Shamir scheme shares

# -- keys ---------------------------------------------------------------------------- #


def _hkdf(material: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=b"edgesplit/secagg/" + info).derive(material)


def public_bytes(key: X25519PrivateKey) -> np.ndarray:
    return np.frombuffer(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), dtype=np.uint8).copy()


def mask_key_of(seed: bytes) -> X25519PrivateKey:
    """The ``s`` private key an agent's 16-byte seed stands for (what its shares rebuild)."""
    return X25519PrivateKey.from_private_bytes(_hkdf(seed, b"mask-key"))


@dataclass
class AgentKeys:
    """One agent's secrets for one round."""

    c_key: X25519PrivateKey
    s_seed: bytes
    b_seed: bytes

    @classmethod
    def generate(cls) -> "AgentKeys":
        return cls(X25519PrivateKey.generate(), os.urandom(SEED_BYTES), os.urandom(SEED_BYTES))

    @property
    def s_key(self) -> X25519PrivateKey:
        return mask_key_of(self.s_seed)


def _agree(private: X25519PrivateKey, public: np.ndarray) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(bytes(public)))
    except ValueError as exc:  # a low-order point gives an all-zero secret
        raise SecAggShareError(f"unusable public key: {exc}") from None


def pair_seed(private: X25519PrivateKey, public: np.ndarray, context: str) -> bytes:
    """The pairwise mask seed of two agents (the same from either side)."""
    return _hkdf(_agree(private, public), b"pair-mask/" + context.encode())


def self_seed(b_seed: bytes, context: str) -> bytes:
    return _hkdf(b_seed, b"self-mask/" + context.encode())


def prg(seed: bytes, length: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """``length`` uniform ring elements: the ChaCha20 keystream under ``seed`` (fresh per round:
    every seed derives from keys made for the round, so a zero nonce is never reused)."""
    width = np.dtype(dtype).itemsize
    stream = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor().update(b"\0" * (length * width))
    return np.frombuffer(stream, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


# -- shares ---------------------------------------------------------------------------- #


def split_seed(seed: bytes, needed: int, holders: int) -> list[bytes]:
    """Shamir shares of a 16-byte seed for ``holders`` agents (share k for roster index k + 1)."""
    return [share for _, share in Shamir.split(needed, holders, seed)]


def combine_seed(shares: list[tuple[int, bytes]], needed: int) -> bytes:
    """The seed from at least ``needed`` (roster index from 1, share) pairs."""
    if len(shares) < needed:
        raise SecAggError(f"{len(shares)} shares of a seed arrived, {needed} are needed")
    return Shamir.combine(shares[:needed])


def _channel(private: X25519PrivateKey, public: np.ndarray) -> AESGCM:
    return AESGCM(_hkdf(_agree(private, public), b"share-channel"))


def share_context(run: str, round_: int, sender: str, recipient: str) -> bytes:
    """What a ciphertext is bound to: a copy replayed into another run, round or pair fails."""
    return f"{run}|{round_}|{sender}|{recipient}".encode()


def seal_shares(private: X25519PrivateKey, recipient_public: np.ndarray, b_share: bytes, s_share: bytes, context: bytes) -> np.ndarray:
    nonce = os.urandom(NONCE_BYTES)
    sealed = _channel(private, recipient_public).encrypt(nonce, b_share + s_share, context)
    return np.frombuffer(nonce + sealed, dtype=np.uint8).copy()


def open_shares(private: X25519PrivateKey, sender_public: np.ndarray, ciphertext: np.ndarray, context: bytes) -> tuple[bytes, bytes]:
    """(share of the sender's b seed, share of its s seed); SecAggShareError when the ciphertext
    is not one the sender sealed for this context."""
    blob = bytes(ciphertext)
    try:
        plain = _channel(private, sender_public).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], context)
    except InvalidTag:
        raise SecAggShareError(f"a ciphertext for {context.decode()!r} does not authenticate") from None
    return plain[:SHARE_BYTES], plain[SHARE_BYTES:]


# -- fixed point --------------------------------------------------------------------- #


def quantise(values: np.ndarray, params: SecAggParams, roster_size: int) -> tuple[np.ndarray, int]:
    """(ring elements of ``values`` in fixed point, how many entries were clipped to the bound)."""
    bound = params.bound(roster_size)
    scaled = np.rint(np.asarray(values, dtype=np.float64) * 2.0 ** params.fraction_bits)
    clipped = int(np.count_nonzero(np.abs(scaled) > bound))
    q = np.clip(scaled, -bound, bound).astype(np.int64)
    return (q.astype(np.uint32) if params.ring_bits == 32 else q.view(np.uint64)), clipped


def dequantise(ring: np.ndarray, params: SecAggParams) -> np.ndarray:
    signed = ring.view(np.int32 if params.ring_bits == 32 else np.int64)
    return signed.astype(np.float64) / 2.0 ** params.fraction_bits


def pair_sign(owner: str, other: str) -> int:
    """+1 when ``owner`` adds the pair's mask, -1 when it subtracts it."""
    return 1 if owner < other else -1

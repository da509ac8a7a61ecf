"""Fuzzing the decoders: every input either decodes or raises one of the
protocol's error types; nothing else escapes (no IndexError, struct.error,
MemoryError, OverflowError, numpy errors ...)."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared_protocol.mqtt.chunking import DIGEST_BYTES, ChunkHeader, Reassembler, split_blob
from shared_protocol.errors import ProtocolError
from shared_protocol.frame import FrameLimits, decode_frame
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.records import AgentRoundCosts

LIMITS = FrameLimits(max_body_bytes=1 << 20, max_tensor_elements=1 << 20)
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _seed_frames() -> list[bytes]:
    rng = np.random.default_rng(0)
    features = GktFeatures(
        run="r", round=1, sender="a", split="train", seq=0, instance="i",
        features=np.maximum(rng.normal(size=(2, 16, 4, 4)), 0).astype(np.float32),
        logits=rng.normal(size=(2, 10)).astype(np.float32),
        labels=np.array([1, 2], np.int64), sample_ids=np.array([5, 6], np.int64),
    )
    frames = [encode_message(features, codecs={"features": c}) for c in ("raw", "fp16-zstd", "u8-zstd", "u8-affine-zstd", "zstd")]
    frames.append(encode_message(RoundEnd(run="r", round=1, sender="a", num_samples=2, costs=AgentRoundCosts(compute_s=1.0))))
    from test_secagg_wire import golden_secagg_messages

    frames.extend(encode_message(msg) for msg in golden_secagg_messages().values())
    return frames


SEEDS = _seed_frames()


def _decode_everything(blob: bytes) -> None:
    try:
        frame = decode_frame(blob, LIMITS)
        frame.tensors(LIMITS)
    except ProtocolError:
        pass
    try:
        decode_message(blob, LIMITS)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(blob: bytes) -> None:
    _decode_everything(blob)


@FUZZ
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)), min_size=1, max_size=8),
    cut=st.one_of(st.none(), st.integers(min_value=0)),
)
def test_mutated_valid_frames(seed: int, edits: list[tuple[int, int]], cut: int | None) -> None:
    blob = bytearray(SEEDS[seed])
    for position, value in edits:
        blob[position % len(blob)] = value
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    _decode_everything(bytes(blob))


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))


@FUZZ
@given(st.dictionaries(st.sampled_from(["type", "run", "round", "sender", "msg_id", "fields", "tensors", "x"]),
                       st.one_of(json_scalars, st.lists(json_scalars, max_size=3), st.dictionaries(st.text(max_size=5), json_scalars, max_size=3)),
                       max_size=8))
def test_arbitrary_headers(header: dict) -> None:
    import json
    import struct

    body = b"\x00" * 16
    head = json.dumps(header).encode()
    _decode_everything(struct.pack(">4sBBIQ", b"ESPL", 1, 0, len(head), len(body)) + head + body)


@FUZZ
@given(st.text(max_size=70), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1), st.one_of(st.none(), st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES)), st.text(max_size=40),
       st.binary(max_size=64))
def test_chunk_headers_and_reassembly(tid: str, seq: int, count: int, total: int, stride: int, digest: bytes | None,
                                      reply: str, body: bytes) -> None:
    reassembler = Reassembler(max_transfer_bytes=1 << 16, max_total_bytes=1 << 18)
    try:
        reassembler.add(ChunkHeader(tid, seq, count, total, stride, digest, reply).pack() + body, "t")
    except ProtocolError:
        pass
    except (struct.error, UnicodeEncodeError):
        pass  # the fuzzed values do not fit the header fields (or are lone surrogates): no chunk to send


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_chunk_payloads(payload: bytes) -> None:
    reassembler = Reassembler(max_transfer_bytes=1 << 16, max_total_bytes=1 << 18)
    for data in (payload, split_blob(b"abc", 1024)[0][:29] + payload):
        try:
            reassembler.add(data, "t")
        except ProtocolError:
            pass


@FUZZ
@given(st.binary(min_size=1, max_size=3000),
       st.lists(st.tuples(st.integers(0, 20), st.booleans(), st.binary(max_size=300)), max_size=6),
       st.lists(st.tuples(st.integers(0, 20), st.integers(0, 600), st.integers(1, 255)), max_size=4))
def test_reassembly_with_corrupted_chunks(blob: bytes, corruptions: list[tuple[int, bool, bytes]],
                                          flips: list[tuple[int, int, int]]) -> None:
    originals = split_blob(blob, 500)
    chunks = [bytearray(c) for c in originals]
    for i, keep_header, data in corruptions:
        original = originals[i % len(chunks)]
        head = original[: len(original) - ChunkHeader.parse(original)[1].nbytes]
        chunks[i % len(chunks)] = bytearray(head + data if keep_header else data)
    for i, pos, mask in flips:
        chunk = chunks[i % len(chunks)]
        if chunk:
            chunk[pos % len(chunk)] ^= mask
    reassembler = Reassembler(max_transfer_bytes=1 << 16, max_total_bytes=1 << 18)
    out = None
    for chunk in chunks:
        try:
            got = reassembler.add(bytes(chunk), "t")
        except ProtocolError:
            continue
        out = got if got is not None else out
    # Whatever came out is exactly the original: corruption never yields a wrong blob.
    assert out is None or out == blob

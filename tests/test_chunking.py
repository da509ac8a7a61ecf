"""Chunk splitting and reassembly: order, duplicates, limits, expiry, hashes."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from shared_protocol.chunking import CHUNK_FIXED_BYTES, ChunkedBlob, ChunkHeader, Reassembler, split_blob
from shared_protocol.errors import ChunkError, HashMismatchError, LengthMismatchError, SizeLimitError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_split_sizes_and_single_chunk_for_small_or_empty() -> None:
    blob = os.urandom(10_000)
    chunks = [ChunkHeader.parse(c) for c in split_blob(blob, 4096)]
    assert [len(body) for _, body in chunks] == [4096, 4096, 1808]
    assert {h.count for h, _ in chunks} == {3}
    assert b"".join(bytes(body) for _, body in chunks) == blob
    # The blob's sha256 rides on the last chunk only.
    assert [h.sha256 for h, _ in chunks] == [None, None, hashlib.sha256(blob).digest()]
    (empty,) = split_blob(b"", 4096)
    assert Reassembler().add(empty) == b""


def test_out_of_order_and_duplicate_chunks_reassemble_once() -> None:
    blob = os.urandom(100_000)
    chunks = split_blob(blob, 7_000)
    shuffled = chunks + chunks[:5]  # duplicates
    random.Random(0).shuffle(shuffled)
    r = Reassembler()
    outputs = [out for c in shuffled if (out := r.add(c, "t")) is not None]
    assert outputs == [blob]
    assert r.stats.duplicates >= 1
    # A duplicate arriving after completion is dropped, not a second message.
    assert r.add(chunks[0], "t") is None
    assert r.open_transfers() == []


def test_missing_seqs_listed_then_completed() -> None:
    blob = os.urandom(50_000)
    chunks = split_blob(blob, 10_000)
    r = Reassembler()
    for seq, c in enumerate(chunks):
        if seq not in (1, 3):
            assert r.add(c) is None
    tid = ChunkHeader.parse(chunks[0])[0].transfer_id
    assert r.missing(tid) == [1, 3]
    assert r.add(chunks[3]) is None
    assert r.add(chunks[1]) == blob


def test_same_transfer_id_from_other_source_is_separate() -> None:
    blob = os.urandom(3000)
    chunks = split_blob(blob, 1000, transfer_id="fixed")
    r = Reassembler()
    r.add(chunks[0], source="up/a")
    r.add(chunks[1], source="up/b")
    assert len(r.open_transfers()) == 2


def test_hash_mismatch_detected() -> None:
    blob = os.urandom(3000)
    chunks = split_blob(blob, 1000)
    r = Reassembler()
    r.add(chunks[0])
    r.add(chunks[1])
    header, body = ChunkHeader.parse(chunks[2])
    with pytest.raises(HashMismatchError):
        r.add(header.pack() + b"\x00" * len(body))


def test_per_transfer_and_total_memory_bounds() -> None:
    r = Reassembler(max_transfer_bytes=10_000, max_total_bytes=15_000)
    big = split_blob(os.urandom(20_000), 5_000)
    with pytest.raises(SizeLimitError):
        r.add(big[0])
    a = split_blob(os.urandom(9_000), 3_000)
    b = split_blob(os.urandom(9_000), 3_000)
    r.add(a[0])
    with pytest.raises(SizeLimitError, match="budget"):
        r.add(b[0])
    # Finishing a frees its reservation.
    for c in a[1:]:
        r.add(c)
    assert r.add(b[0]) is None


def test_stale_transfers_expire_and_free_memory() -> None:
    clock = FakeClock()
    r = Reassembler(timeout_s=10, clock=clock)
    chunks = split_blob(os.urandom(5000), 1000, transfer_id="t1")
    r.add(chunks[0], source="s")
    clock.now = 5
    assert r.stalled(idle_s=4) == [("s", "t1", [1, 2, 3, 4])]
    assert r.expire() == []
    clock.now = 11
    assert r.expire() == [("s", "t1")]
    assert r.reserved_bytes == 0


def test_inconsistent_chunk_metadata_rejected() -> None:
    chunks = split_blob(os.urandom(3000), 1000)
    r = Reassembler()
    r.add(chunks[0])
    h, body = ChunkHeader.parse(chunks[1])
    # Same transfer, but a longer blob cut with a wider stride: self-consistent, yet not this transfer.
    liar = ChunkHeader(h.transfer_id, h.seq, h.count, h.total_bytes + 1000, h.chunk_bytes + 500)
    with pytest.raises(ChunkError, match="disagrees"):
        r.add(liar.pack() + bytes(body) + bytes(500))


def _good() -> ChunkHeader:
    return ChunkHeader("x", 0, 1, 1, 1024, b"\x00" * 32)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"ESCK" + bytes(10),  # shorter than the fixed header
        b"XXXX" + _good().pack()[4:] + b"a",  # magic
        _good().pack()[:4] + b"\x02" + _good().pack()[5:] + b"a",  # version
        _good().pack()[:5] + b"\x03" + _good().pack()[6:] + b"a",  # unknown flag
        ChunkHeader("", 0, 1, 1, 1024, b"\x00" * 32).pack() + b"a",  # empty transfer id
        ChunkHeader("x" * 65, 0, 1, 1, 1024, b"\x00" * 32).pack() + b"a",  # transfer id too long
        ChunkHeader("x", 1, 1, 1, 1024, b"\x00" * 32).pack() + b"a",  # seq outside [0, count)
        ChunkHeader("x", 0, 2, 1, 1024, b"\x00" * 32).pack() + b"a",  # count does not match length / stride
        ChunkHeader("x", 0, 1, 1, 0, b"\x00" * 32).pack() + b"a",  # zero stride
        ChunkHeader("x", 0, 1, 1, 1024).pack() + b"a",  # last chunk without the blob's sha256
        ChunkHeader("x", 0, 2, 2000, 1024, b"\x00" * 32).pack() + bytes(1024),  # sha256 on a chunk that is not last
        _good().pack()[:-8],  # truncated inside the sha256
        _good().pack()[:CHUNK_FIXED_BYTES] + b"\xff" + _good().pack()[CHUNK_FIXED_BYTES + 1 :] + b"a",  # tid not UTF-8
    ],
)
def test_bad_chunk_headers(payload: bytes) -> None:
    with pytest.raises(ChunkError):
        Reassembler().add(payload)


def test_chunk_of_the_wrong_length_voids_the_transfer() -> None:
    chunks = split_blob(os.urandom(3000), 1000, transfer_id="t")
    r = Reassembler()
    r.add(chunks[0])
    h, body = ChunkHeader.parse(chunks[1])
    with pytest.raises(LengthMismatchError):
        r.add(h.pack() + bytes(body) + b"extra")
    assert r.open_transfers() == [] and r.reserved_bytes == 0


def test_chunked_blob_cuts_views_and_resends_the_same_bytes() -> None:
    blob = os.urandom(10_000)
    cut = ChunkedBlob(blob, 3000, transfer_id="t", reply_topic="up/me")
    first = [cut.chunk(seq) for seq in range(len(cut))]
    assert cut.sha256 == hashlib.sha256(blob).digest()
    # A resend re-cuts a chunk byte for byte; the reply topic travels in every header.
    assert [cut.chunk(seq) for seq in (2, 0, 3)] == [first[2], first[0], first[3]]
    assert {ChunkHeader.parse(c)[0].reply_topic for c in first} == {"up/me"}
    r = Reassembler()
    r.add(first[1], "s")
    assert r.reply_topic("t", "s") == "up/me"
    # Cutting the last chunk first (a resend before the sender cut the rest) still hashes the whole blob.
    early = ChunkedBlob(blob, 3000, transfer_id="t")
    assert ChunkHeader.parse(early.chunk(3))[0].sha256 == hashlib.sha256(blob).digest()


def test_one_source_cannot_hold_too_many_open_transfers() -> None:
    r = Reassembler(max_transfers_per_source=2)
    for _ in range(2):
        r.add(split_blob(os.urandom(2000), 1000)[0], source="greedy")
    with pytest.raises(SizeLimitError, match="transfers open"):
        r.add(split_blob(os.urandom(2000), 1000)[0], source="greedy")
    r.add(split_blob(os.urandom(2000), 1000)[0], source="polite")  # others are unaffected

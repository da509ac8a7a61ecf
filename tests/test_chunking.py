"""Chunk splitting and reassembly: order, duplicates, limits, expiry, hashes."""

from __future__ import annotations

import os
import random

import pytest

from shared_protocol.chunking import ChunkHeader, Reassembler, split_blob
from shared_protocol.errors import ChunkError, HashMismatchError, SizeLimitError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_split_sizes_and_single_chunk_for_small_or_empty() -> None:
    blob = os.urandom(10_000)
    chunks = split_blob(blob, 4096)
    assert [len(c) for _, c in chunks] == [4096, 4096, 1808]
    assert {h.count for h, _ in chunks} == {3}
    assert len(split_blob(b"", 4096)) == 1


def test_out_of_order_and_duplicate_chunks_reassemble_once() -> None:
    blob = os.urandom(100_000)
    chunks = split_blob(blob, 7_000)
    shuffled = chunks + chunks[:5]  # duplicates
    random.Random(0).shuffle(shuffled)
    r = Reassembler()
    outputs = [out for h, c in shuffled if (out := r.add(h, c, "t")) is not None]
    assert outputs == [blob]
    assert r.stats.duplicates >= 1
    # A duplicate arriving after completion is dropped, not a second message.
    assert r.add(*chunks[0], "t") is None
    assert r.open_transfers() == []


def test_missing_seqs_listed_then_completed() -> None:
    blob = os.urandom(50_000)
    chunks = split_blob(blob, 10_000)
    r = Reassembler()
    for h, c in chunks:
        if h.seq not in (1, 3):
            assert r.add(h, c) is None
    assert r.missing(chunks[0][0].transfer_id) == [1, 3]
    assert r.add(*chunks[3]) is None
    assert r.add(*chunks[1]) == blob


def test_same_transfer_id_from_other_source_is_separate() -> None:
    blob = os.urandom(3000)
    chunks = split_blob(blob, 1000, transfer_id="fixed")
    r = Reassembler()
    r.add(*chunks[0], source="up/a")
    r.add(*chunks[1], source="up/b")
    assert len(r.open_transfers()) == 2


def test_hash_mismatch_detected() -> None:
    blob = os.urandom(3000)
    chunks = split_blob(blob, 1000)
    r = Reassembler()
    r.add(*chunks[0])
    r.add(*chunks[1])
    with pytest.raises(HashMismatchError):
        r.add(chunks[2][0], b"\x00" * len(chunks[2][1]))


def test_per_transfer_and_total_memory_bounds() -> None:
    r = Reassembler(max_transfer_bytes=10_000, max_total_bytes=15_000)
    big = split_blob(os.urandom(20_000), 5_000)
    with pytest.raises(SizeLimitError):
        r.add(*big[0])
    a = split_blob(os.urandom(9_000), 3_000)
    b = split_blob(os.urandom(9_000), 3_000)
    r.add(*a[0])
    with pytest.raises(SizeLimitError, match="budget"):
        r.add(*b[0])
    # Finishing a frees its reservation.
    for h, c in a[1:]:
        r.add(h, c)
    assert r.add(*b[0]) is None


def test_stale_transfers_expire_and_free_memory() -> None:
    clock = FakeClock()
    r = Reassembler(timeout_s=10, clock=clock)
    chunks = split_blob(os.urandom(5000), 1000)
    r.add(*chunks[0], source="s")
    clock.now = 5
    assert r.stalled(idle_s=4) == [("s", chunks[0][0].transfer_id, [1, 2, 3, 4])]
    assert r.expire() == []
    clock.now = 11
    assert r.expire() == [("s", chunks[0][0].transfer_id)]
    assert r.reserved_bytes == 0


def test_inconsistent_chunk_metadata_rejected() -> None:
    chunks = split_blob(os.urandom(3000), 1000)
    r = Reassembler()
    r.add(*chunks[0])
    h = chunks[1][0]
    liar = ChunkHeader(h.transfer_id, h.seq, h.count + 1, h.total_bytes, h.sha256)
    with pytest.raises(ChunkError):
        r.add(liar, chunks[1][1])


@pytest.mark.parametrize(
    "props",
    [
        [],
        [("es-tid", "x"), ("es-seq", "a"), ("es-cnt", "1"), ("es-len", "1"), ("es-sha", "0" * 64)],
        [("es-tid", "x"), ("es-seq", "2"), ("es-cnt", "1"), ("es-len", "1"), ("es-sha", "0" * 64)],
        [("es-tid", "x"), ("es-seq", "0"), ("es-cnt", "1"), ("es-len", "1"), ("es-sha", "0")],
    ],
)
def test_bad_chunk_properties(props: list[tuple[str, str]]) -> None:
    with pytest.raises(ChunkError):
        ChunkHeader.from_properties(props)


def test_one_source_cannot_hold_too_many_open_transfers() -> None:
    r = Reassembler(max_transfers_per_source=2)
    for _ in range(2):
        r.add(*split_blob(os.urandom(2000), 1000)[0], source="greedy")
    with pytest.raises(SizeLimitError, match="transfers open"):
        r.add(*split_blob(os.urandom(2000), 1000)[0], source="greedy")
    r.add(*split_blob(os.urandom(2000), 1000)[0], source="polite")  # others are unaffected

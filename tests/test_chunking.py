"""Chunk splitting and reassembly: order, duplicates, limits, expiry, the blob digest, the
chunk format's golden bytes and its version."""

from __future__ import annotations

import hashlib
import os
import random
import re
import struct
import sys
from pathlib import Path

import numpy as np

import pytest
import xxhash

from shared_protocol.mqtt.chunking import (
    CHUNK_FIXED_BYTES,
    DIGEST_BYTES,
    ChunkedBlob,
    ChunkHeader,
    Reassembler,
    SenderLimits,
    split_blob,
)
from shared_protocol.mqtt import chunked_blob, reassembly
from shared_protocol.errors import (
    BudgetError,
    ChunkError,
    ChunkVersionError,
    HashMismatchError,
    LengthMismatchError,
    SenderIgnoredError,
    SizeLimitError,
)


GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[1]


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
    # The blob's XXH3-128 rides on the last chunk only.
    assert [h.digest for h, _ in chunks] == [None, None, xxhash.xxh3_128(blob).digest()]
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


class _NoDigest:
    """A blob hasher that checks nothing: with it on both sides every blob's digest agrees."""

    def update(self, data: object) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(DIGEST_BYTES)


def _mis_assembled(kind: str) -> tuple[bytes, list[bytes]]:
    """A 3-chunk blob and the chunks of its transfer as a receiver gets them, one of them wrong."""
    blob = os.urandom(3000)
    chunks = split_blob(blob, 1000, transfer_id="t")
    parsed = [ChunkHeader.parse(c) for c in chunks]
    if kind == "corrupted":  # a chunk's bytes changed on the way
        header, body = parsed[1]
        chunks[1] = header.pack() + bytes(b ^ 0x01 if i == 500 else b for i, b in enumerate(bytes(body)))
    elif kind == "swapped":  # two chunks' bytes under each other's seq
        (h0, b0), (h1, b1) = parsed[0], parsed[1]
        chunks[0], chunks[1] = h0.pack() + bytes(b1), h1.pack() + bytes(b0)
    elif kind == "from_another_transfer":  # the same transfer id, a chunk of another blob of the same layout
        chunks[1] = split_blob(os.urandom(3000), 1000, transfer_id="t")[1]
    return blob, chunks


@pytest.mark.parametrize("kind", ["corrupted", "swapped", "from_another_transfer"])
def test_a_mis_assembled_blob_is_refused_by_its_digest(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blob, chunks = _mis_assembled(kind)
    r = Reassembler()
    assert r.add(chunks[0], "s") is None and r.add(chunks[1], "s") is None
    with pytest.raises(HashMismatchError, match="XXH3-128"):
        r.add(chunks[2], "s")
    assert r.open_transfers() == [] and r.stats.rejected_by_reason == {"hash_mismatch": 1}
    # Positive control: with the digest checking nothing, the same chunks make a wrong blob, so the
    # digest (no other check) is what refuses them.
    monkeypatch.setattr(chunked_blob, "blob_hasher", _NoDigest)
    monkeypatch.setattr(reassembly, "blob_hasher", _NoDigest)
    blob, chunks = _mis_assembled(kind)
    r = Reassembler()
    out = [r.add(c, "s") for c in chunks][-1]
    assert out is not None and len(out) == len(blob) and out != blob


def test_an_old_format_chunk_is_refused_naming_both_versions() -> None:
    # Version 1's bytes as its senders wrote them: the same fixed fields, the blob's SHA-256 on the last chunk.
    body = b"hello"
    v1 = struct.pack(">4sBBBHIIIQ", b"ESCK", 1, 0x01, 1, 0, 0, 1, 1024, len(body)) + b"x" + hashlib.sha256(body).digest() + body
    r = Reassembler()
    with pytest.raises(ChunkVersionError, match=r"chunk format version 1 \(the blob's SHA-256 on its last chunk\); this "
                                                 r"build speaks version 2 \(the blob's XXH3-128 on its last chunk\)"):
        r.add(v1, "up/old-agent")
    assert r.stats.rejected_by_reason == {"bad_chunk": 1}
    with pytest.raises(ChunkVersionError, match="chunk format version 9; this build speaks version 2"):
        r.add(v1[:4] + b"\x09" + v1[5:])


def golden_chunks() -> list[bytes]:
    """The chunks pinned in tests/golden/chunk_v2_seq*.bin (see make_golden.py)."""
    blob = bytes(range(50))
    return ChunkedBlob(blob, 32, transfer_id="00000000000000000000000000000003",
                       reply_topic="edgesplit/v1/golden-run/down/a1").chunks()


def test_golden_chunks_are_byte_identical_and_parse_to_known_values() -> None:
    golden = [(GOLDEN / f"chunk_v2_seq{seq}.bin").read_bytes() for seq in range(2)]
    assert golden_chunks() == golden
    (h0, b0), (h1, b1) = (ChunkHeader.parse(c) for c in golden)
    assert golden[0][:5] == b"ESCK\x02" and golden[0][5] == 0 and golden[1][5] == 1  # version 2; the flag on the last only
    assert (h0.seq, h0.count, h0.chunk_bytes, h0.total_bytes, h0.digest) == (0, 2, 32, 50, None)
    assert (h1.transfer_id, h1.reply_topic) == ("00000000000000000000000000000003", "edgesplit/v1/golden-run/down/a1")
    # The digest as docs/protocol.md §5 specifies it: XXH3-128, seed 0, 16 bytes big-endian.
    assert h1.digest == xxhash.xxh3_128(bytes(range(50))).intdigest().to_bytes(16, "big")
    assert golden[1][-18 - DIGEST_BYTES : -18] == h1.digest and bytes(b0) + bytes(b1) == bytes(range(50))
    r = Reassembler()
    assert r.add(golden[1]) is None and r.add(golden[0]) == bytes(range(50))


def test_the_protocol_pages_digest_examples_hold() -> None:
    spec = " ".join((ROOT / "docs" / "protocol.md").read_text().split())
    abc = re.search(r"`abc` has the digest `([0-9a-f]{32})`", spec)
    empty = re.search(r"the empty blob `([0-9a-f]{32})`", spec)
    assert abc is not None and empty is not None
    assert (abc[1], empty[1]) == (ChunkedBlob(b"abc").digest.hex(), ChunkedBlob(b"").digest.hex())


def test_per_transfer_and_total_memory_bounds() -> None:
    """Memory is counted as chunks arrive: the total refuses a chunk (the transfer stays
    open, the seq missing, to be asked for again), expiry and completion free room."""
    clock = FakeClock()
    r = Reassembler(max_transfer_bytes=10_000, max_total_bytes=15_000, timeout_s=120, clock=clock)
    big = split_blob(os.urandom(20_000), 5_000)
    with pytest.raises(SizeLimitError):
        r.add(big[0], "s-big")
    assert r.held_bytes == 0
    blobs = {name: os.urandom(9_000) for name in "abc"}
    chunks = {name: split_blob(blob, 3_000, transfer_id=name) for name, blob in blobs.items()}
    for name in blobs:  # expected senders: none gives way to another
        r.expect(f"s-{name}", SenderLimits(10_000, 10_000))
    r.add(chunks["a"][0], "s-a")
    r.add(chunks["a"][1], "s-a")
    clock.now = 100
    r.add(chunks["b"][0], "s-b")
    r.add(chunks["b"][1], "s-b")
    r.add(chunks["c"][0], "s-c")
    assert r.held_bytes == 15_000
    with pytest.raises(BudgetError, match="budget"):
        r.add(chunks["c"][1], "s-c")
    assert r.missing("c", "s-c") == [1, 2] and r.held_bytes == 15_000
    clock.now = 130  # a has been idle for 130 s > 120: it expires and makes room
    assert r.add(chunks["c"][1], "s-c") is None
    assert ("s-a", "a") not in r.open_transfers() and r.held_bytes == 12_000
    assert r.add(chunks["b"][2], "s-b") == blobs["b"]  # finishing b frees its 9,000 bytes
    assert r.held_bytes == 6_000
    assert r.stats.rejected_by_reason == {"size_limit": 1, "over_budget": 1}


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
    return ChunkHeader("x", 0, 1, 1, 1024, b"\x00" * DIGEST_BYTES)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"ESCK" + bytes(10),  # shorter than the fixed header
        b"XXXX" + _good().pack()[4:] + b"a",  # magic
        _good().pack()[:4] + b"\x03" + _good().pack()[5:] + b"a",  # a version not (yet) spoken
        _good().pack()[:5] + b"\x03" + _good().pack()[6:] + b"a",  # unknown flag
        ChunkHeader("", 0, 1, 1, 1024, b"\x00" * DIGEST_BYTES).pack() + b"a",  # empty transfer id
        ChunkHeader("x" * 65, 0, 1, 1, 1024, b"\x00" * DIGEST_BYTES).pack() + b"a",  # transfer id too long
        ChunkHeader("x", 1, 1, 1, 1024, b"\x00" * DIGEST_BYTES).pack() + b"a",  # seq outside [0, count)
        ChunkHeader("x", 0, 2, 1, 1024, b"\x00" * DIGEST_BYTES).pack() + b"a",  # count does not match length / stride
        ChunkHeader("x", 0, 1, 1, 0, b"\x00" * DIGEST_BYTES).pack() + b"a",  # zero stride
        ChunkHeader("x", 0, 1, 1, 1024).pack() + b"a",  # last chunk without the blob's digest
        ChunkHeader("x", 0, 2, 2000, 1024, b"\x00" * DIGEST_BYTES).pack() + bytes(1024),  # digest on a chunk that is not last
        _good().pack()[:-8],  # truncated inside the digest
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
    assert cut.digest == xxhash.xxh3_128(blob).digest()
    # A resend re-cuts a chunk byte for byte; the reply topic travels in every header.
    assert [cut.chunk(seq) for seq in (2, 0, 3)] == [first[2], first[0], first[3]]
    assert {ChunkHeader.parse(c)[0].reply_topic for c in first} == {"up/me"}
    r = Reassembler()
    r.add(first[1], "s")
    assert r.reply_topic("t", "s") == "up/me"
    # Cutting the last chunk first (a resend before the sender cut the rest) still hashes the whole blob.
    early = ChunkedBlob(blob, 3000, transfer_id="t")
    assert ChunkHeader.parse(early.chunk(3))[0].digest == xxhash.xxh3_128(blob).digest()


def test_each_chunk_is_copied_into_place_and_its_payload_let_go() -> None:
    """The receiver keeps no received payload (paho's chunk objects go as they are copied, not
    when the blob completes) and hands the blob up read-only."""
    blob = os.urandom(10_000)
    chunks = split_blob(blob, 3000, transfer_id="t")
    r = Reassembler()
    for chunk in chunks[:0:-1]:
        before = sys.getrefcount(chunk)
        assert r.add(chunk, "s") is None
        assert sys.getrefcount(chunk) == before
    # Positive control: the count sees a view kept of a payload.
    base = sys.getrefcount(chunks[0])
    kept = memoryview(chunks[0])
    assert sys.getrefcount(chunks[0]) > base
    out = r.add(chunks[0], "s")
    assert out is not None and out == blob and out.readonly
    with pytest.raises(TypeError):
        out[0] = 0
    kept.release()


def test_one_source_cannot_hold_too_many_open_transfers() -> None:
    """At its limit a sender's least recently active transfer gives way to its new one;
    other senders are unaffected."""
    r = Reassembler(max_transfers_per_source=2)
    polite = split_blob(os.urandom(2000), 1000)
    r.add(polite[0], source="polite")
    greedy = [split_blob(os.urandom(2000), 1000) for _ in range(3)]
    for blob in greedy:
        r.add(blob[0], source="greedy")
    assert len(r.open_transfers("greedy")) == 2 and r.stats.evicted == 1
    first = ChunkHeader.parse(greedy[0][0])[0].transfer_id
    assert ("greedy", first) not in r.open_transfers()
    assert r.add(polite[1], source="polite") is not None  # others are unaffected


def _first_chunk(transfer_id: str, total_bytes: int, stride: int) -> bytes:
    """The first chunk of a transfer that declares ``total_bytes`` and never sends the rest."""
    count = -(-total_bytes // stride)
    return ChunkHeader(transfer_id, 0, count, total_bytes, stride).pack() + os.urandom(stride)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_memory_is_taken_as_bytes_arrive_not_reserved() -> None:
    r = Reassembler(max_transfer_bytes=256 << 20, max_total_bytes=1 << 30)
    before = _resident_bytes()
    for i in range(8):  # eight first chunks of 256 MiB transfers: 2 GiB declared
        r.add(_first_chunk(f"t{i}", 256 << 20, 4096), source=f"s{i}")
    assert r.held_bytes == 8 * 4096
    assert _resident_bytes() - before < 64 << 20  # the declared lengths took no memory
    # Positive control: the same measure sees 256 MiB that are written.
    before = _resident_bytes()
    written = np.ones(256 << 20, np.uint8)
    assert _resident_bytes() - before > 200 << 20
    del written
    ok = os.urandom(10_000)
    assert [r.add(c, "honest") for c in split_blob(ok, 4096)][-1] == ok


def test_declared_length_checked_against_the_senders_expectation() -> None:
    r = Reassembler(unexpected=SenderLimits(2_000, 4_000), unexpected_total_bytes=8_000)
    r.expect("up/a", SenderLimits(10_000, 20_000))
    with pytest.raises(SizeLimitError, match="expected from this sender is 10000"):
        r.add(_first_chunk("big", 50_000, 1000), "up/a")
    with pytest.raises(SizeLimitError, match="limit is 2000"):
        r.add(_first_chunk("big", 5_000, 1000), "up/stranger")
    assert r.held_bytes == 0 and r.open_transfers() == []
    blob = os.urandom(9_000)
    assert [r.add(c, "up/a") for c in split_blob(blob, 1000)][-1] == blob
    r.expect("up/a", None)  # forgotten: unexpected again
    with pytest.raises(SizeLimitError, match="limit is 2000"):
        r.add(_first_chunk("again", 9_000, 1000), "up/a")


def test_a_flooding_sender_cannot_make_another_senders_upload_fail() -> None:
    r = Reassembler(max_transfer_bytes=20_000, max_total_bytes=64_000, unexpected=SenderLimits(2_000, 4_000), unexpected_total_bytes=8_000)
    for agent in ("up/a", "up/b"):
        r.expect(agent, SenderLimits(20_000, 24_000, max_open_transfers=4))
    honest = os.urandom(20_000)
    honest_chunks = split_blob(honest, 1000, transfer_id="honest")
    a_live = os.urandom(20_000)
    a_chunks = split_blob(a_live, 1000, transfer_id="a-live")
    out_b, out_a = None, None
    for i in range(20):
        # Between every two chunks of the live uploads, a's topic and strangers open transfers that
        # never complete (on a's own topic fewer than its open-transfer limit: the live one is then
        # never the least recently active; b's upload does not depend on that).
        for k in range(3):
            r.add(_first_chunk(f"flood-{i}-{k}", 20_000, 1000), "up/a")
            try:
                r.add(_first_chunk(f"s-{i}-{k}", 2_000, 1000), f"up/stranger-{k}")
            except SizeLimitError:
                pass  # strangers' pool is full: their own problem
        out_a = r.add(a_chunks[i], "up/a") or out_a
        out_b = r.add(honest_chunks[i], "up/b") or out_b
    assert out_b == honest and out_a == a_live
    assert r.held_by("up/a") <= 24_000 and r.held_bytes <= 64_000
    assert r.stats.evicted > 0


def test_a_sender_sending_invalid_transfers_is_ignored_once_then_counted() -> None:
    clock = FakeClock()
    r = Reassembler(clock=clock, max_invalid_transfers=5, ignore_s=60)
    r.expect("up/agent", SenderLimits(10_000, 10_000))
    calls: list[tuple[str, dict[str, int]]] = []
    r.on_ignore = lambda source, counts: calls.append((source, counts))
    for i in range(12):
        with pytest.raises(ChunkError):
            r.add(b"garbage %d" % i, "up/agent")
        with pytest.raises(ChunkError if i < 5 else SenderIgnoredError):
            r.add(b"garbage %d" % i, "up/stranger")
    assert calls == [("up/stranger", {"bad_chunk": 5})]  # once, with the count
    with pytest.raises(SenderIgnoredError):
        r.add(split_blob(os.urandom(3000), 1024)[0], "up/stranger")  # nothing that takes more than a chunk
    good = split_blob(b"hello", 1024)[0]
    assert r.add(good, "up/stranger") == b"hello"  # but a whole message in one chunk (an agent's hello)
    assert r.add(good, "up/agent") == b"hello"  # an expected sender's topic is never ignored
    assert r.stats.rejected_by_reason["ignored_sender"] >= 1
    clock.now = 61  # the ignore period is over
    assert r.add(split_blob(b"x" * 3000, 1024)[-1], "up/stranger") is None  # held again
    r.block("up/agent", "dropped by the server")
    with pytest.raises(SenderIgnoredError):
        r.add(split_blob(b"y", 1024)[0], "up/agent")
    assert r.stats.rejected == sum(r.stats.rejected_by_reason.values())

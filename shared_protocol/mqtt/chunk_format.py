"""The chunk format: the binary header that precedes every chunk's bytes.

Each chunk is one PUBLISH payload: a small binary chunk header (transfer id,
seq, count, chunk stride, total bytes, optional reply topic and, on the last
chunk, the whole blob's XXH3-128 digest) followed by a contiguous slice of the blob.
The header travels in the payload, not as MQTT v5 user properties, because
paho parses properties by re-slicing the whole remaining packet once per field:
each user property costs the receiver several copies of every chunk.

The blob digest guards reassembly against accidental corruption and mis-assembly
(a chunk's bytes changed, two chunks swapped, a chunk taken from another transfer), not against an adversary:
TLS and the broker's ACL do that, and every tensor of the frame inside carries its
own SHA-256, checked end to end by the decoder. So the chunk layer uses a fast
non-cryptographic 128-bit hash (XXH3-128, from the ``xxhash`` package), which costs
a small fraction of a SHA-256 pass per byte on both sides.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..errors import ChunkError, ChunkVersionError

DEFAULT_CHUNK_SIZE_BYTES = 512 * 1024

CHUNK_MAGIC = b"ESCK"
CHUNK_VERSION = 2
#: What each chunk format version put on the last chunk, for the error an old sender gets.
_VERSION_DIGESTS = {1: "SHA-256", 2: "XXH3-128"}
DIGEST_NAME = _VERSION_DIGESTS[CHUNK_VERSION]
FLAG_DIGEST = 0x01  # the whole blob's digest follows the transfer id and reply topic (last chunk only)
DIGEST_BYTES = 16
MAX_TRANSFER_ID_BYTES = 64
# magic, version, flags, transfer-id length, reply-topic length, seq, count, stride, total
_FIXED = struct.Struct(">4sBBBHIIIQ")
CHUNK_FIXED_BYTES = _FIXED.size  # 29


def blob_hasher() -> xxhash.xxh3_128:
    """A fresh hasher of the blob digest (seed 0); its ``digest()`` is the 16 bytes on the wire."""
    return xxhash.xxh3_128()


# User-property keys of transport control messages (resend requests), which are
# rare and carry no payload, so they stay MQTT user properties.
P_TRANSFER = "es-tid"
P_CONTROL = "es-ctl"
P_SEQS = "es-seqs"


@dataclass(frozen=True)
class ChunkHeader:
    """What precedes every chunk's bytes. Chunk ``seq`` covers blob bytes
    ``[seq * chunk_bytes, min((seq + 1) * chunk_bytes, total_bytes))``."""

    transfer_id: str
    seq: int
    count: int
    total_bytes: int
    chunk_bytes: int
    digest: bytes | None = None  # the whole blob's XXH3-128; on the last chunk, and only there
    reply_topic: str = ""  # where the receiver may ask for missing seqs ("" = nowhere)

    @property
    def body_offset(self) -> int:
        return self.seq * self.chunk_bytes

    @property
    def body_bytes(self) -> int:
        """Bytes of the blob this chunk must carry."""
        return max(0, min(self.chunk_bytes, self.total_bytes - self.body_offset))

    def pack(self) -> bytes:
        """The header's bytes (no checks: tests build malformed chunks with it)."""
        tid, reply = self.transfer_id.encode(), self.reply_topic.encode()
        flags = FLAG_DIGEST if self.digest is not None else 0
        fixed = _FIXED.pack(CHUNK_MAGIC, CHUNK_VERSION, flags, len(tid), len(reply), self.seq, self.count,
                            self.chunk_bytes, self.total_bytes)
        return b"".join([fixed, tid, reply, self.digest or b""])

    @classmethod
    def parse(cls, payload: bytes | bytearray | memoryview) -> tuple["ChunkHeader", memoryview]:
        """Split a chunk payload into its checked header and its body (a view, no copy)."""
        view = memoryview(payload)
        if len(view) < CHUNK_FIXED_BYTES:
            raise ChunkError(f"chunk is {len(view)} bytes, shorter than the {CHUNK_FIXED_BYTES}-byte chunk header")
        magic, version, flags, tid_len, reply_len, seq, count, stride, total = _FIXED.unpack_from(view, 0)
        if magic != CHUNK_MAGIC:
            raise ChunkError(f"chunk magic {bytes(magic)!r}, expected {CHUNK_MAGIC!r}")
        if version != CHUNK_VERSION:
            came = f" (the blob's {_VERSION_DIGESTS[version]} on its last chunk)" if version in _VERSION_DIGESTS else ""
            raise ChunkVersionError(
                f"chunk format version {version}{came}; this build speaks version {CHUNK_VERSION} (the blob's "
                f"{DIGEST_NAME} on its last chunk): sender and receiver must run EdgeSplit builds with the same chunk format")
        if flags & ~FLAG_DIGEST:
            raise ChunkError(f"chunk flags {flags:#04x} are not understood")
        if not 0 < tid_len <= MAX_TRANSFER_ID_BYTES:
            raise ChunkError(f"chunk transfer id is {tid_len} bytes, expected 1..{MAX_TRANSFER_ID_BYTES}")
        digest_len = DIGEST_BYTES if flags & FLAG_DIGEST else 0
        head_len = CHUNK_FIXED_BYTES + tid_len + reply_len + digest_len
        if len(view) < head_len:
            raise ChunkError(f"chunk is {len(view)} bytes, its header alone declares {head_len}")
        if stride < 1 or count != max(1, -(-total // stride)) or seq >= count:
            raise ChunkError(f"chunk seq {seq} / count {count} / stride {stride} / length {total} is inconsistent")
        if bool(digest_len) != (seq == count - 1):
            raise ChunkError(f"chunk {seq} of {count}: the blob's digest belongs on the last chunk, and only there")
        try:
            tid = str(view[CHUNK_FIXED_BYTES : CHUNK_FIXED_BYTES + tid_len], "utf-8")
            reply = str(view[CHUNK_FIXED_BYTES + tid_len : CHUNK_FIXED_BYTES + tid_len + reply_len], "utf-8")
        except UnicodeDecodeError:
            raise ChunkError("chunk transfer id or reply topic is not UTF-8") from None
        digest = bytes(view[head_len - digest_len : head_len]) if digest_len else None
        return cls(tid, seq, count, total, stride, digest, reply), view[head_len:]

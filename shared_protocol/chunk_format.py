"""The chunk format: the binary header that precedes every chunk's bytes.

Each chunk is one PUBLISH payload: a small binary chunk header (transfer id,
seq, count, chunk stride, total bytes, optional reply topic and, on the last
chunk, the whole blob's sha256) followed by a contiguous slice of the blob.
The header travels in the payload, not as MQTT v5 user properties, because
paho parses properties by re-slicing the whole remaining packet once per field:
seven user properties cost the receiver about 25 copies of every 512 KiB chunk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import ChunkError

DEFAULT_CHUNK_SIZE_BYTES = 512 * 1024

CHUNK_MAGIC = b"ESCK"
CHUNK_VERSION = 1
FLAG_SHA = 0x01  # the whole blob's sha256 follows the transfer id and reply topic (last chunk only)
SHA_BYTES = 32
MAX_TRANSFER_ID_BYTES = 64
# magic, version, flags, transfer-id length, reply-topic length, seq, count, stride, total
_FIXED = struct.Struct(">4sBBBHIIIQ")
CHUNK_FIXED_BYTES = _FIXED.size  # 29

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
    sha256: bytes | None = None  # the whole blob's digest; on the last chunk, and only there
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
        flags = FLAG_SHA if self.sha256 is not None else 0
        fixed = _FIXED.pack(CHUNK_MAGIC, CHUNK_VERSION, flags, len(tid), len(reply), self.seq, self.count,
                            self.chunk_bytes, self.total_bytes)
        return b"".join([fixed, tid, reply, self.sha256 or b""])

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
            raise ChunkError(f"chunk format version {version}; this build speaks {CHUNK_VERSION}")
        if flags & ~FLAG_SHA:
            raise ChunkError(f"chunk flags {flags:#04x} are not understood")
        if not 0 < tid_len <= MAX_TRANSFER_ID_BYTES:
            raise ChunkError(f"chunk transfer id is {tid_len} bytes, expected 1..{MAX_TRANSFER_ID_BYTES}")
        sha_len = SHA_BYTES if flags & FLAG_SHA else 0
        head_len = CHUNK_FIXED_BYTES + tid_len + reply_len + sha_len
        if len(view) < head_len:
            raise ChunkError(f"chunk is {len(view)} bytes, its header alone declares {head_len}")
        if stride < 1 or count != max(1, -(-total // stride)) or seq >= count:
            raise ChunkError(f"chunk seq {seq} / count {count} / stride {stride} / length {total} is inconsistent")
        if bool(sha_len) != (seq == count - 1):
            raise ChunkError(f"chunk {seq} of {count}: the blob's sha256 belongs on the last chunk, and only there")
        try:
            tid = str(view[CHUNK_FIXED_BYTES : CHUNK_FIXED_BYTES + tid_len], "utf-8")
            reply = str(view[CHUNK_FIXED_BYTES + tid_len : CHUNK_FIXED_BYTES + tid_len + reply_len], "utf-8")
        except UnicodeDecodeError:
            raise ChunkError("chunk transfer id or reply topic is not UTF-8") from None
        digest = bytes(view[head_len - sha_len : head_len]) if sha_len else None
        return cls(tid, seq, count, total, stride, digest, reply), view[head_len:]

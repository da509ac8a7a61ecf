"""Splitting blobs into chunks below the broker's packet limit, and putting
them back together safely, by their public names.

Each job lives in its own module; this one gathers their public names for
``from shared_protocol.mqtt.chunking import ...`` (new code imports from the module
that does the job):

- :mod:`.chunk_format`: the chunk header every chunk's bytes follow, and the
  control messages' user-property keys;
- :mod:`.chunked_blob`: :class:`ChunkedBlob`, one outgoing blob cut into chunks;
- :mod:`shared_protocol.sender_policy`: :class:`SenderLimits`, what a receiver takes from one sender;
- :mod:`.reassembly`: :class:`Reassembler`, inbound chunks put back together
  within those limits.
"""

from __future__ import annotations

from ..sender_policy import SenderLimits
from .chunk_format import (
    CHUNK_FIXED_BYTES,
    CHUNK_MAGIC,
    CHUNK_VERSION,
    DEFAULT_CHUNK_SIZE_BYTES,
    DIGEST_BYTES,
    DIGEST_NAME,
    FLAG_DIGEST,
    MAX_TRANSFER_ID_BYTES,
    P_CONTROL,
    P_SEQS,
    P_TRANSFER,
    ChunkHeader,
    blob_hasher,
)
from .chunked_blob import ChunkedBlob, split_blob
from .reassembly import Reassembler, ReassemblyStats

__all__ = [
    "CHUNK_FIXED_BYTES",
    "CHUNK_MAGIC",
    "CHUNK_VERSION",
    "DEFAULT_CHUNK_SIZE_BYTES",
    "DIGEST_BYTES",
    "DIGEST_NAME",
    "FLAG_DIGEST",
    "MAX_TRANSFER_ID_BYTES",
    "P_CONTROL",
    "P_SEQS",
    "P_TRANSFER",
    "ChunkHeader",
    "ChunkedBlob",
    "Reassembler",
    "ReassemblyStats",
    "SenderLimits",
    "blob_hasher",
    "split_blob",
]

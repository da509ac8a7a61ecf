"""EdgeSplit wire protocol: frames, codecs, chunking, typed messages, transports.

Depends on numpy, zstandard and (for MQTT) paho-mqtt only; never on torch or
the agent/server packages.
"""

from .errors import *  # noqa: F401,F403
from .errors import ProtocolError
from .frame import PROTOCOL_VERSION, FrameLimits, decode_frame, encode_frame
from .codecs import get_codec, list_codecs, register_codec
from .chunking import DEFAULT_CHUNK_SIZE_BYTES, ChunkedBlob, ChunkHeader, Reassembler, split_blob
from .messages import (
    ErrorReply,
    Hello,
    Message,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    decode_message,
    encode_message,
    register_message,
)
from .topics import Topics
from .transport import (
    BrokerAddress,
    Delivery,
    InMemoryBroker,
    InMemoryTransport,
    MqttTransport,
    Transport,
    TransportConfig,
    TransportError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ProtocolError",
    "FrameLimits",
    "decode_frame",
    "encode_frame",
    "get_codec",
    "list_codecs",
    "register_codec",
    "DEFAULT_CHUNK_SIZE_BYTES",
    "ChunkHeader",
    "ChunkedBlob",
    "Reassembler",
    "split_blob",
    "Message",
    "Hello",
    "Welcome",
    "RoundStart",
    "RoundEnd",
    "ErrorReply",
    "Status",
    "Shutdown",
    "encode_message",
    "decode_message",
    "register_message",
    "Topics",
    "BrokerAddress",
    "Delivery",
    "InMemoryBroker",
    "InMemoryTransport",
    "MqttTransport",
    "Transport",
    "TransportConfig",
    "TransportError",
]

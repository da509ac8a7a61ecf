"""EdgeSplit wire protocol: frames, codecs, chunking, typed messages, transports.

Depends on numpy, zstandard, xxhash and (for MQTT) paho-mqtt only; never on torch or
the agent/server packages.
"""

from .errors import *  # noqa: F401,F403
from .errors import ProtocolError
from .frame import PROTOCOL_VERSION, FrameLimits, decode_frame, encode_frame
from .codecs import get_codec, list_codecs, register_codec
from .mqtt.chunk_format import DEFAULT_CHUNK_SIZE_BYTES, ChunkHeader
from .mqtt.chunked_blob import ChunkedBlob, split_blob
from .mqtt.reassembly import Reassembler
from .core_messages import ErrorReply, Hello, RoundEnd, RoundStart, Shutdown, Status, Welcome
from .message_base import Message, decode_message, encode_message, register_message
from .topics import Topics
from .memory_transport import InMemoryBroker, InMemoryTransport
from .mqtt.config import BrokerAddress, TransportConfig
from .mqtt.transport import MqttTransport
from .transport_interface import Delivery, Transport, TransportError

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

"""Transports: how frames move between agents and the server, by their public names.

Each job lives in its own module; this one gathers their public names so that
``from shared_protocol.transport import ...`` keeps working (new code imports
from the module that does the job):

- :mod:`.transport_interface`: the :class:`Transport` interface methods, agents
  and the coordinator see (never paho), :class:`Delivery`, :class:`TrafficStats`,
  :class:`TransportError`;
- :mod:`.wire_bytes`: the size of the MQTT packets a blob travels in;
- :mod:`.mqtt.config`: :class:`BrokerAddress`, :class:`TransportConfig`, TLS, the
  chunk size under the broker's packet limit;
- :mod:`.mqtt.transport`: :class:`MqttTransport`: the connection, the send window,
  the control channel and inbound reassembly, one class; its cache of blobs sent for
  resends in :mod:`.mqtt.resend` (the chunks it cuts and puts back together are the
  rest of :mod:`shared_protocol.mqtt`);
- :mod:`.memory_transport`: :class:`InMemoryTransport` over an :class:`InMemoryBroker`,
  for fast unit tests of methods.
"""

from __future__ import annotations

from .memory_transport import InMemoryBroker, InMemoryTransport, topic_matches
from .mqtt.config import (
    CHUNK_HEADROOM_BYTES,
    MIN_CHUNK_SIZE_BYTES,
    BrokerAddress,
    TransportConfig,
    chunk_size_for,
    redact_url,
    tls_context,
)
from .mqtt.resend import ResendCache
from .mqtt.transport import MqttTransport, make_transport
from .transport_interface import Delivery, TrafficStats, Transport, TransportError
from .wire_bytes import PUBACK_BYTES, publish_packet_bytes, user_properties_bytes

__all__ = [
    "CHUNK_HEADROOM_BYTES",
    "MIN_CHUNK_SIZE_BYTES",
    "PUBACK_BYTES",
    "BrokerAddress",
    "Delivery",
    "InMemoryBroker",
    "InMemoryTransport",
    "MqttTransport",
    "ResendCache",
    "TrafficStats",
    "Transport",
    "TransportConfig",
    "TransportError",
    "chunk_size_for",
    "make_transport",
    "publish_packet_bytes",
    "redact_url",
    "tls_context",
    "topic_matches",
    "user_properties_bytes",
]

"""Counting wire bytes: the size of the MQTT v5 packets that carry what a transport sends.

Wire bytes are the sizes of the MQTT PUBLISH packets (fixed header, topic,
packet id, properties, payload) plus 4-byte PUBACKs, computed from what was
sent and received; TCP/IP and TLS framing are not included.
"""

from __future__ import annotations

PUBACK_BYTES = 4


def _varint_len(value: int) -> int:
    length = 1
    while value >= 128:
        value //= 128
        length += 1
    return length


def user_properties_bytes(user_props: list[tuple[str, str]]) -> int:
    """Length of a PUBLISH properties block holding only user properties, prefix included
    (computed, not packed); chunks carry none, so theirs is the 1-byte empty block."""
    body = sum(5 + len(k.encode()) + len(v.encode()) for k, v in user_props)  # id + two length-prefixed strings
    return _varint_len(body) + body


def publish_packet_bytes(topic: str, payload_len: int, qos: int, properties_len: int) -> int:
    """Size of an MQTT v5 PUBLISH packet; ``properties_len`` includes its length prefix."""
    remaining = 2 + len(topic.encode()) + (2 if qos > 0 else 0) + properties_len + payload_len
    return 1 + _varint_len(remaining) + remaining

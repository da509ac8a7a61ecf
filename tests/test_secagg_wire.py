"""Secure aggregation's messages on the wire: golden frames pin their bytes, and what a
decoder refuses (tests/golden/make_golden.py writes the frames)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared_protocol.errors import ProtocolError, ShapeMismatchError, ValueRangeError
from shared_protocol.messages import Message, decode_message, encode_message
from shared_protocol.secagg_messages import (
    SecAggAdvertise,
    SecAggMaskedInput,
    SecAggRoster,
    SecAggShareKeys,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskShares,
)

GOLDEN = Path(__file__).parent / "golden"


def golden_secagg_messages() -> dict[str, Message]:
    """One message of each type, every byte fixed (file name -> message)."""
    base = {"run": "golden-run", "round": 3, "msg_id": "00000000000000000000000000000002"}
    key = lambda start: (np.arange(32, dtype=np.int64) + start).astype(np.uint8)  # noqa: E731
    rows = lambda n, width, start: ((np.arange(n * width, dtype=np.int64) + start) % 256).astype(np.uint8).reshape(n, width)  # noqa: E731
    return {
        "secagg_advertise_v1.bin": SecAggAdvertise(**base, sender="a1", num_samples=50, c_public=key(0), s_public=key(100)),
        "secagg_roster_v1.bin": SecAggRoster(**base, sender="server", agents=["a1", "a2"], threshold=2, weight_scale=60,
                                             c_public=rows(2, 32, 0), s_public=rows(2, 32, 7)),
        "secagg_share_keys_v1.bin": SecAggShareKeys(**base, sender="a1", recipients=["a2"], ciphertexts=rows(1, 60, 9)),
        "secagg_shares_v1.bin": SecAggShares(**base, sender="server", senders=["a2"], ciphertexts=rows(1, 60, 11)),
        "secagg_masked_input_v1.bin": SecAggMaskedInput(**base, sender="a1", model_version=2, int_buffers={"bn.num_batches_tracked": 4},
                                                        masked=np.array([-5, 0, 2**31 - 1, -(2**31)], np.int32)),
        "secagg_unmask_v1.bin": SecAggUnmask(**base, sender="server", survivors=["a1", "a2"], dropped=["a3"]),
        "secagg_unmask_shares_v1.bin": SecAggUnmaskShares(**base, sender="a1", owners=["a1", "a3"], kinds=["b", "s"],
                                                          shares=rows(2, 16, 3)),
    }


@pytest.mark.parametrize("name", sorted(golden_secagg_messages()))
def test_golden_frames_are_byte_identical_and_decode(name: str) -> None:
    msg = golden_secagg_messages()[name]
    blob = encode_message(msg)
    assert blob == (GOLDEN / name).read_bytes(), f"{name}: the wire format changed (regenerate only on purpose)"
    back = decode_message(blob)
    assert type(back) is type(msg) and back.msg_id == msg.msg_id
    for field in ("masked", "ciphertexts", "shares", "c_public"):
        if hasattr(msg, field):
            np.testing.assert_array_equal(getattr(back, field), getattr(msg, field))


def test_malformed_secagg_messages_are_refused() -> None:
    messages = golden_secagg_messages()
    bad: list[tuple[Message, type[ProtocolError]]] = [
        (SecAggAdvertise(run="r", round=1, sender="a", num_samples=1, c_public=np.zeros(31, np.uint8), s_public=np.zeros(32, np.uint8)),
         ShapeMismatchError),
        (SecAggRoster(run="r", round=1, sender="server", agents=["a", "b"], threshold=3, weight_scale=1,
                      c_public=np.zeros((2, 32), np.uint8), s_public=np.zeros((2, 32), np.uint8)), ValueRangeError),
        (SecAggShareKeys(run="r", round=1, sender="a", recipients=["b", "b"], ciphertexts=np.zeros((2, 60), np.uint8)), ValueRangeError),
        (SecAggShareKeys(run="r", round=1, sender="a", recipients=["a"], ciphertexts=np.zeros((1, 60), np.uint8)), ValueRangeError),
        (SecAggShares(run="r", round=1, sender="server", senders=["b"], ciphertexts=np.zeros((1, 59), np.uint8)), ShapeMismatchError),
        (SecAggMaskedInput(run="r", round=1, sender="a", model_version=0, masked=np.zeros(1, np.int32)), ShapeMismatchError),
        (SecAggUnmaskShares(run="r", round=1, sender="a", owners=["b"], kinds=["x"], shares=np.zeros((1, 16), np.uint8)), ValueRangeError),
    ]
    for msg, error in bad:
        with pytest.raises(error):
            decode_message(encode_message(msg))
    # Positive control: the golden messages themselves decode.
    for msg in messages.values():
        decode_message(encode_message(msg))

"""Frame encoding, golden files, and every malformed-frame error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from shared_protocol import errors
from shared_protocol.frame import PREFIX_BYTES, FrameLimits, decode_frame, encode_frame
from shared_protocol.messages import Hello, RoundStart, decode_message, encode_message
from shared_protocol.records import AgentRoundCosts

GOLDEN = Path(__file__).parent / "golden"


def golden_round_start() -> RoundStart:
    """The message pinned in tests/golden/round_start_v1.bin (see make_golden.py)."""
    return RoundStart(
        run="golden-run",
        round=7,
        sender="server",
        msg_id="00000000000000000000000000000001",
        method="fedgkt",
        config={"epochs": 2, "lr": 0.01},
        deadline_s=30.0,
        evaluate=True,
        participants=["a1", "a2"],
        weights={"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc.bias": np.array([1, -1], np.int64)},
    )


def test_golden_raw_frame_is_byte_identical() -> None:
    blob = encode_message(golden_round_start(), codecs={"weights": "raw"})
    assert blob == (GOLDEN / "round_start_v1.bin").read_bytes()


def test_golden_frame_decodes_to_known_values() -> None:
    msg = decode_message((GOLDEN / "round_start_v1.bin").read_bytes())
    assert isinstance(msg, RoundStart)
    assert (msg.run, msg.round, msg.method, msg.participants) == ("golden-run", 7, "fedgkt", ["a1", "a2"])
    np.testing.assert_array_equal(msg.weights["fc.weight"], np.arange(6, dtype=np.float32).reshape(2, 3))
    compressed = decode_message((GOLDEN / "round_start_zstd_v1.bin").read_bytes())
    np.testing.assert_array_equal(compressed.weights["fc.bias"], [1, -1])


def test_golden_prefix_layout() -> None:
    blob = (GOLDEN / "round_start_v1.bin").read_bytes()
    magic, version, flags, header_len, body_len = struct.unpack(">4sBBIQ", blob[:PREFIX_BYTES])
    assert (magic, version, flags) == (b"ESPL", 1, 0)
    assert PREFIX_BYTES + header_len + body_len == len(blob)
    header = json.loads(blob[PREFIX_BYTES : PREFIX_BYTES + header_len])
    assert header["type"] == "round_start"
    assert [t["name"] for t in header["tensors"]] == ["weights/fc.weight", "weights/fc.bias"]


def good_frame() -> bytes:
    return encode_frame({"type": "x"}, {"t": np.ones((2, 3), np.float32)})


def patch_header(blob: bytes, mutate) -> bytes:  # type: ignore[no-untyped-def]
    _, _, _, header_len, body_len = struct.unpack(">4sBBIQ", blob[:PREFIX_BYTES])
    header = json.loads(blob[PREFIX_BYTES : PREFIX_BYTES + header_len])
    mutate(header)
    new_header = json.dumps(header).encode()
    body = blob[PREFIX_BYTES + header_len :]
    return struct.pack(">4sBBIQ", b"ESPL", 1, 0, len(new_header), body_len) + new_header + body


@pytest.mark.parametrize(
    "make_bad, error",
    [
        (lambda b: b[:10], errors.TruncatedFrameError),
        (lambda b: b[:-1], errors.TruncatedFrameError),
        (lambda b: b"XXXX" + b[4:], errors.BadMagicError),
        (lambda b: b[:4] + bytes([9]) + b[5:], errors.UnsupportedVersionError),
        (lambda b: b + b"\x00", errors.LengthMismatchError),
        (lambda b: b[:6] + struct.pack(">I", 1 << 30) + b[10:], errors.SizeLimitError),
        (lambda b: b[:PREFIX_BYTES] + b"\xff" + b[PREFIX_BYTES + 1 :], errors.HeaderError),
        (lambda b: b[:PREFIX_BYTES] + b"[" + b[PREFIX_BYTES + 1 :], errors.HeaderError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(codec="nope")), errors.UnknownCodecError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(sha256="0" * 64)), errors.HashMismatchError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(shape=[3, 3])), errors.LengthMismatchError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(dtype="object")), errors.ShapeMismatchError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(length=10**6)), errors.LengthMismatchError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].pop("sha256")), errors.HeaderError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(shape=[2**32, 2**32])), errors.SizeLimitError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(shape=[2**64, 1])), errors.SizeLimitError),
        (lambda b: patch_header(b, lambda h: h["tensors"][0].update(shape=[0, 2**70])), errors.SizeLimitError),
        (lambda b: patch_header(b, lambda h: h.update(x=float("nan"))), errors.HeaderError),
        (lambda b: b[:5] + bytes([1]) + b[6:], errors.UnsupportedVersionError),
    ],
)
def test_each_malformed_frame_raises_its_specific_error(make_bad, error) -> None:  # type: ignore[no-untyped-def]
    bad = make_bad(good_frame())
    with pytest.raises(error):
        frame = decode_frame(bad, FrameLimits(max_header_bytes=1 << 20))
        frame.tensors()


def test_non_finite_values_are_refused() -> None:
    blob = encode_frame({"type": "x"}, {"t": np.array([1.0, np.nan], np.float32)})
    with pytest.raises(errors.NonFiniteError):
        decode_frame(blob).tensors()


def test_declared_body_over_limit() -> None:
    with pytest.raises(errors.SizeLimitError):
        decode_frame(good_frame(), FrameLimits(max_body_bytes=8))


def test_declared_elements_over_limit() -> None:
    with pytest.raises(errors.SizeLimitError):
        decode_frame(good_frame(), FrameLimits(max_tensor_elements=5))


def test_message_validation_errors() -> None:
    blob = encode_message(golden_round_start())
    # Wrong message type expected by the receiver.
    with pytest.raises(errors.UnknownMessageTypeError):
        decode_message(blob, expected=Hello)
    # Unknown type name.
    unknown = patch_header(blob, lambda h: h.update(type="mystery"))
    with pytest.raises(errors.UnknownMessageTypeError):
        decode_message(unknown)
    # A field of the wrong JSON type.
    wrong = patch_header(blob, lambda h: h["fields"].update(deadline_s="soon"))
    with pytest.raises(errors.HeaderError, match="deadline_s"):
        decode_message(wrong)
    missing = patch_header(blob, lambda h: h["fields"].pop("method"))
    with pytest.raises(errors.HeaderError, match="method"):
        decode_message(missing)
    bad_round = patch_header(blob, lambda h: h.update(round="7"))
    with pytest.raises(errors.HeaderError, match="round"):
        decode_message(bad_round)


def test_hello_rejects_negative_counts() -> None:
    hello = Hello(
        run="r", round=0, sender="a", cpu_model="x", arch="x86_64", cores=2, memory_bytes=1,
        backend="torch", num_samples=10, class_counts=[5, 5], methods=["fedgkt"],
    )
    decode_message(encode_message(hello))
    hello.class_counts = [5, -1]
    with pytest.raises(errors.ValueRangeError):
        encode_message(hello)


def test_round_end_costs_must_be_finite_and_sane() -> None:
    from shared_protocol.messages import RoundEnd

    def end(**kw):  # type: ignore[no-untyped-def]
        return RoundEnd(run="r", round=1, sender="a", num_samples=4, **kw)

    good = end(costs=AgentRoundCosts(compute_s=1.5), metrics={"edge_accuracy": 0.5, "edge_correct": 1, "edge_total": 2})
    assert decode_message(encode_message(good)).costs == good.costs
    for costs in ({"compute_s": -1.0}, {"compute_s": float("inf")}):
        with pytest.raises(errors.ValueRangeError):
            AgentRoundCosts(**costs)
    # A peer's frame whose costs break the record is refused on decoding, naming the field
    # (JSON itself carries no inf: the frame decoder refuses it before).
    for costs, field_name in (({"compute_s": -1.0}, "compute_s"), ({"samples": "many"}, "samples"), ("fast", "costs")):
        header = decode_frame(encode_message(end())).header
        header["fields"]["costs"] = costs
        with pytest.raises(errors.ValueRangeError, match=field_name):
            decode_message(encode_frame(header, {}, {}))
    for bad in (
        end(metrics={"edge_accuracy": 1.5}),
        end(metrics={"edge_correct": 3, "edge_total": 2}),
        end(uploads={"train": {"samples": -4}}),
    ):
        with pytest.raises(errors.ValueRangeError):
            bad.validate()

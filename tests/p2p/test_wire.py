"""Frames: encoding, and every way a peer can send a bad one."""

from __future__ import annotations

import pytest

from kit.errors import FrameTooLarge, MalformedFrame
from kit.p2p import wire
from kit.p2p.wire import DataFlags, FrameType


def test_data_frame_round_trip() -> None:
    data = wire.encode_frame(FrameType.DATA, 7, b"payload", int(DataFlags.END_MESSAGE))
    frame = wire.decode_frame(data, max_data_payload=1024)
    assert (frame.type, frame.stream_id, bytes(frame.payload)) == (FrameType.DATA, 7, b"payload")
    assert frame.flags == DataFlags.END_MESSAGE


def test_control_frames_round_trip() -> None:
    frame = wire.decode_frame(
        wire.encode_control(FrameType.RESET, 3, {"code": "x", "message": "y"}), 0
    )
    assert wire.decode_reason(frame.payload, "RESET") == ("x", "y")
    credit = wire.decode_frame(wire.encode_credit(5, 12345), 0)
    assert wire.decode_credit(credit) == 12345


@pytest.mark.parametrize(
    "data, error",
    [
        (b"", MalformedFrame),  # empty
        (b"\x06\x00\x00", MalformedFrame),  # truncated header
        (b"\x63\x00\x00\x00\x00\x01", MalformedFrame),  # unknown type
        (wire.encode_frame(FrameType.DATA, 1, b"x", 0x80), MalformedFrame),  # unknown flag
        (wire.encode_frame(FrameType.OPEN, 0, b"\x80"), MalformedFrame),  # stream frame on stream 0
        (
            wire.encode_frame(FrameType.HELLO, 3, b"\x80"),
            MalformedFrame,
        ),  # connection frame on a stream
        (wire.encode_frame(FrameType.RESET, 1, b"\x80", 1), MalformedFrame),  # flags on control
        (wire.encode_frame(FrameType.DATA, 1, b"x" * 2000), FrameTooLarge),
        (
            wire.encode_frame(FrameType.OPEN, 1, b"x" * (wire.MAX_CONTROL_PAYLOAD + 1)),
            FrameTooLarge,
        ),
    ],
)
def test_bad_frames_raise_typed_errors(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        wire.decode_frame(data, max_data_payload=1024)


def test_text_message_is_not_a_frame() -> None:
    with pytest.raises(MalformedFrame):
        wire.decode_frame("text", 1024)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", b"\x81\x01\x02", b"\x81\xa4code\x01"])
def test_control_payloads_are_validated(payload: bytes) -> None:
    with pytest.raises(MalformedFrame):
        wire.decode_reason(payload, "RESET")


def test_zero_and_short_credit_rejected() -> None:
    for data in (wire.encode_credit(1, 0), wire.encode_frame(FrameType.CREDIT, 1, b"\x00\x01")):
        with pytest.raises(MalformedFrame):
            wire.decode_credit(wire.decode_frame(data, 0))

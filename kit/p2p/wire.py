"""The wire format of kit.p2p: frames, their types and limits, and msgpack control payloads (pure).

Every websocket binary message is exactly one frame::

    +--------+--------+-----------------+------------------------------+
    | type   | flags  | stream id (u32) | payload                      |
    | 1 byte | 1 byte | 4 bytes, BE     | rest of the websocket message |
    +--------+--------+-----------------+------------------------------+

Stream 0 carries the connection's own frames (handshake, GOAWAY). The dialer opens odd stream
ids and the listener even ones, so both sides open streams without coordination (as HTTP/2 and
yamux do). Control payloads are small msgpack maps; DATA payloads are raw bytes, never decoded
by kit beyond the frame header. Nothing executable is ever decoded: msgpack with
``strict_map_key`` and no ext hooks, and no pickle anywhere.

This module does no I/O and keeps no state: :mod:`kit.p2p.mux` holds the per-connection state.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from kit.errors import FrameTooLarge, MalformedFrame

#: Bumped on any incompatible change of frames or handshake; peers of another version are
#: refused at the handshake with a message that says which side to upgrade.
#: 2: unmasked websocket frames between kit peers (``plain-frames``), and one message per
#: all-reduce chunk (``kit/averaging/allreduce/3``).
PROTOCOL_VERSION = 2

HEADER = struct.Struct("!BBI")
HEADER_SIZE = HEADER.size
MAX_STREAM_ID = 2**32 - 1

#: Control frames (everything except DATA) are small; larger ones are a protocol violation.
MAX_CONTROL_PAYLOAD = 64 * 1024


class FrameType(enum.IntEnum):
    HELLO = 1  # handshake: dialer's hello, then listener's hello (msgpack)
    AUTH = 2  # handshake: dialer's signature over both hellos (msgpack)
    WELCOME = 3  # handshake: listener accepted the dialer (empty)
    GOAWAY = 4  # the connection is closing, with a reason (msgpack)
    OPEN = 5  # a new stream for a protocol (msgpack)
    DATA = 6  # stream bytes; flags mark message and stream ends
    CREDIT = 7  # flow control: the receiver consumed N more bytes (u32)
    RESET = 8  # the stream is abandoned, with a reason (msgpack)


class DataFlags(enum.IntFlag):
    END_MESSAGE = 0x01  # this frame ends a message
    END_STREAM = 0x02  # the sender will send nothing more on this stream (half-close)


_KNOWN_DATA_FLAGS = int(DataFlags.END_MESSAGE | DataFlags.END_STREAM)
#: Plain ints for the per-frame hot path (an enum call or an IntFlag ``&`` costs ~3 us each).
END_MESSAGE, END_STREAM = int(DataFlags.END_MESSAGE), int(DataFlags.END_STREAM)
_FRAME_TYPES = {int(t): t for t in FrameType}
_CREDIT = struct.Struct("!I")


class Refusal(str, enum.Enum):
    """Machine-readable reasons carried by GOAWAY and handshake refusals."""

    VERSION = "version_mismatch"
    RUN_ID = "wrong_run"
    CONFIG = "config_mismatch"
    AUTH = "unauthorized"
    IDENTITY = "identity_mismatch"
    PROTOCOL = "protocol_error"
    TOO_MANY_STREAMS = "too_many_streams"
    DUPLICATE = "duplicate_connection"
    SHUTDOWN = "shutdown"
    IDLE = "idle"


class ResetCode(str, enum.Enum):
    """Why a stream was reset; the opener maps these to typed errors (see kit.p2p.connection)."""

    CANCELLED = "cancelled"
    UNKNOWN_PROTOCOL = "unknown_protocol"
    HANDLER_ERROR = "handler_error"
    REFUSED = "refused"  # too many concurrent streams: retry later
    TOO_LARGE = "too_large"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    PROTOCOL = "protocol_error"
    MEMORY = "memory"  # the receiver held too many unread bytes (kit.p2p.budget)


@dataclass(frozen=True)
class Frame:
    type: FrameType
    flags: int
    stream_id: int
    payload: memoryview


def encode_frame(
    frame_type: FrameType, stream_id: int, payload: bytes | memoryview = b"", flags: int = 0
) -> bytes:
    """One frame as the bytes of one websocket message."""
    return HEADER.pack(frame_type, flags, stream_id) + payload


def encode_control(frame_type: FrameType, stream_id: int, body: dict[str, Any]) -> bytes:
    return encode_frame(frame_type, stream_id, packb(body))


def encode_credit(stream_id: int, increment: int) -> bytes:
    return encode_frame(FrameType.CREDIT, stream_id, _CREDIT.pack(increment))


def decode_frame(data: bytes | bytearray | memoryview, max_data_payload: int) -> Frame:
    """Parse one frame; raise MalformedFrame / FrameTooLarge for anything a peer must not send."""
    if isinstance(data, str):
        raise MalformedFrame("text websocket messages are not kit frames")
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise MalformedFrame(
            f"frame of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header"
        )
    raw_type, flags, stream_id = HEADER.unpack_from(view)
    frame_type = _FRAME_TYPES.get(raw_type)
    if frame_type is None:
        raise MalformedFrame(f"unknown frame type {raw_type}")
    payload = view[HEADER_SIZE:]
    if frame_type is FrameType.DATA:
        if len(payload) > max_data_payload:
            raise FrameTooLarge(f"DATA frame of {len(payload)} bytes exceeds {max_data_payload}")
        if flags & ~_KNOWN_DATA_FLAGS:
            raise MalformedFrame(f"unknown DATA flags {flags:#x}")
    else:
        if len(payload) > MAX_CONTROL_PAYLOAD:
            raise FrameTooLarge(
                f"{frame_type.name} frame of {len(payload)} bytes exceeds {MAX_CONTROL_PAYLOAD}"
            )
        if flags:
            raise MalformedFrame(f"{frame_type.name} frames carry no flags, got {flags:#x}")
    connection_level = frame_type in (
        FrameType.HELLO,
        FrameType.AUTH,
        FrameType.WELCOME,
        FrameType.GOAWAY,
    )
    if connection_level != (stream_id == 0):
        raise MalformedFrame(f"{frame_type.name} frame on stream {stream_id}")
    return Frame(frame_type, flags, stream_id, payload)


def decode_credit(frame: Frame) -> int:
    if len(frame.payload) != _CREDIT.size:
        raise MalformedFrame(
            f"CREDIT payload must be {_CREDIT.size} bytes, got {len(frame.payload)}"
        )
    (increment,) = _CREDIT.unpack(frame.payload)
    if increment == 0:
        raise MalformedFrame("CREDIT of 0 bytes")
    return int(increment)


def packb(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpackb(payload: bytes | memoryview, what: str) -> Any:
    """Decode msgpack sent by a peer: plain data only, errors become MalformedFrame."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MalformedFrame(f"{what}: payload is not valid msgpack ({type(e).__name__})") from None


def decode_map(
    payload: bytes | memoryview, what: str, schema: dict[str, type | tuple[type, ...]]
) -> dict[str, Any]:
    """Decode a msgpack map and check that each key in ``schema`` is present with the right type.

    Extra keys are ignored, so a newer peer may add optional fields without a version bump.
    """
    body = unpackb(payload, what)
    if not isinstance(body, dict):
        raise MalformedFrame(f"{what}: expected a map, got {type(body).__name__}")
    for key, expected in schema.items():
        if key not in body:
            raise MalformedFrame(f"{what}: missing field {key!r}")
        value = body[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise MalformedFrame(f"{what}: field {key!r} has type {type(value).__name__}")
    return body


def decode_reason(payload: bytes | memoryview, what: str) -> tuple[str, str]:
    """The (code, message) of a GOAWAY or RESET frame."""
    body = decode_map(payload, what, {"code": str, "message": str})
    return body["code"][:64], body["message"][:2000]

"""Streams and flow control without a network: two Mux cores wired back to back."""

from __future__ import annotations

import pytest

from kit.errors import FlowControlViolation, LocalProtocolError, MalformedFrame, TooManyStreams
from kit.p2p import wire
from kit.p2p.mux import (
    TRANSITIONS,
    CreditReceived,
    DataReceived,
    Mux,
    SendFrame,
    StreamOpened,
    StreamResetByPeer,
    StreamState,
)
from kit.p2p.options import MuxLimits
from kit.p2p.wire import FrameType, ResetCode

LIMITS = MuxLimits(
    receive_window=64 * 1024, max_frame=16 * 1024, max_inbound_streams=4, max_refused=3
)


def pair() -> tuple[Mux, Mux]:
    dialer = Mux(
        is_dialer=True,
        limits=LIMITS,
        remote_window=LIMITS.receive_window,
        remote_max_frame=LIMITS.max_frame,
    )
    listener = Mux(
        is_dialer=False,
        limits=LIMITS,
        remote_window=LIMITS.receive_window,
        remote_max_frame=LIMITS.max_frame,
    )
    return dialer, listener


def deliver(mux: Mux, data: bytes | tuple[bytes, memoryview]) -> list[object]:
    frame = data if isinstance(data, bytes) else b"".join(data)
    return list(mux.receive(wire.decode_frame(frame, LIMITS.max_frame)))


def test_open_send_consume_credit() -> None:
    a, b = pair()
    sid, frame = a.open_stream("proto")
    assert sid % 2 == 1
    assert deliver(b, frame) == [StreamOpened(sid, "proto")]
    chunk = memoryview(b"x" * LIMITS.max_frame)
    sent = 0
    while a.send_credit(sid):
        events = deliver(b, a.data_frame(sid, chunk, end_message=True))
        assert isinstance(events[0], DataReceived)
        sent += len(chunk)
    assert sent == LIMITS.receive_window  # exactly one window in flight, then the sender must wait
    with pytest.raises(LocalProtocolError):
        a.data_frame(sid, chunk, end_message=True)
    credit = b.consumed(sid, LIMITS.receive_window // 4)
    assert credit is not None
    assert deliver(a, credit) == [CreditReceived(sid, LIMITS.receive_window // 4)]
    assert a.send_credit(sid) == LIMITS.receive_window // 4


def test_sending_beyond_the_window_drops_the_peer() -> None:
    a, b = pair()
    sid, frame = a.open_stream("proto")
    deliver(b, frame)
    a._streams[sid].send_credit = 10 * LIMITS.receive_window  # a peer that ignores flow control
    with pytest.raises(FlowControlViolation):
        for _ in range(10):
            deliver(b, a.data_frame(sid, memoryview(b"x" * LIMITS.max_frame), end_message=False))


def test_half_close_then_close() -> None:
    a, b = pair()
    sid, frame = a.open_stream("proto")
    deliver(b, frame)
    close = a.close_frame(sid)
    assert close is not None and a.state(sid) is StreamState.LOCAL_CLOSED
    (event,) = deliver(b, close)
    assert isinstance(event, DataReceived) and event.end_stream
    assert b.state(sid) is StreamState.REMOTE_CLOSED
    deliver(a, b.data_frame(sid, memoryview(b"reply"), end_message=True, end_stream=True))
    assert a.state(sid) is StreamState.CLOSED and b.state(sid) is StreamState.CLOSED
    assert a.active_streams == 0 and b.active_streams == 0


def test_data_after_end_stream_is_malformed() -> None:
    a, b = pair()
    sid, frame = a.open_stream("proto")
    deliver(b, frame)
    deliver(b, a.data_frame(sid, memoryview(b"x"), end_message=True, end_stream=False))
    a_record = a._streams[sid]
    deliver(b, wire.encode_frame(FrameType.DATA, sid, b"", 2))  # END_STREAM
    a_record.state = StreamState.OPEN
    with pytest.raises(MalformedFrame):
        deliver(b, wire.encode_frame(FrameType.DATA, sid, b"x", 1))


def test_reset_and_late_frames() -> None:
    a, b = pair()
    sid, frame = a.open_stream("proto")
    deliver(b, frame)
    reset = a.reset_frame(sid, ResetCode.CANCELLED, "bye")
    assert reset is not None
    assert deliver(b, reset) == [StreamResetByPeer(sid, "cancelled", "bye")]
    # Frames racing with a reset are ignored, not treated as errors.
    assert deliver(a, wire.encode_frame(FrameType.DATA, sid, b"late", 1)) == []
    assert deliver(b, wire.encode_credit(sid, 10)) == []


def test_frames_for_never_opened_streams_are_malformed() -> None:
    a, b = pair()
    with pytest.raises(MalformedFrame):
        deliver(b, wire.encode_frame(FrameType.DATA, 99, b"x", 1))
    with pytest.raises(MalformedFrame):  # wrong parity: the listener may not open odd ids
        deliver(a, wire.encode_control(FrameType.OPEN, 3, {"protocol": "p"}))


def test_too_many_streams_refused_then_dropped() -> None:
    a, b = pair()
    for _ in range(LIMITS.max_inbound_streams):
        _, frame = a.open_stream("p")
        assert isinstance(deliver(b, frame)[0], StreamOpened)
    for _ in range(LIMITS.max_refused):
        _, frame = a.open_stream("p")
        (event,) = deliver(b, frame)
        assert isinstance(event, SendFrame)
        reset = wire.decode_frame(event.data, 0)
        assert wire.decode_reason(reset.payload, "RESET")[0] == "refused"
    _, frame = a.open_stream("p")
    with pytest.raises(TooManyStreams):
        deliver(b, frame)


def test_refusals_count_in_a_row_not_over_a_connections_life() -> None:
    a, b = pair()
    held = []
    for _ in range(LIMITS.max_inbound_streams):
        sid, frame = a.open_stream("p")
        assert isinstance(deliver(b, frame)[0], StreamOpened)
        held.append(sid)
    for _ in range(4 * LIMITS.max_refused):  # a long run: busy moments between quiet ones
        for _ in range(LIMITS.max_refused):
            _, frame = a.open_stream("p")
            assert isinstance(deliver(b, frame)[0], SendFrame)  # refused
        closing = held.pop(0)
        reset = a.reset_frame(closing, ResetCode.CANCELLED, "done")
        assert reset is not None
        deliver(b, reset)
        sid, frame = a.open_stream("p")
        assert isinstance(deliver(b, frame)[0], StreamOpened)
        held.append(sid)


def test_transition_table_is_complete_and_final_states_are_terminal() -> None:
    assert set(TRANSITIONS) == set(StreamState)
    assert TRANSITIONS[StreamState.CLOSED] == {} and TRANSITIONS[StreamState.RESET] == {}


def test_protocol_name_limits() -> None:
    a, b = pair()
    with pytest.raises(LocalProtocolError):
        a.open_stream("")
    with pytest.raises(MalformedFrame):
        deliver(b, wire.encode_control(FrameType.OPEN, 1, {"protocol": "x" * 500}))

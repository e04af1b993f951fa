"""Multiplexed streams over one connection, as a pure core: frames in, events and frames out.

One websocket connection per peer pair carries many logical streams, so a 72 MB tensor part and
a 100-byte DHT request do not wait for each other. Each stream has:

* a state machine (``StreamState`` + ``TRANSITIONS`` below: every legal move is in the table);
* flow control per stream, as in HTTP/2 and yamux: a sender may have at most ``window`` bytes
  unconsumed at the receiver; the receiver returns credit (a CREDIT frame) as the application
  consumes data. A slow reader therefore bounds the sender's memory to about one window, and a
  peer that sends beyond its credit is cut off (``FlowControlViolation``).

Limits (:class:`~kit.p2p.options.MuxLimits`) protect a peer from its peers: at most
``max_inbound_streams`` concurrent streams opened
by the remote side (more are refused with RESET "refused"; a peer that keeps opening after
``max_refused`` refusals in a row is disconnected), frames no larger than announced, protocol names short.
Windows bound a stream, not the streams together: the connection's unread bytes are charged
against ``connection_buffer`` (and a peer-wide :class:`~kit.p2p.budget.BufferLedger`); over it,
the stream holding the most is reset with code ``memory`` (``shed``), and while a connection
could not take another full window, new inbound streams are refused (``kit.p2p.budget`` says why
this and not a connection window, counts the bytes and chooses the stream to reset).

This module never awaits and never reads a clock; :mod:`kit.p2p.connection` drives it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from kit.errors import (
    FlowControlViolation,
    LocalProtocolError,
    MalformedFrame,
    TooManyStreams,
)
from kit.p2p import wire
from kit.p2p.budget import CHUNK_COST, BufferLedger, ConnectionBuffers, StreamCharges
from kit.p2p.options import MuxLimits
from kit.p2p.wire import DataFlags, Frame, FrameType, ResetCode

MAX_PROTOCOL_NAME = 200


class StreamState(enum.Enum):
    OPEN = "open"
    LOCAL_CLOSED = "local_closed"  # we sent END_STREAM; we may still receive
    REMOTE_CLOSED = "remote_closed"  # they sent END_STREAM; we may still send
    CLOSED = "closed"  # both halves ended
    RESET = "reset"  # abandoned by either side


class StreamEvent(enum.Enum):
    LOCAL_END = "local_end"
    REMOTE_END = "remote_end"
    RESET = "reset"


TRANSITIONS: dict[StreamState, dict[StreamEvent, StreamState]] = {
    StreamState.OPEN: {
        StreamEvent.LOCAL_END: StreamState.LOCAL_CLOSED,
        StreamEvent.REMOTE_END: StreamState.REMOTE_CLOSED,
        StreamEvent.RESET: StreamState.RESET,
    },
    StreamState.LOCAL_CLOSED: {
        StreamEvent.REMOTE_END: StreamState.CLOSED,
        StreamEvent.RESET: StreamState.RESET,
    },
    StreamState.REMOTE_CLOSED: {
        StreamEvent.LOCAL_END: StreamState.CLOSED,
        StreamEvent.RESET: StreamState.RESET,
    },
    StreamState.CLOSED: {},
    StreamState.RESET: {},
}
FINAL_STATES = (StreamState.CLOSED, StreamState.RESET)


# --- events handed to the driver -------------------------------------------------------------


@dataclass(frozen=True)
class StreamOpened:
    stream_id: int
    protocol: str


@dataclass(frozen=True)
class DataReceived:
    stream_id: int
    data: memoryview
    end_message: bool
    end_stream: bool


@dataclass(frozen=True)
class CreditReceived:
    stream_id: int
    increment: int


@dataclass(frozen=True)
class StreamResetByPeer:
    stream_id: int
    code: str
    message: str


@dataclass(frozen=True)
class GoAway:
    code: str
    message: str


@dataclass(frozen=True)
class StreamShed:
    """We reset ``stream_id`` for memory: the driver drops its buffered chunks and sends ``frame``."""

    stream_id: int
    unread: int  # payload bytes it held unread
    frame: bytes  # the RESET to send


@dataclass(frozen=True)
class SendFrame:
    """A frame the driver must send in reply (e.g. a RESET refusing a stream)."""

    data: bytes


Event = (
    StreamOpened
    | DataReceived
    | CreditReceived
    | StreamResetByPeer
    | GoAway
    | SendFrame
    | StreamShed
)


_DATA = int(FrameType.DATA)


class _StreamRecord(StreamCharges):
    __slots__ = ("consumed_unacked", "received_unconsumed", "send_credit", "state")

    def __init__(self, send_credit: int) -> None:
        super().__init__()
        self.state = StreamState.OPEN
        self.send_credit = send_credit  # bytes we may still send
        self.received_unconsumed = 0  # bytes received and not yet consumed by the application
        self.consumed_unacked = 0  # consumed bytes not yet returned as credit


class Mux:
    """Stream bookkeeping for one established connection."""

    def __init__(
        self,
        *,
        is_dialer: bool,
        limits: MuxLimits,
        remote_window: int,
        remote_max_frame: int,
        ledger: BufferLedger[Hashable] | None = None,
        holder: Hashable | None = None,
    ) -> None:
        self.limits = limits
        # What the unread chunks of its streams cost here, against which budgets (kit.p2p.budget)
        self.buffers = ConnectionBuffers(ledger, self if holder is None else holder)
        self.shed_count = 0  # streams reset for memory so far
        self.remote_window = remote_window
        self.send_frame_size = min(remote_max_frame, limits.max_frame)
        self._streams: dict[int, _StreamRecord] = {}
        self._next_local_id = 1 if is_dialer else 2
        self._local_parity = self._next_local_id % 2
        self._highest_remote_id = 0
        self._inbound_open = 0
        self._refused = 0

    # --- queries -------------------------------------------------------------------------

    def state(self, stream_id: int) -> StreamState:
        record = self._streams.get(stream_id)
        return record.state if record is not None else StreamState.CLOSED

    def send_credit(self, stream_id: int) -> int:
        record = self._streams.get(stream_id)
        return record.send_credit if record is not None else 0

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    # --- local actions -------------------------------------------------------------------

    def open_stream(self, protocol: str) -> tuple[int, bytes]:
        """Allocate a stream id; returns it and the OPEN frame to send."""
        if not 0 < len(protocol) <= MAX_PROTOCOL_NAME:
            raise LocalProtocolError(f"protocol name must be 1..{MAX_PROTOCOL_NAME} characters")
        stream_id = self._next_local_id
        if stream_id > wire.MAX_STREAM_ID:
            raise LocalProtocolError("stream ids exhausted on this connection")
        self._next_local_id += 2
        self._streams[stream_id] = self._new_record()
        return stream_id, wire.encode_control(FrameType.OPEN, stream_id, {"protocol": protocol})

    def data_frame(
        self,
        stream_id: int,
        data: memoryview | tuple[memoryview, ...],
        *,
        end_message: bool,
        end_stream: bool = False,
    ) -> tuple[bytes | memoryview, ...]:
        """A DATA frame as (header, *payload parts): no copy of the payload is made here.

        ``data`` (one buffer or several parts) must fit the stream's credit and the frame size.
        """
        parts = data if isinstance(data, tuple) else (data,)
        size = sum(len(part) for part in parts)
        record = self._streams.get(stream_id)
        if record is None or record.state not in (StreamState.OPEN, StreamState.REMOTE_CLOSED):
            raise LocalProtocolError(
                f"stream {stream_id} cannot send in state {self.state(stream_id).value}"
            )
        if size > record.send_credit or size > self.send_frame_size:
            raise LocalProtocolError(
                f"{size} bytes exceed credit {record.send_credit} or frame size"
            )
        record.send_credit -= size
        flags = (wire.END_MESSAGE if end_message else 0) | (wire.END_STREAM if end_stream else 0)
        if end_stream:
            self._transition(stream_id, record, StreamEvent.LOCAL_END)
        return (wire.HEADER.pack(_DATA, flags, stream_id), *parts)

    def close_frame(self, stream_id: int) -> bytes | None:
        """END_STREAM as an empty DATA frame (half-close), or None if already closed/reset."""
        record = self._streams.get(stream_id)
        if record is None or record.state not in (StreamState.OPEN, StreamState.REMOTE_CLOSED):
            return None
        self._transition(stream_id, record, StreamEvent.LOCAL_END)
        return wire.encode_frame(FrameType.DATA, stream_id, b"", int(DataFlags.END_STREAM))

    def reset_frame(self, stream_id: int, code: ResetCode, message: str = "") -> bytes | None:
        """Abandon a stream; returns the RESET frame, or None if it is already gone."""
        record = self._streams.get(stream_id)
        if record is None or record.state in FINAL_STATES:
            return None
        self._transition(stream_id, record, StreamEvent.RESET)
        return wire.encode_control(
            FrameType.RESET, stream_id, {"code": code.value, "message": message[:500]}
        )

    def consumed(self, stream_id: int, size: int) -> bytes | None:
        """The application consumed one received chunk of ``size`` bytes (maybe empty: a bare
        end of message); maybe return a CREDIT frame."""
        record = self._streams.get(stream_id)
        if record is None:
            return None  # reset or closed: its bytes were released then
        record.received_unconsumed -= size
        record.consumed_unacked += size
        # Less is charged only once ``release_all`` let go of everything (connection closed;
        # the application may still read the chunks it was given).
        self.buffers.release(record, min(size + CHUNK_COST, record.cost))
        self.buffers.touch(record)
        if record.state in FINAL_STATES or record.state is StreamState.REMOTE_CLOSED:
            return None  # the remote will send nothing more: no credit needed
        # Return credit in batches of a quarter window: fewer frames, the pipe never drains.
        if record.consumed_unacked >= self.limits.receive_window // 4:
            increment, record.consumed_unacked = record.consumed_unacked, 0
            return wire.encode_credit(stream_id, increment)
        return None

    # --- remote frames -------------------------------------------------------------------

    def receive(self, frame: Frame) -> list[Event]:
        """Apply one frame from the remote peer (already parsed by ``wire.decode_frame``).

        Raises:
            RemoteProtocolError: the frame breaks the protocol; drop the connection.
        """
        if frame.type is FrameType.GOAWAY:
            code, message = wire.decode_reason(frame.payload, "GOAWAY")
            return [GoAway(code, message)]
        if frame.stream_id == 0:
            raise MalformedFrame(f"unexpected {frame.type.name} after the handshake")
        if frame.type is FrameType.OPEN:
            return self._receive_open(frame)
        record = self._streams.get(frame.stream_id)
        if record is None:
            if self._is_known_id(frame.stream_id):
                return []  # a frame racing with our RESET or a completed close: harmless
            raise MalformedFrame(
                f"{frame.type.name} for stream {frame.stream_id} that was never opened"
            )
        if frame.type is FrameType.DATA:
            return self._receive_data(frame, record)
        if frame.type is FrameType.CREDIT:
            increment = wire.decode_credit(frame)
            if record.state in FINAL_STATES:
                return []
            record.send_credit += increment
            if record.send_credit > 2**40:
                raise FlowControlViolation(f"credit overflow on stream {frame.stream_id}")
            return [CreditReceived(frame.stream_id, increment)]
        if frame.type is FrameType.RESET:
            code, message = wire.decode_reason(frame.payload, "RESET")
            if record.state in FINAL_STATES:
                return []
            self._transition(frame.stream_id, record, StreamEvent.RESET)
            return [StreamResetByPeer(frame.stream_id, code, message)]
        raise MalformedFrame(f"unexpected {frame.type.name} frame after the handshake")

    def _is_known_id(self, stream_id: int) -> bool:
        if stream_id % 2 == self._local_parity:
            return stream_id < self._next_local_id
        return stream_id <= self._highest_remote_id

    def _receive_open(self, frame: Frame) -> list[Event]:
        stream_id = frame.stream_id
        if stream_id % 2 == self._local_parity or stream_id <= self._highest_remote_id:
            raise MalformedFrame(f"OPEN with invalid stream id {stream_id}")
        body = wire.decode_map(frame.payload, "OPEN", {"protocol": str})
        protocol = body["protocol"]
        if not 0 < len(protocol) <= MAX_PROTOCOL_NAME:
            raise MalformedFrame(f"OPEN: protocol name of {len(protocol)} characters")
        self._highest_remote_id = stream_id
        buffered = self.buffers.buffered
        full = buffered + self.limits.receive_window > self.limits.connection_buffer
        if self._inbound_open >= self.limits.max_inbound_streams or full:
            self._refused += 1
            if self._refused > self.limits.max_refused:
                raise TooManyStreams(
                    f"peer opened streams beyond the limit of {self.limits.max_inbound_streams} "
                    f"{self._refused} times in a row"
                )
            message = f"more than {self.limits.max_inbound_streams} concurrent streams"
            if full:
                message = f"{buffered} bytes unread on this connection: no room for a window"
            reset = wire.encode_control(
                FrameType.RESET, stream_id, {"code": ResetCode.REFUSED.value, "message": message}
            )
            return [SendFrame(reset)]
        self._inbound_open += 1
        # Refusals count in a row: an honest peer of a days-long run is refused now and then
        # (a busy moment, a full connection) and must not be dropped for their sum.
        self._refused = 0
        self._streams[stream_id] = self._new_record()
        return [StreamOpened(stream_id, protocol)]

    # --- memory budget -----------------------------------------------------------------

    def awaiting(self, stream_id: int, awaited: bool) -> None:
        """The application starts (True) or stops (False) waiting for data on ``stream_id``."""
        record = self._streams.get(stream_id)
        if record is not None:
            record.awaited = awaited

    def shed(self, why: str, *, circuits: bool = False) -> StreamShed | None:
        """Reset the stream ``ConnectionBuffers.victim`` chooses (of the relayed circuits if
        ``circuits``, else of the others), releasing its unread bytes; None if none holds any."""
        victim_id = self.buffers.victim(self._streams, self._local_parity, circuits=circuits)
        if victim_id is None:
            return None
        victim = self._streams[victim_id]
        unread = victim.received_unconsumed
        message = (
            f"reset for memory: {unread} bytes unread on this stream, {why}. help: the receiver "
            "must read its streams; or raise its MuxLimits.connection_buffer / "
            "PeerOptions.buffer_budget"
        )
        frame = self.reset_frame(victim_id, ResetCode.MEMORY, message)
        assert frame is not None  # a stream holding bytes is not final
        self.shed_count += 1
        return StreamShed(victim_id, unread, frame)

    def _new_record(self) -> _StreamRecord:
        record = _StreamRecord(self.remote_window)
        self.buffers.touch(record)
        return record

    def mark_circuit(self, stream_id: int, ledger: BufferLedger[Hashable], budget: int) -> None:
        """``stream_id`` is a circuit this peer relays: from now on its unread bytes count
        against ``budget`` (for this connection) and ``ledger`` (the relay's), not against
        ``connection_buffer`` and the peer's ledger (``kit.p2p.relay`` says why)."""
        record = self._streams.get(stream_id)
        if record is not None and not record.circuit:
            self.buffers.charge_to_circuits(record, ledger, budget)

    def release_all(self) -> None:
        """The connection is gone: nothing it received is ours to count any more."""
        self.buffers.release_all(self._streams.values())

    def _receive_data(self, frame: Frame, record: _StreamRecord) -> list[Event]:
        if record.state in FINAL_STATES:
            return []  # data racing with our RESET
        if record.state is StreamState.REMOTE_CLOSED:
            raise MalformedFrame(f"DATA after END_STREAM on stream {frame.stream_id}")
        size = len(frame.payload)
        record.received_unconsumed += size
        if record.received_unconsumed > self.limits.receive_window:
            raise FlowControlViolation(
                f"stream {frame.stream_id}: {record.received_unconsumed} unconsumed bytes exceed "
                f"the window of {self.limits.receive_window}"
            )
        end_message = bool(frame.flags & wire.END_MESSAGE)
        end_stream = bool(frame.flags & wire.END_STREAM)
        if size or end_message:  # exactly the chunks the driver queues (``Stream.deliver``)
            if not record.cost:  # it starts holding unread bytes now
                self.buffers.touch(record)
            self.buffers.charge(record, size + CHUNK_COST)
        if end_stream:
            self._transition(frame.stream_id, record, StreamEvent.REMOTE_END)
        events: list[Event] = [
            DataReceived(frame.stream_id, frame.payload, end_message, end_stream)
        ]
        buffers = self.buffers
        if record.circuit:
            budget = buffers.circuit_budget
            while buffers.circuit_buffered > budget and (
                shed := self.shed(
                    f"the circuits relayed for this peer held {buffers.circuit_buffered} of "
                    f"their {budget} (RelayLimits.peer_buffer)",
                    circuits=True,
                )
            ):
                events.append(shed)
            buffers.circuit_peak = max(buffers.circuit_peak, buffers.circuit_buffered)
            return events
        budget = self.limits.connection_buffer
        while buffers.buffered > budget and (
            shed := self.shed(f"the connection held {buffers.buffered} of its {budget}")
        ):
            events.append(shed)
        return events

    def _transition(self, stream_id: int, record: _StreamRecord, event: StreamEvent) -> None:
        new_state = TRANSITIONS[record.state].get(event)
        if new_state is None:
            raise LocalProtocolError(
                f"stream {stream_id}: no transition {record.state.value} --{event.value}-->"
            )
        record.state = new_state
        if new_state in FINAL_STATES:
            # Forget final streams at once: late frames for them are recognised by id range.
            # Their unread chunks are no longer counted: a reset drops them (and cancels an
            # inbound stream's handler); what a fully closed stream still holds is bounded by
            # one window and lives only as long as the application keeps the stream.
            if record.cost:
                self.buffers.release(record, record.cost)
            del self._streams[stream_id]
            if stream_id % 2 != self._local_parity:
                self._inbound_open -= 1

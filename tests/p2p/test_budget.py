"""The memory budget as pure cores: the ledger's accounting and the Mux's shedding policy."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from kit.errors import ConfigError
from kit.p2p import wire
from kit.p2p.budget import CHUNK_COST, BufferLedger
from kit.p2p.mux import DataReceived, Mux, SendFrame, StreamOpened, StreamShed
from kit.p2p.options import MuxLimits, PeerOptions, RelayLimits
from kit.p2p.wire import FrameType, ResetCode

WINDOW = 64 * 1024
FRAME = 16 * 1024
LIMITS = MuxLimits(
    receive_window=WINDOW,
    max_frame=FRAME,
    max_inbound_streams=64,
    max_refused=1000,
    connection_buffer=4 * WINDOW,
)
CHUNK = memoryview(b"x" * FRAME)
FULL_WINDOW_COST = WINDOW + (WINDOW // FRAME) * CHUNK_COST


def mux(
    limits: MuxLimits = LIMITS,
    ledger: BufferLedger[Hashable] | None = None,
    *,
    is_dialer: bool = True,
) -> Mux:
    return Mux(
        is_dialer=is_dialer,
        limits=limits,
        remote_window=limits.receive_window,
        remote_max_frame=limits.max_frame,
        ledger=ledger,
    )


def deliver(receiver: Mux, frame: bytes | tuple[bytes | memoryview, ...]) -> list[object]:
    data = frame if isinstance(frame, bytes) else b"".join(frame)
    return list(receiver.receive(wire.decode_frame(data, LIMITS.max_frame)))


def consume(receiver: Mux, events: list[object]) -> list[bytes]:
    """The application reads every chunk it was given, as ``Stream._next_chunk`` does; the
    CREDIT frames to send back."""
    credits = []
    for event in events:
        if isinstance(event, DataReceived) and (event.data or event.end_message):
            credit = receiver.consumed(event.stream_id, len(event.data))
            if credit is not None:
                credits.append(credit)
    return credits


def fill(sender: Mux, receiver: Mux, stream_id: int, frames: int) -> list[object]:
    """Send ``frames`` full frames on ``stream_id`` (all within its credit); the events."""
    events: list[object] = []
    for _ in range(frames):
        events += deliver(receiver, sender.data_frame(stream_id, CHUNK, end_message=True))
    return events


def sheds(events: list[object]) -> list[StreamShed]:
    return [event for event in events if isinstance(event, StreamShed)]


def open_streams(sender: Mux, receiver: Mux, count: int) -> list[int]:
    ids = []
    for _ in range(count):
        stream_id, frame = sender.open_stream("sink")
        assert deliver(receiver, frame) == [StreamOpened(stream_id, "sink")]
        ids.append(stream_id)
    return ids


def test_ledger_counts_holders_and_names_the_heaviest() -> None:
    ledger: BufferLedger[str] = BufferLedger(budget=100)
    assert ledger.heaviest() is None
    ledger.charge("a", 60)
    ledger.charge("b", 30)
    ledger.charge("a", 20)
    assert (ledger.total, ledger.held("a"), ledger.excess) == (110, 80, 10)
    assert ledger.heaviest() == "a"
    ledger.release("a", 70)
    assert ledger.heaviest() == "b"
    assert ledger.settle() == 40 and ledger.peak == 40
    ledger.forget("b")
    ledger.release("a", 10)
    assert (ledger.total, ledger.excess, ledger.heaviest()) == (0, 0, None)


def test_a_remote_filling_every_window_is_held_to_the_connection_budget() -> None:
    """16 unread streams x a full window each would be 4x the budget: the fullest are reset."""
    sender, receiver = mux(), mux(is_dialer=False)
    ids = open_streams(sender, receiver, 4)  # a full window each fits the budget exactly...
    shed: list[StreamShed] = []
    for stream_id in ids:
        shed += sheds(fill(sender, receiver, stream_id, WINDOW // FRAME))
        assert receiver.buffers.buffered <= LIMITS.connection_buffer
    # ...but their chunk costs do not: the oldest full one goes, with a RESET "memory" frame
    assert len(shed) == 1 and shed[0].stream_id == ids[0] and shed[0].unread == WINDOW
    reset = wire.decode_frame(shed[0].frame, FRAME)
    assert reset.type is FrameType.RESET and reset.stream_id == ids[0]
    assert wire.decode_reason(reset.payload, "RESET")[0] == ResetCode.MEMORY.value
    assert receiver.buffers.buffered == 3 * FULL_WINDOW_COST
    assert receiver.shed_count == 1
    # frames racing with the RESET (sent on credit returned before it) are dropped, not counted
    deliver(sender, wire.encode_credit(ids[0], FRAME))
    assert deliver(receiver, sender.data_frame(ids[0], CHUNK, end_message=True)) == []
    assert receiver.buffers.buffered == 3 * FULL_WINDOW_COST


def test_new_streams_are_refused_while_a_window_would_not_fit() -> None:
    sender, receiver = mux(), mux(is_dialer=False)
    first, *others = open_streams(sender, receiver, 3)
    events = fill(sender, receiver, first, WINDOW // FRAME)
    for stream_id in others:
        fill(sender, receiver, stream_id, WINDOW // FRAME)
    assert (
        receiver.buffers.buffered + WINDOW > LIMITS.connection_buffer >= receiver.buffers.buffered
    )
    _, frame = sender.open_stream("sink")
    (refusal,) = deliver(receiver, frame)
    assert isinstance(refusal, SendFrame)
    code, message = wire.decode_reason(wire.decode_frame(refusal.data, FRAME).payload, "RESET")
    assert code == ResetCode.REFUSED.value and "unread" in message
    assert receiver.active_streams == 3
    consume(receiver, events)  # once the application reads, streams are accepted again
    open_streams(sender, receiver, 1)


def test_the_stream_being_read_is_not_the_one_reset() -> None:
    """Equal unread bytes: the stream read longest ago goes first (a reader catching up stays)."""
    sender, receiver = mux(), mux(is_dialer=False)
    reader, idle, *others = open_streams(sender, receiver, 4)
    for stream_id in (idle, *others):
        assert not sheds(fill(sender, receiver, stream_id, WINDOW // FRAME))
    for credit in consume(receiver, fill(sender, receiver, reader, 1)):  # read its first chunk,
        deliver(sender, credit)
    shed = sheds(fill(sender, receiver, reader, WINDOW // FRAME))  # then fell a window behind
    assert [event.stream_id for event in shed] == [idle]  # as full, but never read


def test_a_stream_the_application_waits_on_and_our_own_streams_go_last() -> None:
    """The fullest stream is spared while the application is waiting to read it (its bytes go
    as soon as the loop turns), and streams we opened are shed only after the remote's."""
    dialer, listener = mux(), mux(is_dialer=False)
    awaited, idle, late = open_streams(dialer, listener, 3)  # the remote (dialer) opened these
    ours, frame = listener.open_stream("download")
    deliver(dialer, frame)
    for stream_id in (awaited, ours, idle):
        fill(dialer, listener, stream_id, WINDOW // FRAME)
    listener.awaiting(awaited, True)
    assert [event.stream_id for event in sheds(fill(dialer, listener, late, 4))] == [idle]
    listener.awaiting(awaited, False)  # it stopped waiting: now it is the remote's oldest full
    order = [listener.shed("test") for _ in range(3)]
    assert [shed.stream_id for shed in order if shed is not None] == [awaited, late, ours]
    assert listener.shed("test") is None and listener.buffers.buffered == 0


def test_empty_frames_cost_memory_and_are_budgeted() -> None:
    """Windows count payload bytes only: a remote sending empty end-of-message frames is held to
    the budget by the per-chunk cost instead of queueing millions of tiny chunks."""
    sender, receiver = mux(), mux(is_dialer=False)
    (stream_id,) = open_streams(sender, receiver, 1)
    empty = memoryview(b"")
    sent = 0
    while sent <= LIMITS.connection_buffer // CHUNK_COST + 2:
        sent += 1
        events = deliver(receiver, sender.data_frame(stream_id, empty, end_message=True))
        assert receiver.buffers.buffered <= LIMITS.connection_buffer
        if sheds(events):
            break
    assert sent == LIMITS.connection_buffer // CHUNK_COST + 1  # the first one over the budget
    assert receiver.buffers.buffered == 0


def test_reading_releases_and_a_legitimate_heavy_pattern_is_never_reset() -> None:
    """Many streams, each streaming 50 windows that the application reads as they come."""
    ledger: BufferLedger[Hashable] = BufferLedger(budget=LIMITS.connection_buffer)
    sender, receiver = mux(), mux(ledger=ledger, is_dialer=False)
    ids = open_streams(sender, receiver, 16)
    for _ in range(50 * WINDOW // FRAME):
        for stream_id in ids:
            events = fill(sender, receiver, stream_id, 1)
            assert not sheds(events)
            for credit in consume(receiver, events):
                deliver(sender, credit)
    assert receiver.shed_count == 0
    assert receiver.buffers.buffered == ledger.total == 0  # every chunk read, nothing held


def test_a_reset_or_a_closed_connection_releases_its_bytes_from_the_ledger() -> None:
    ledger: BufferLedger[Hashable] = BufferLedger(budget=10 * LIMITS.connection_buffer)
    sender, receiver = mux(), mux(ledger=ledger, is_dialer=False)
    first, second = open_streams(sender, receiver, 2)
    fill(sender, receiver, first, 2)
    fill(sender, receiver, second, 3)
    assert ledger.total == receiver.buffers.buffered == 5 * (FRAME + CHUNK_COST)
    assert receiver.reset_frame(second, ResetCode.CANCELLED) is not None
    assert ledger.total == receiver.buffers.buffered == 2 * (FRAME + CHUNK_COST)
    deliver(receiver, wire.encode_control(FrameType.RESET, first, {"code": "x", "message": ""}))
    assert ledger.total == receiver.buffers.buffered == 0
    (third,) = open_streams(sender, receiver, 1)
    fill(sender, receiver, third, 1)
    receiver.release_all()
    assert ledger.total == receiver.buffers.buffered == 0 and ledger.heaviest() is None
    # The application may still read the chunk it was given after the connection closed.
    receiver.consumed(third, FRAME)  # used to trip the ledger: releasing bytes it let go of
    assert ledger.total == receiver.buffers.buffered == 0


def test_relayed_circuits_are_charged_to_the_relay_budgets_only() -> None:
    """A relay's circuits (``kit.p2p.relay``): more than connection_buffer of them is no reset
    and no refusal of new streams; over the relay's per-peer budget a circuit is reset, and
    never a stream of the peer's own."""
    peer_ledger: BufferLedger[Hashable] = BufferLedger(budget=10 * LIMITS.connection_buffer)
    relay_ledger: BufferLedger[Hashable] = BufferLedger(budget=100 * WINDOW)
    sender, receiver = mux(), mux(ledger=peer_ledger, is_dialer=False)
    own, *circuits = open_streams(sender, receiver, 8)
    fill(sender, receiver, circuits[0], 1)
    for stream_id in circuits:
        receiver.mark_circuit(stream_id, relay_ledger, budget=6 * FULL_WINDOW_COST)
    assert receiver.buffers.buffered == peer_ledger.total == 0  # moved to the relay's ledger
    fill(sender, receiver, own, 1)
    events: list[object] = []
    for stream_id in circuits[:6]:  # 6 full windows: over connection_buffer (4), at the budget
        events += fill(sender, receiver, stream_id, WINDOW // FRAME - (stream_id == circuits[0]))
    assert sheds(events) == [] and receiver.buffers.circuit_buffered == 6 * FULL_WINDOW_COST
    assert relay_ledger.total == receiver.buffers.circuit_buffered
    assert open_streams(sender, receiver, 1)  # new streams still accepted
    shed = sheds(fill(sender, receiver, circuits[6], 1))
    assert [event.stream_id for event in shed] != [] and own not in [e.stream_id for e in shed]
    assert receiver.buffers.circuit_peak <= 6 * FULL_WINDOW_COST
    assert receiver.buffers.buffered == peer_ledger.total == FRAME + CHUNK_COST
    receiver.release_all()
    assert relay_ledger.total == peer_ledger.total == 0


def test_over_the_peer_budget_the_heaviest_connection_sheds() -> None:
    """The policy the driver runs (``Connection._shed_for_peer``): the connection holding the
    most resets its fullest stream until the peer is under budget; the light one keeps all."""
    ledger: BufferLedger[Hashable] = BufferLedger(budget=4 * WINDOW)
    heavy_sender, heavy = mux(), mux(ledger=ledger, is_dialer=False)
    light_sender, light = mux(), mux(ledger=ledger, is_dialer=False)
    heavy_ids = open_streams(heavy_sender, heavy, 3)
    (light_id,) = open_streams(light_sender, light, 1)
    fill(light_sender, light, light_id, WINDOW // FRAME)
    for stream_id in heavy_ids:
        fill(heavy_sender, heavy, stream_id, WINDOW // FRAME)
    assert ledger.excess > 0 and ledger.heaviest() is heavy
    while ledger.excess and (holder := ledger.heaviest()) is not None:
        assert isinstance(holder, Mux)
        assert holder.shed("peer over budget") is not None
    assert ledger.settle() <= ledger.budget
    assert heavy.shed_count == 1 and light.shed_count == 0
    assert light.buffers.buffered == FULL_WINDOW_COST


def test_budgets_smaller_than_what_they_contain_are_refused() -> None:
    with pytest.raises(ConfigError, match="help:"):
        MuxLimits(receive_window=8 * 2**20, connection_buffer=4 * 2**20)
    with pytest.raises(ConfigError, match="help:"):
        PeerOptions(buffer_budget=2**20)
    assert PeerOptions().buffer_budget >= PeerOptions().limits.connection_buffer
    with pytest.raises(ConfigError, match="help:"):
        PeerOptions(relay_limits=RelayLimits(peer_buffer=2**20))
    with pytest.raises(ConfigError, match="help:"):
        PeerOptions(relay_limits=RelayLimits(buffer_budget=2**27))

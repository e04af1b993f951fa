"""What a peer's connections hold of received bytes nobody has read yet, against budgets (pure).

Holds the peer-wide :class:`BufferLedger`, the per-connection :class:`ConnectionBuffers` (what
its streams cost, and which stream to shed when over budget) and the per-stream
:class:`StreamCharges`. It does not build frames or move streams between states
(``kit.p2p.mux`` resets the stream chosen here), nor read sockets (``kit.p2p.connection``).

Per-stream flow control (``kit.p2p.mux``) bounds one stream to one window of unread bytes, but a
remote may open ``max_inbound_streams`` streams and fill every window: 256 x 8 MiB = 2 GiB per
connection, times the number of connected peers, on a Colab volunteer with ~12 GB of RAM.

What others do, and why kit does not simply copy it:

* HTTP/2 (RFC 9113 §5.2, §6.9) adds a connection-level window. It bounds bytes *in flight*, not
  bytes *buffered*: a receiver that returned connection credit only when the application reads
  would let one unread stream block every other stream of the connection (head-of-line
  blocking, the deadlock §5.2.2 warns about), so implementations return connection credit as
  frames arrive, and the memory bound stays SETTINGS_MAX_CONCURRENT_STREAMS x the initial window.
* QUIC (RFC 9000 §4.1) ``MAX_DATA`` is the same connection window, with the same trade-off.
* yamux (rust-yamux 0.13, ``max_connection_receive_window``, 1 GiB by default) caps the sum of
  the windows it grants: stream windows start small (256 KiB) and grow only with bytes actually
  *read*. That needs per-stream window updates at open, a protocol change.
* libp2p's resource manager reserves memory in scopes (stream, connection, peer, system) and
  resets the stream whose reservation fails, instead of stalling the connection.

kit follows the last one: the reader keeps reading the socket (no head-of-line blocking, no
deadlock), every received chunk is charged to its connection and to the peer-wide
:class:`BufferLedger`, and when a connection holds more than ``MuxLimits.connection_buffer`` or
the peer more than ``PeerOptions.buffer_budget``, the stream holding the most unread bytes (of
that connection, or of the connection holding the most) is reset with code ``memory`` and its
bytes dropped. A stream the application reads holds little, so it is not the one reset; a
connection near its budget is refused new streams. No field was added to the handshake: older
peers see a RESET with an unknown code, which they already map to ``StreamReset``.

Each chunk is charged its payload plus :data:`CHUNK_COST` (the bytes Python spends on the frame's
buffer, views and queue entry, ~440 B measured), so a remote cannot buffer gigabytes of overhead
in empty or one-byte frames that windows do not count.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

#: Bytes charged per received chunk on top of its payload (bytearray, memoryviews, deque entry).
CHUNK_COST = 512

H = TypeVar("H", bound=Hashable)


class BufferLedger(Generic[H]):
    """Unread received bytes (with :data:`CHUNK_COST`) held by each connection of one peer.

    ``holder`` is whatever the driver names a connection by; the ledger only counts.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.total = 0
        self.peak = 0  # the highest total seen by ``settle`` (after shedding)
        self._held: dict[H, int] = {}

    def charge(self, holder: H, cost: int) -> None:
        self._held[holder] = self._held.get(holder, 0) + cost
        self.total += cost

    def release(self, holder: H, cost: int) -> None:
        held = self._held.get(holder, 0)
        assert cost <= held, f"releasing {cost} bytes of {held} held"
        if held == cost:
            self._held.pop(holder, None)
        else:
            self._held[holder] = held - cost
        self.total -= cost

    def forget(self, holder: H) -> None:
        """The holder is gone (its connection closed): its bytes are no longer ours to count."""
        self.total -= self._held.pop(holder, 0)

    def held(self, holder: H) -> int:
        return self._held.get(holder, 0)

    @property
    def excess(self) -> int:
        return max(0, self.total - self.budget)

    def heaviest(self) -> H | None:
        """The holder with the most bytes: the one that must shed when the peer is over budget."""
        if not self._held:
            return None
        return max(self._held, key=self._held.__getitem__)

    def settle(self) -> int:
        """Record the total once shedding is done (tests and logs read ``peak``); returns it."""
        self.peak = max(self.peak, self.total)
        return self.total


class StreamCharges:
    """What one stream's unread chunks cost here, and what choosing whom to shed reads of it."""

    __slots__ = ("awaited", "circuit", "cost", "since")

    def __init__(self) -> None:
        self.cost = 0  # what its unread chunks cost here: payloads + CHUNK_COST each
        self.since = 0  # the connection's clock when it was opened, last read, or last empty
        self.awaited = False  # the application is waiting to read it right now
        self.circuit = False  # a circuit this peer relays: charged to the relay's budgets


class ConnectionBuffers:
    """What the streams of one connection hold unread, charged to the connection and to the
    peer's ledger; relayed circuits (``kit.p2p.relay``) are charged apart, to ``circuit_budget``
    and the relay's ``circuit_ledger``. Chooses the stream to shed when over (``victim``).

    ``holder`` is what the ledgers name this connection by.
    """

    def __init__(self, ledger: BufferLedger[Hashable] | None, holder: Hashable) -> None:
        self.buffered = 0  # what the unread chunks of the non-circuit streams cost here
        self.circuit_buffered = 0
        self.circuit_peak = 0  # the most ``circuit_buffered`` held after shedding
        self.circuit_budget = 0
        self.circuit_ledger: BufferLedger[Hashable] | None = None
        self.ledger = ledger
        self.holder = holder
        self.clock = 0  # ticks at every read and every new stream, for choosing whom to shed

    def touch(self, stream: StreamCharges) -> None:
        """``stream`` was opened, read, or starts holding bytes: it is the newest now."""
        self.clock += 1
        stream.since = self.clock

    def charge(self, stream: StreamCharges, cost: int) -> None:
        stream.cost += cost
        if stream.circuit:
            self.circuit_buffered += cost
            ledger = self.circuit_ledger
        else:
            self.buffered += cost
            ledger = self.ledger
        if ledger is not None:
            ledger.charge(self.holder, cost)

    def release(self, stream: StreamCharges, cost: int) -> None:
        stream.cost -= cost
        if stream.circuit:
            self.circuit_buffered -= cost
            ledger = self.circuit_ledger
        else:
            self.buffered -= cost
            ledger = self.ledger
        if ledger is not None:
            ledger.release(self.holder, cost)

    def charge_to_circuits(
        self, stream: StreamCharges, ledger: BufferLedger[Hashable], budget: int
    ) -> None:
        """``stream`` is a circuit this peer relays: move what it holds, and all it will hold,
        to ``budget`` (for this connection) and ``ledger`` (the relay's)."""
        cost = stream.cost
        self.release(stream, cost)
        self.circuit_ledger, self.circuit_budget = ledger, budget
        stream.circuit = True
        self.charge(stream, cost)

    def release_all(self, streams: Iterable[StreamCharges]) -> None:
        """The connection is gone: nothing it received is ours to count any more."""
        self.buffered = self.circuit_buffered = 0
        for stream in streams:
            stream.cost = 0
        for ledger in (self.ledger, self.circuit_ledger):
            if ledger is not None:
                ledger.forget(self.holder)

    def victim(
        self, streams: Mapping[int, StreamCharges], local_parity: int, *, circuits: bool
    ) -> int | None:
        """The stream to shed: of those holding unread bytes (only relayed circuits if
        ``circuits``, else only the others: each kind is shed for its own budget), streams the
        remote opened go first (how many and what they hold is the remote's doing; our own are
        our application's), then streams nobody is waiting to read (a waiting reader takes its
        bytes as soon as the loop turns), then the most unread bytes, then the stream holding
        bytes unread for longest. None if no stream holds any."""
        victim_id, victim_key = None, (False, False, 0, 0)
        for stream_id, stream in streams.items():
            inbound = stream_id % 2 != local_parity
            key = (inbound, not stream.awaited, stream.cost, -stream.since)
            if stream.circuit is not circuits:
                continue
            if stream.cost and (victim_id is None or key > victim_key):
                victim_id, victim_key = stream_id, key
        return victim_id

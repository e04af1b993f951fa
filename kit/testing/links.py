"""Simulated Internet links for in-process peers: per-peer bandwidth and latency.

Holds :class:`LinkProfile` (one peer's access link) and :class:`SimulatedLinks` (the
``kit.p2p.memory_stream.LinkModel`` of a ``MemoryNetwork``: it gives each message the time the
access links would take, and counts messages and bytes per peer, sent and received, a relay's
included). Used under
``kit.testing.virtual_time``, simulated time is then what the links give, not what one CPU can
compute; under a real loop it slows a test down to those links.

The model (a fluid approximation of TCP flows over access links; the core of the Internet is
never the bottleneck, as in DeDLOC's and Moshpit's setups):

* each (sender, receiver) pair is a flow: its messages go out in order;
* a sender's uplink is shared fairly by its busy flows: a message gets ``upload / n`` where
  ``n`` counts the flows with bytes still going out when it starts (so a 100-byte header to a
  new peer is not stuck behind megabytes for another, as TCP flows are not); likewise at the
  receiver's downlink;
* its first byte reaches the receiver one latency later (``latency`` of both ends: the round
  trip of two peers with 12.5 ms each is 50 ms);
* a new connection costs two round trips (TCP, then the websocket upgrade and kit's handshake)
  before its first message;
* each message carries ``HEADER_BYTES`` of framing;
* relayed (a connection to a peer behind a symmetric NAT, ``kit.p2p.memory``): every message
  crosses the sender's uplink, the relay's downlink, the relay's uplink and the receiver's
  downlink, store and forward, with both hops' latencies; the relay is charged for what it
  receives and sends (``bytes_relayed`` too). A relayed connection costs two relayed round
  trips (the relay's CONNECT, then the handshake end to end);
* hole punched (a punchable peer, DCUtR-style TCP simultaneous open): one and a half relayed
  round trips of coordination (``PUNCH_MESSAGES`` small messages through the relay, charged to
  it), then a direct connection's two round trips; its bytes then go direct.

Not modelled: loss and retransmissions, TCP slow start, and the speed-up of a flow when others
end early (the share is fixed when a message starts: pessimistic, never faster than the link).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Hashable

from kit.errors import ConfigError
from kit.p2p.identity import PeerID

HEADER_BYTES = 40  # kit's frame header plus a share of TCP/IP headers, per message
PUNCH_MESSAGES = 3  # a hole punch's coordination through the relay: CONNECT, CONNECT, SYNC
PUNCH_MESSAGE_BYTES = 256  # one of them (the observed addresses it carries, and framing)
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One peer's access link."""

    upload: float = 100 * MBIT  # bytes per second it can send
    download: float = 100 * MBIT  # bytes per second it can receive
    latency: float = 0.0125  # one-way seconds from this peer to the Internet's core

    def __post_init__(self) -> None:
        if not (self.upload > 0 and self.download > 0 and self.latency >= 0):
            raise ConfigError(
                f"{self} - help: upload and download in bytes/s > 0, latency in seconds >= 0"
            )


class _SharedLink:
    """One direction of one peer's access link, shared by its flows (see the module)."""

    def __init__(self) -> None:
        self.free_at: dict[Hashable, float] = {}  # flow -> when its last message is through
        self.busy: set[Hashable] = set()
        self._ends: list[tuple[float, int, Hashable]] = []  # (end, tiebreak, flow), lazily pruned
        self._count = 0

    def reserve(self, flow: Hashable, size: int, now: float, rate: float) -> float:
        """When a message of ``size`` bytes entering at ``now`` is through this link."""
        while self._ends and self._ends[0][0] <= now:
            end, _, done = heapq.heappop(self._ends)
            if self.free_at.get(done) == end:
                self.busy.discard(done)
        start = max(now, self.free_at.get(flow, 0.0))
        sharing = len(self.busy) + (flow not in self.busy)
        end = start + size * sharing / rate
        self.free_at[flow] = end
        self.busy.add(flow)
        self._count += 1
        heapq.heappush(self._ends, (end, self._count, flow))
        return end


class SimulatedLinks:
    """Delivery times over per-peer access links (a ``MemoryNetwork``'s ``links``)."""

    def __init__(self, default: LinkProfile | None = None) -> None:
        self.default = default or LinkProfile()
        self._profiles: dict[PeerID, LinkProfile] = {}
        self._uplinks: collections.defaultdict[PeerID, _SharedLink] = collections.defaultdict(
            _SharedLink
        )
        self._downlinks: collections.defaultdict[PeerID, _SharedLink] = collections.defaultdict(
            _SharedLink
        )
        self.messages_sent: collections.Counter[PeerID] = collections.Counter()
        self.bytes_sent: collections.Counter[PeerID] = collections.Counter()
        self.bytes_received: collections.Counter[PeerID] = collections.Counter()
        self.bytes_relayed: collections.Counter[PeerID] = (
            collections.Counter()
        )  # received to forward

    def set_profile(self, peer_id: PeerID, profile: LinkProfile) -> None:
        self._profiles[peer_id] = profile

    def profile(self, peer_id: PeerID) -> LinkProfile:
        return self._profiles.get(peer_id, self.default)

    def round_trip(self, a: PeerID, b: PeerID) -> float:
        return 2 * (self.profile(a).latency + self.profile(b).latency)

    def relayed_round_trip(self, a: PeerID, relay: PeerID, b: PeerID) -> float:
        return self.round_trip(a, relay) + self.round_trip(relay, b)

    def transmit(
        self, sender: PeerID, receiver: PeerID, nbytes: int, now: float, via: PeerID | None = None
    ) -> tuple[float, float]:
        size = nbytes + HEADER_BYTES
        source, target = self.profile(sender), self.profile(receiver)
        sent_at = self._uplinks[sender].reserve(receiver, size, now, source.upload)
        if via is None:
            latency = source.latency + target.latency
            received = self._downlinks[receiver].reserve(
                sender, size, now + latency, target.download
            )
            received = max(received, sent_at + latency)
            self._count(sender, receiver, size)
            return sent_at, received
        relay, flow = self.profile(via), (sender, receiver)
        first, second = source.latency + relay.latency, relay.latency + target.latency
        at_relay = self._downlinks[via].reserve(flow, size, now + first, relay.download)
        at_relay = max(at_relay, sent_at + first)
        forwarded = self._uplinks[via].reserve(flow, size, at_relay, relay.upload)
        received = self._downlinks[receiver].reserve(
            sender, size, at_relay + second, target.download
        )
        received = max(received, forwarded + second)
        self._count(sender, receiver, size, via)
        return sent_at, received

    def _count(
        self, sender: PeerID, receiver: PeerID, size: int, via: PeerID | None = None
    ) -> None:
        self.messages_sent[sender] += 1
        self.bytes_sent[sender] += size
        if via is not None:
            self.bytes_received[via] += size
            self.bytes_relayed[via] += size
            self.messages_sent[via] += 1
            self.bytes_sent[via] += size
        self.bytes_received[receiver] += size

    def connect_delay(
        self, dialer: PeerID, target: PeerID, via: PeerID | None = None, punch: bool = False
    ) -> float:
        """Seconds before a new connection's first message (see the module), and the hole
        punch's coordination messages charged to the relay's counters."""
        if via is None:
            return 2 * self.round_trip(dialer, target)
        relayed = self.relayed_round_trip(dialer, via, target)
        if not punch:
            return 2 * relayed
        for i in range(PUNCH_MESSAGES):  # CONNECT out, CONNECT back, SYNC out
            a, b = (dialer, target) if i % 2 == 0 else (target, dialer)
            self._count(a, b, PUNCH_MESSAGE_BYTES, via)
        return 1.5 * relayed + 2 * self.round_trip(dialer, target)

    def total_bytes(self, peer_id: PeerID) -> int:
        """Bytes ``peer_id`` sent and received, relayed ones included."""
        return self.bytes_sent[peer_id] + self.bytes_received[peer_id]

    def reset_counters(self) -> None:
        self.messages_sent.clear()
        self.bytes_sent.clear()
        self.bytes_received.clear()
        self.bytes_relayed.clear()

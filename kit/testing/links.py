"""Simulated Internet links for in-process peers: per-peer bandwidth and latency.

Holds :class:`LinkProfile` (one peer's access link) and :class:`SimulatedLinks` (the
``kit.p2p.memory_stream.LinkModel`` of a ``MemoryNetwork``: it gives each message the time the
two access links would take, and counts messages and bytes per peer). Used under
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
* each message carries ``HEADER_BYTES`` of framing.

Not modelled: loss and retransmissions, TCP slow start, and the speed-up of a flow when others
end early (the share is fixed when a message starts: pessimistic, never faster than the link).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

from kit.errors import ConfigError
from kit.p2p.identity import PeerID

HEADER_BYTES = 40  # kit's frame header plus a share of TCP/IP headers, per message
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
        self.free_at: dict[PeerID, float] = {}  # flow -> when its last message is through
        self.busy: set[PeerID] = set()
        self._ends: list[tuple[float, int, PeerID]] = []  # (end, tiebreak, flow), lazily pruned
        self._count = 0

    def reserve(self, flow: PeerID, size: int, now: float, rate: float) -> float:
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

    def set_profile(self, peer_id: PeerID, profile: LinkProfile) -> None:
        self._profiles[peer_id] = profile

    def profile(self, peer_id: PeerID) -> LinkProfile:
        return self._profiles.get(peer_id, self.default)

    def round_trip(self, a: PeerID, b: PeerID) -> float:
        return 2 * (self.profile(a).latency + self.profile(b).latency)

    def transmit(
        self, sender: PeerID, receiver: PeerID, nbytes: int, now: float
    ) -> tuple[float, float]:
        size = nbytes + HEADER_BYTES
        source, target = self.profile(sender), self.profile(receiver)
        latency = source.latency + target.latency
        sent_at = self._uplinks[sender].reserve(receiver, size, now, source.upload)
        received = self._downlinks[receiver].reserve(sender, size, now + latency, target.download)
        received = max(received, sent_at + latency)
        self.messages_sent[sender] += 1
        self.bytes_sent[sender] += size
        self.bytes_received[receiver] += size
        return sent_at, received

    def connect_delay(self, dialer: PeerID, target: PeerID) -> float:
        return 2 * self.round_trip(dialer, target)

    def reset_counters(self) -> None:
        self.messages_sent.clear()
        self.bytes_sent.clear()
        self.bytes_received.clear()

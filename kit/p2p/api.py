"""What the rooms above p2p (dht, averaging, optim) may use of a peer: two small protocols.

``kit.p2p.peer.Peer`` (websockets) and ``kit.p2p.memory.MemoryPeer`` (in-process, for tests and
dry runs) both implement :class:`PeerAPI`, so the DHT and the averaging code are written once
and tested on either.

Streams are message-oriented: every ``send_message`` arrives as one ``receive_message`` on the
other side, in order. Large payloads (tensor parts) are sent as several messages; each message is
at most the receiver's ``max_size``. Flow control is per stream: ``send_message`` waits while the
receiver has not consumed what it already got, so a slow receiver bounds the sender's memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from kit.p2p.identity import PeerID

#: Default upper bound for one received message (bytes). Raise it for protocols that need more.
DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024


class StreamAPI(Protocol):
    """One logical bidirectional stream of messages between two peers."""

    remote_peer: PeerID
    protocol: str

    async def send_message(self, data: bytes | memoryview, *, timeout: float | None = None) -> None:
        """Send one message; waits for flow-control credit (at most ``timeout`` seconds)."""
        ...

    async def receive_message(
        self, *, max_size: int = DEFAULT_MAX_MESSAGE, timeout: float | None = None
    ) -> bytes | None:
        """The next message, or ``None`` once the remote side has closed its half of the stream.

        Raises:
            FrameTooLarge: the message is larger than ``max_size`` (the stream is reset).
            KitTimeout: nothing arrived within ``timeout``.
            StreamReset / ConnectionLost / RemoteError: the remote side failed.
        """
        ...

    async def close(self) -> None:
        """Half-close: this side will send no more; receiving goes on until the remote closes."""
        ...

    def reset(self, code: str = "cancelled", message: str = "") -> None:
        """Abandon the stream in both directions; the remote side gets ``StreamReset``."""
        ...


UnaryHandler = Callable[[PeerID, bytes], Awaitable[bytes]]
StreamHandler = Callable[[StreamAPI], Awaitable[None]]


class PeerAPI(Protocol):
    """A running peer as the DHT and the averaging code see it."""

    peer_id: PeerID

    @property
    def client_mode(self) -> bool:
        """True if this peer has no listening socket (behind a NAT: it dials out, and others
        reach it at relayed addresses, or directly after a hole punch: see ``can_accept``)."""
        ...

    @property
    def can_accept(self) -> bool:
        """True if others can open connections to this peer and exchange bytes with it directly:
        it listens (public), or it is in client mode behind a NAT it can punch through (a
        relayed connection is upgraded to a direct one, kit.p2p hole punching).

        The averaging code lets only such peers lead a group and aggregate a part: every other
        member opens a stream to each aggregator, and through a relay those bytes would load
        the relay (a public peer) as much as the aggregator itself.
        """
        ...

    def get_visible_addresses(self) -> list[str]:
        """Addresses others can dial to reach this peer (direct or relayed)."""
        ...

    def add_address(self, peer_id: PeerID, address: str) -> None:
        """Remember an address of another peer (learned from the DHT, for example)."""
        ...

    def add_unary_handler(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = ...
    ) -> None:
        """Serve request/response calls of ``protocol``: ``handler(caller, request) -> response``."""
        ...

    def add_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve streams of ``protocol``; the handler owns the stream until it returns."""
        ...

    def remove_handler(self, protocol: str) -> None:
        """Stop serving ``protocol`` (unary or streams): its new streams are reset as an unknown
        protocol, and it may be served again. Streams already being served run on."""
        ...

    async def call(
        self,
        peer_id: PeerID,
        protocol: str,
        request: bytes,
        *,
        timeout: float,
        max_response: int = ...,
    ) -> bytes:
        """One request/response exchange with ``peer_id`` (dialing it first if needed)."""
        ...

    async def open_stream(self, peer_id: PeerID, protocol: str, *, timeout: float) -> StreamAPI:
        """Open a stream of ``protocol`` to ``peer_id`` (dialing it first if needed)."""
        ...

    async def connect(self, address: str, *, timeout: float) -> PeerID:
        """Dial ``address`` (if not connected yet) and return the PeerID that answered there."""
        ...

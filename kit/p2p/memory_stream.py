"""In-memory streams: the two bounded message pipes of one stream between two ``MemoryPeer``.

A :class:`MemoryStream` is one end of a stream of :mod:`kit.p2p.memory`'s in-process network
(it implements ``StreamAPI``): two :class:`MessagePipe`, one per direction, each a bounded queue
of messages with end-of-stream and error state. What the pipes emulate, because code above p2p
depends on it:

* flow control: ``send_message`` waits while the receiver's queue (plus what is in flight) is
  full: the stream's window, in messages;
* delivery times: with a :class:`LinkModel` (``kit.testing.links.SimulatedLinks``) a message
  is in flight until the time the sender's uplink, the receiver's downlink and their latency
  give it (and, on a relayed connection, the relay's links both ways), and end-of-stream
  follows the last message;
* failures: a reset or a broken peer fails both directions at once, and every wait ends with
  ``KitTimeout`` after the given timeout.

Separate from ``memory`` (the network, its peers, dialing and faults) because it is the data
path of one stream and knows nothing of peers: the same split as ``stream`` and ``peer`` of the
websocket side.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Protocol

from kit.errors import FrameTooLarge, KitTimeout, LocalProtocolError, StreamReset
from kit.p2p.api import DEFAULT_MAX_MESSAGE
from kit.p2p.identity import PeerID


def deadline_in(timeout: float | None) -> float | None:
    """The loop time ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (never negative; None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


class LinkModel(Protocol):
    """When what one in-memory peer sends another gets there (see ``kit.testing.links``)."""

    def transmit(
        self, sender: PeerID, receiver: PeerID, nbytes: int, now: float, via: PeerID | None = None
    ) -> tuple[float, float]:
        """(loop time the sender's uplink is done with the message, loop time it arrives);
        ``via``: the relay that carries it (it receives and sends every byte)."""

    def connect_delay(
        self, dialer: PeerID, target: PeerID, via: PeerID | None = None, punch: bool = False
    ) -> float:
        """Seconds a new connection takes before its first message (handshakes): direct, or
        through the relay ``via``, or (``punch``) coordinated through ``via``, then direct."""


class MessagePipe:
    """One direction of a stream: a bounded queue of messages plus end-of-stream / error state.

    With a link model, a message is in flight until its delivery time (counted in the window,
    as bytes in a TCP window are), and end-of-stream arrives after the last message.
    """

    def __init__(
        self,
        window: int,
        links: LinkModel | None = None,
        route: tuple[PeerID, PeerID] | None = None,
        via: PeerID | None = None,
    ) -> None:
        self._items: collections.deque[bytes] = collections.deque()
        self._window = window
        self._links, self._route, self._via = links, route, via
        self._in_flight = 0
        self._closing = False
        self._closed = False
        self._error: BaseException | None = None
        # One future per waiter, registered before awaiting, so no wake-up can be lost between
        # a reader and a writer (an Event cleared by one side could hide the other's signal).
        self._waiters: list[asyncio.Future[None]] = []

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, ready: Callable[[], bool], deadline: float | None, what: str) -> None:
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, time_left(deadline))
            except asyncio.TimeoutError:
                raise KitTimeout(f"{what} timed out") from None

    async def put(self, data: bytes, deadline: float | None) -> None:
        if self._closed or self._closing:
            raise LocalProtocolError("send_message after close() on this stream")
        await self._wait(
            lambda: self._error is not None or len(self._items) + self._in_flight < self._window,
            deadline,
            "send_message (the receiver is not reading)",
        )
        if self._error is not None:
            raise self._error
        if self._links is None or self._route is None:
            self._items.append(data)
            self._notify()
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        sent_at, arrives_at = self._links.transmit(*self._route, len(data), now, self._via)
        self._in_flight += 1
        loop.call_at(arrives_at, self._arrive, data)
        if sent_at > now:  # the sender's uplink is busy with it (a full socket buffer)
            await asyncio.sleep(sent_at - now)

    def _arrive(self, data: bytes) -> None:
        self._in_flight -= 1
        if self._error is None:
            self._items.append(data)
            if self._closing and not self._in_flight:
                self._closed = True
        self._notify()

    async def get(self, deadline: float | None) -> bytes | None:
        await self._wait(
            lambda: self._error is not None or bool(self._items) or self._closed,
            deadline,
            "receive_message",
        )
        if self._error is not None:
            raise self._error
        if self._items:
            self._notify()  # wakes a sender waiting for room
            return self._items.popleft()
        return None

    def close(self) -> None:
        if self._in_flight:
            self._closing = True  # end-of-stream follows the messages still on the wire
        else:
            self._closed = True
        self._notify()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._items.clear()
        self._notify()


class MemoryStream:
    """One end of an in-memory stream (implements ``StreamAPI``)."""

    def __init__(
        self, remote_peer: PeerID, protocol: str, inbound: MessagePipe, outbound: MessagePipe
    ) -> None:
        self.remote_peer = remote_peer
        self.protocol = protocol
        self._inbound = inbound
        self._outbound = outbound

    async def send_message(self, data: bytes | memoryview, *, timeout: float | None = None) -> None:
        await self._outbound.put(bytes(data), deadline_in(timeout))

    async def receive_message(
        self, *, max_size: int = DEFAULT_MAX_MESSAGE, timeout: float | None = None
    ) -> bytes | None:
        message = await self._inbound.get(deadline_in(timeout))
        if message is not None and len(message) > max_size:
            self.reset("too_large", f"message of {len(message)} bytes > max_size {max_size}")
            raise FrameTooLarge(f"stream message of {len(message)} bytes > max_size {max_size}")
        return message

    async def close(self) -> None:
        self._outbound.close()

    def reset(self, code: str = "cancelled", message: str = "") -> None:
        self._outbound.fail(StreamReset(code, message))
        self._inbound.fail(StreamReset(code, message))

    def fail(self, error: BaseException) -> None:
        """Break both directions with ``error`` (its peer shut down, or its handler failed)."""
        self._outbound.fail(error)
        self._inbound.fail(error)

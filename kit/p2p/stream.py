"""One stream of messages on a connection (asyncio), and what a message is.

:class:`Stream` implements :class:`kit.p2p.api.StreamAPI` on a
:class:`~kit.p2p.connection.Connection`: it queues the chunks the connection's reader task
delivers, hands them out as messages, waits for flow-control credit before sending, and asks the
connection to send its frames (the connection's writer task owns the channel, so cancelling a
``send_message`` never cuts a frame in half). :data:`Message` (one or more byte strings sent as
one) and :func:`wait_bounded` (every p2p wait has a timeout) are shared with the channels.

It does not parse frames, count streams or budgets (``kit.p2p.mux``), nor run tasks or own a
channel (``kit.p2p.connection``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from kit.errors import (
    FrameTooLarge,
    KitTimeout,
    RemoteError,
    RemoteProtocolError,
    StreamReset,
    UnknownProtocol,
)
from kit.p2p.api import DEFAULT_MAX_MESSAGE
from kit.p2p.identity import PeerID
from kit.p2p.mux import DataReceived, Mux
from kit.p2p.wire import ResetCode

T = TypeVar("T")


#: One message as one or more byte strings sent back to back (a frame header and its payload),
#: so that channels that must copy anyway (masking, relaying) copy once, and others not at all.
Message = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def message_parts(message: Message) -> Sequence[bytes | bytearray | memoryview]:
    if isinstance(message, (bytes, bytearray, memoryview)):
        return (message,)
    return message


def message_bytes(message: Message) -> bytes:
    parts = message_parts(message)
    return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)


#: ``asyncio.timeout`` (Python 3.11+): a deadline on the waiting task itself, where
#: ``asyncio.wait_for`` wraps what it awaits in a task of its own (one per chunk a stream reads).
_DEADLINE = getattr(asyncio, "timeout", None)


async def wait_bounded(awaitable: Awaitable[T], timeout: float | None, what: str) -> T:
    """``await`` with an optional timeout that raises KitTimeout naming what was awaited."""
    if timeout is None:
        return await awaitable
    try:
        if _DEADLINE is not None:
            async with _DEADLINE(timeout):
                return await awaitable
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise KitTimeout(f"{what}: no progress within {timeout:.3g} s") from None


def reset_error(code: str, message: str) -> Exception:
    """The typed error the opener of a stream sees when the remote side resets it."""
    if code == ResetCode.UNKNOWN_PROTOCOL.value:
        return UnknownProtocol(code, message)
    if code == ResetCode.HANDLER_ERROR.value:
        return RemoteError(code, message)
    return StreamReset(code, message)


class StreamCarrier(Protocol):
    """What a :class:`Stream` needs of its connection (``kit.p2p.connection.Connection``)."""

    remote_peer: PeerID
    mux: Mux

    @property
    def closed(self) -> bool: ...

    def enqueue(self, frame: Message) -> None: ...

    def send_control(self, frame: Message) -> None: ...

    def consumed(self, stream_id: int, size: int) -> None: ...

    def forget_if_done(self, stream: Stream) -> None: ...


class Stream:
    """One logical stream of messages; implements :class:`kit.p2p.api.StreamAPI`."""

    def __init__(self, connection: StreamCarrier, stream_id: int, protocol: str) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.protocol = protocol
        self.remote_peer: PeerID = connection.remote_peer
        self._chunks: collections.deque[tuple[memoryview, bool]] = collections.deque()
        self._data_ready = asyncio.Event()
        self._credit_ready = asyncio.Event()
        self._remote_closed = False
        self._error: Exception | None = None

    # --- receiving -----------------------------------------------------------------------

    async def receive_message(
        self, *, max_size: int = DEFAULT_MAX_MESSAGE, timeout: float | None = None
    ) -> bytes | None:
        parts = await self.receive_message_parts(max_size=max_size, timeout=timeout)
        if parts is None:
            return None
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    async def receive_message_parts(
        self, *, max_size: int = DEFAULT_MAX_MESSAGE, timeout: float | None = None
    ) -> list[memoryview] | None:
        """The next message as the frame payloads it arrived in (no joining copy), or None."""
        parts: list[memoryview] = []
        size = 0
        while True:
            chunk, end_message = await self._next_chunk(timeout)
            if chunk is None:
                if parts:
                    raise self._fail_remote("stream ended in the middle of a message")
                return None
            size += len(chunk)
            if size > max_size:
                self.reset(ResetCode.TOO_LARGE, f"message larger than {max_size} bytes")
                raise FrameTooLarge(f"{self.protocol}: message larger than {max_size} bytes")
            parts.append(chunk)
            if end_message:
                return parts

    async def receive_message_into(
        self, buffer: memoryview, *, timeout: float | None = None
    ) -> int | None:
        """Receive one message straight into ``buffer`` (no intermediate copy); returns its size.

        Returns ``None`` if the remote side closed the stream instead. A message longer than
        ``buffer`` resets the stream and raises FrameTooLarge.
        """
        offset = 0
        while True:
            chunk, end_message = await self._next_chunk(timeout)
            if chunk is None:
                if offset:
                    raise self._fail_remote("stream ended in the middle of a message")
                return None
            if offset + len(chunk) > len(buffer):
                self.reset(ResetCode.TOO_LARGE, f"message larger than {len(buffer)} bytes")
                raise FrameTooLarge(
                    f"{self.protocol}: message larger than the {len(buffer)} bytes expected"
                )
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
            if end_message:
                return offset

    def _fail_remote(self, message: str) -> RemoteProtocolError:
        self.reset(ResetCode.PROTOCOL, message)
        return RemoteProtocolError(f"{self.protocol}: {message}")

    async def _next_chunk(self, timeout: float | None) -> tuple[memoryview | None, bool]:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._remote_closed:
                return None, True
            self._data_ready.clear()
            mux = self.connection.mux
            mux.awaiting(self.stream_id, True)  # a reader is waiting: not the stream to shed
            try:
                await wait_bounded(
                    self._data_ready.wait(), timeout, f"receiving on {self.protocol}"
                )
            finally:
                mux.awaiting(self.stream_id, False)
        chunk, end_message = self._chunks.popleft()
        self.connection.consumed(self.stream_id, len(chunk))
        return chunk, end_message

    # --- sending -------------------------------------------------------------------------

    async def send_message(self, data: Message, *, timeout: float | None = None) -> None:
        """Send one message (bytes-like, or a sequence of parts sent as one message, uncopied)."""
        mux = self.connection.mux
        parts = [memoryview(part).cast("B") for part in message_parts(data)]
        size = sum(len(part) for part in parts)
        if len(parts) > 1 and size <= mux.send_frame_size:
            # A small multi-part message (a relayed frame) goes out as one frame.
            await self._wait_credit(size, timeout)
            self.connection.enqueue(mux.data_frame(self.stream_id, tuple(parts), end_message=True))
            return
        sent = 0
        while True:
            credit = await self._wait_credit(1 if sent < size else 0, timeout)
            count = min(size - sent, credit, mux.send_frame_size)
            frame = _take(parts, count)
            sent += count
            last = sent == size
            self.connection.enqueue(
                mux.data_frame(
                    self.stream_id, frame[0] if len(frame) == 1 else frame, end_message=last
                )
            )
            if last:
                return

    async def _wait_credit(self, needed: int, timeout: float | None) -> int:
        """Wait until the remote granted at least ``needed`` bytes; return the credit."""
        mux = self.connection.mux
        while True:
            if self._error is not None:
                raise self._error
            credit = mux.send_credit(self.stream_id)
            if credit >= needed:
                return credit
            self._credit_ready.clear()
            await wait_bounded(self._credit_ready.wait(), timeout, f"sending on {self.protocol}")

    async def close(self) -> None:
        """Half-close. On a connection that is already gone this does nothing (sends raised)."""
        if self.connection.closed:
            return
        frame = self.connection.mux.close_frame(self.stream_id)
        if frame is not None:
            self.connection.send_control(frame)
        self.connection.forget_if_done(self)

    def reset(self, code: str | ResetCode = ResetCode.CANCELLED, message: str = "") -> None:
        """Abandon the stream; never raises (safe in cleanup paths)."""
        code = ResetCode(code) if not isinstance(code, ResetCode) else code
        self.fail(StreamReset(code.value, f"reset locally: {message}"))
        if self.connection.closed:
            return
        frame = self.connection.mux.reset_frame(self.stream_id, code, message)
        if frame is not None:
            self.connection.send_control(frame)
        self.connection.forget_if_done(self)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.reset(ResetCode.CANCELLED, type(exc).__name__)
        else:
            await self.close()

    # --- fed by the connection -------------------------------------------------------------

    def deliver(self, event: DataReceived) -> None:
        """Queue a received chunk (and note the end of the remote half)."""
        if event.data or event.end_message:
            self._chunks.append((event.data, event.end_message))
        if event.end_stream:
            self._remote_closed = True
        self._data_ready.set()

    def shed(self, error: Exception) -> None:
        """Reset for memory: drop what was buffered, so that the memory is free at once."""
        self._chunks.clear()
        self.fail(error)

    def credit_arrived(self) -> None:
        """The remote returned credit: a sender waiting for it may go on."""
        self._credit_ready.set()

    def fail(self, error: Exception) -> None:
        """Every wait on this stream raises ``error`` from now on (the first error wins)."""
        if self._error is None:
            self._error = error
        self._data_ready.set()
        self._credit_ready.set()

    def __repr__(self) -> str:
        return f"<Stream {self.stream_id} {self.protocol} with {self.remote_peer.short()}>"


def _take(parts: list[memoryview], count: int) -> tuple[memoryview, ...]:
    """The next ``count`` bytes of ``parts`` as views (consumed from ``parts``: no copy)."""
    taken: list[memoryview] = []
    while count or not taken:
        if not parts:
            return (memoryview(b""),) if not taken else tuple(taken)
        head = parts[0]
        if len(head) <= count:
            taken.append(parts.pop(0))
            count -= len(head)
            if not count:
                break
        else:
            taken.append(head[:count])
            parts[0] = head[count:]
            break
    return tuple(taken)


StreamHandler = Callable[[Stream], Awaitable[None]]

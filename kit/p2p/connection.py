"""The asyncio driver of one established connection: streams, a reader task and a writer task.

A :class:`Connection` runs the pure :class:`~kit.p2p.mux.Mux` over a :class:`Channel` (a websocket,
or a stream relayed through another peer) and turns its events into :class:`Stream` objects.

* One reader task parses frames and feeds streams; a peer that breaks the protocol gets a GOAWAY
  with the reason and is disconnected, and every stream on it fails with a typed error.
* One writer task sends queued frames in order. Streams never call the channel directly, so
  cancelling a stream's ``send_message`` (a timeout) can never cut a websocket frame in half.
  The queue is bounded by flow control: a stream only enqueues data it has credit for.
* Inbound streams are served by handler tasks that the connection owns and cancels on close.
* The reader never stops reading for memory (that would starve the streams the application does
  read): a stream that holds too many unread bytes is reset instead (``kit.p2p.budget``), on this
  connection or, when the peer-wide ledger is over budget, on the connection holding the most.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from kit.errors import (
    ConnectionLost,
    FrameTooLarge,
    KitTimeout,
    LocalProtocolError,
    PeerUnavailable,
    RemoteError,
    RemoteProtocolError,
    StreamReset,
    UnknownProtocol,
)
from kit.p2p import wire
from kit.p2p.api import DEFAULT_MAX_MESSAGE
from kit.p2p.budget import BufferLedger
from kit.p2p.handshake import RemoteHello
from kit.p2p.identity import PeerID
from kit.p2p.mux import (
    CreditReceived,
    DataReceived,
    GoAway,
    Mux,
    MuxLimits,
    SendFrame,
    StreamOpened,
    StreamResetByPeer,
    StreamShed,
    StreamState,
)
from kit.p2p.wire import FrameType, Refusal, ResetCode

logger = logging.getLogger(__name__)
MEMORY_RESET = (
    "reset locally for memory: the stream held the most unread bytes when this peer was over "
    "its budget. help: read streams as data comes, or raise MuxLimits.connection_buffer / "
    "PeerOptions.buffer_budget"
)
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


class Channel(Protocol):
    """An ordered, message-preserving, bidirectional channel: a websocket or a relayed stream."""

    remote_address: str

    async def send(self, data: Message) -> None:
        """Send one message. Raises ConnectionLost when the channel is gone."""
        ...

    async def recv(self) -> bytes:
        """The next message. Raises ConnectionLost when the channel is gone."""
        ...

    async def close(self) -> None:
        """Close (bounded in time); never raises."""
        ...


async def wait_bounded(awaitable: Awaitable[T], timeout: float | None, what: str) -> T:
    """``await`` with an optional timeout that raises KitTimeout naming what was awaited."""
    if timeout is None:
        return await awaitable
    try:
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


class Stream:
    """One logical stream of messages; implements :class:`kit.p2p.api.StreamAPI`."""

    def __init__(self, connection: Connection, stream_id: int, protocol: str) -> None:
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
        self.connection._consumed(self.stream_id, len(chunk))
        return chunk, end_message

    # --- sending -------------------------------------------------------------------------

    async def send_message(self, data: Message, *, timeout: float | None = None) -> None:
        """Send one message (bytes-like, or a sequence of parts sent as one message)."""
        mux = self.connection.mux
        parts = message_parts(data)
        if len(parts) > 1:
            size = sum(len(part) for part in parts)
            if size > mux.send_frame_size:
                return await self.send_message(b"".join(parts), timeout=timeout)
            # A small multi-part message (a relayed frame) goes out as one frame, uncopied.
            while mux.send_credit(self.stream_id) < size:
                if self._error is not None:
                    raise self._error
                self._credit_ready.clear()
                await wait_bounded(
                    self._credit_ready.wait(), timeout, f"sending on {self.protocol}"
                )
            if self._error is not None:
                raise self._error
            views = tuple(memoryview(part).cast("B") for part in parts)
            self.connection._enqueue(mux.data_frame(self.stream_id, views, end_message=True))
            return
        view = memoryview(parts[0]).cast("B")
        offset = 0
        while True:
            if self._error is not None:
                raise self._error
            credit = mux.send_credit(self.stream_id)
            if credit == 0 and offset < len(view):
                self._credit_ready.clear()
                await wait_bounded(
                    self._credit_ready.wait(), timeout, f"sending on {self.protocol}"
                )
                continue
            end = min(len(view), offset + credit, offset + mux.send_frame_size)
            last = end == len(view)
            self.connection._enqueue(
                mux.data_frame(self.stream_id, view[offset:end], end_message=last)
            )
            offset = end
            if last:
                return

    async def close(self) -> None:
        """Half-close. On a connection that is already gone this does nothing (sends raised)."""
        if self.connection.closed:
            return
        frame = self.connection.mux.close_frame(self.stream_id)
        if frame is not None:
            self.connection._enqueue(frame)
        self.connection._maybe_forget(self)

    def reset(self, code: str | ResetCode = ResetCode.CANCELLED, message: str = "") -> None:
        """Abandon the stream; never raises (safe in cleanup paths)."""
        code = ResetCode(code) if not isinstance(code, ResetCode) else code
        self._set_error(StreamReset(code.value, f"reset locally: {message}"))
        if self.connection.closed:
            return
        frame = self.connection.mux.reset_frame(self.stream_id, code, message)
        if frame is not None:
            self.connection._enqueue(frame)
        self.connection._maybe_forget(self)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.reset(ResetCode.CANCELLED, type(exc).__name__)
        else:
            await self.close()

    # --- fed by the connection -------------------------------------------------------------

    def _deliver(self, event: DataReceived) -> None:
        if event.data or event.end_message:
            self._chunks.append((event.data, event.end_message))
        if event.end_stream:
            self._remote_closed = True
        self._data_ready.set()

    def _shed(self, error: Exception) -> None:
        """Reset for memory: drop what was buffered, so that the memory is free at once."""
        self._chunks.clear()
        self._set_error(error)

    def _set_error(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._data_ready.set()
        self._credit_ready.set()

    def __repr__(self) -> str:
        return f"<Stream {self.stream_id} {self.protocol} with {self.remote_peer.short()}>"


StreamHandler = Callable[[Stream], Awaitable[None]]


class Connection:
    """One authenticated connection to a remote peer, carrying multiplexed streams."""

    def __init__(
        self,
        channel: Channel,
        remote: RemoteHello,
        *,
        is_dialer: bool,
        limits: MuxLimits,
        on_stream: Callable[[Stream], Awaitable[None]],
        on_closed: Callable[[Connection], None],
        ledger: BufferLedger[Connection] | None = None,
    ) -> None:
        self.channel = channel
        self.remote = remote
        self.remote_peer = remote.peer_id
        self.is_dialer = is_dialer
        self.mux = Mux(
            is_dialer=is_dialer,
            limits=limits,
            remote_window=remote.receive_window,
            remote_max_frame=remote.max_frame,
            ledger=ledger,  # type: ignore[arg-type]  # holders are Connections
            holder=self,
        )
        self._ledger = ledger
        self._on_stream = on_stream
        self._on_closed = on_closed
        self._streams: dict[int, Stream] = {}
        self._outbox: collections.deque[Message] = collections.deque()
        self._outbox_ready = asyncio.Event()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._handler_by_stream: dict[int, asyncio.Task[None]] = {}
        self._closed = False
        self._close_reason: Exception | None = None
        self._draining = False
        self.last_activity = (
            asyncio.get_running_loop().time()
        )  # the one clock read, for idle pruning
        self._reader = asyncio.ensure_future(self._read_loop())
        self._writer = asyncio.ensure_future(self._write_loop())

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def draining(self) -> bool:
        return self._draining

    async def open_stream(self, protocol: str) -> Stream:
        if self._closed or self._draining:
            raise ConnectionLost(f"connection to {self.remote_peer.short()} is closing")
        self.last_activity = asyncio.get_running_loop().time()
        stream_id, frame = self.mux.open_stream(protocol)
        stream = Stream(self, stream_id, protocol)
        self._streams[stream_id] = stream
        self._enqueue(frame)
        return stream

    def close_when_idle(self) -> None:
        """Open no new streams; close once the current ones have finished."""
        self._draining = True
        if not self._streams:
            self.close(Refusal.DUPLICATE, "a newer connection to this peer replaced this one")

    def close(
        self, reason: Refusal = Refusal.SHUTDOWN, message: str = "peer shutting down"
    ) -> None:
        """Send GOAWAY, fail every stream with ConnectionLost and stop the tasks (non-blocking)."""
        if self._closed:
            return
        self._outbox.append(
            wire.encode_control(FrameType.GOAWAY, 0, {"code": reason.value, "message": message})
        )
        self._outbox_ready.set()
        self._shutdown(
            ConnectionLost(
                f"connection to {self.remote_peer.short()} closed ({reason.value}): {message}"
            )
        )

    async def wait_closed(self, timeout: float | None = 5.0) -> None:
        tasks = [self._reader, self._writer, *self._handler_tasks]
        await asyncio.wait(tasks, timeout=timeout)

    # --- internals -----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """True when no stream is open on this connection."""
        return not self._streams and not self._handler_tasks

    def _enqueue(self, frame: Message) -> None:
        if self._closed:
            raise self._close_reason or ConnectionLost("connection closed")
        self._outbox.append(frame)
        self._outbox_ready.set()

    def _consumed(self, stream_id: int, size: int) -> None:
        frame = self.mux.consumed(stream_id, size)
        if frame is not None and not self._closed:
            self._enqueue(frame)

    def _maybe_forget(self, stream: Stream) -> None:
        if self.mux.state(stream.stream_id) in (StreamState.CLOSED, StreamState.RESET):
            self._streams.pop(stream.stream_id, None)
            if self._draining and not self._streams:
                self.close(Refusal.DUPLICATE, "a newer connection to this peer replaced this one")

    def _shutdown(self, reason: Exception) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        self.mux.release_all()
        for stream in list(self._streams.values()):
            stream._set_error(reason)
        self._streams.clear()
        for task in self._handler_tasks:
            task.cancel()
        self._reader.cancel()
        # The writer flushes the GOAWAY (if any), then closes the channel.
        self._outbox_ready.set()
        self._on_closed(self)

    async def _write_loop(self) -> None:
        try:
            while True:
                while self._outbox:
                    frame = self._outbox.popleft()
                    await self.channel.send(frame)
                if self._closed:
                    break
                self._outbox_ready.clear()
                await self._outbox_ready.wait()
        except ConnectionLost as e:
            self._shutdown(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # pragma: no cover - a bug; fail loudly in the logs, not silently
            logger.exception("writer of connection to %s failed", self.remote_peer.short())
            self._shutdown(LocalProtocolError(f"writer failed: {e!r}"))
        finally:
            await self.channel.close()

    async def _read_loop(self) -> None:
        max_frame = self.mux.limits.max_frame
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self.channel.recv()
                self.last_activity = loop.time()
                frame = wire.decode_frame(data, max_frame)
                for event in self.mux.receive(frame):
                    self._dispatch(event)
                if self._ledger is not None and frame.type is FrameType.DATA:
                    self._shed_for_peer(self._ledger)
                    if self.mux.circuit_ledger is not None:  # this peer relays circuits here
                        self._shed_for_peer(self.mux.circuit_ledger, circuits=True)
        except RemoteProtocolError as e:
            logger.warning("dropping %s: %s", self.remote_peer.short(), e)
            reason = Refusal.TOO_MANY_STREAMS if "beyond the limit" in str(e) else Refusal.PROTOCOL
            self.close(reason, str(e))
        except PeerUnavailable as e:
            self._shutdown(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # pragma: no cover - a bug
            logger.exception("reader of connection to %s failed", self.remote_peer.short())
            self._shutdown(LocalProtocolError(f"reader failed: {e!r}"))

    def _shed_for_peer(self, ledger: BufferLedger[Any], circuits: bool = False) -> None:
        """Over the peer-wide budget (or the relay's, for ``circuits``): the connection holding
        the most resets its largest stream, until under budget (each round frees a chunk)."""
        while ledger.excess and (heaviest := ledger.heaviest()) is not None:
            why = f"the peer held {ledger.total} of its {ledger.budget}, this connection the most"
            shed = heaviest.mux.shed(why, circuits=circuits)
            if shed is None:
                break
            heaviest._dispatch(shed)
        ledger.settle()

    def _log_shed(self, event: StreamShed, stream: Stream | None) -> None:
        # An attacker can cause many of these: warn at the 1st, 2nd, 4th, 8th ... of a connection.
        count = self.mux.shed_count
        level = logging.WARNING if count & (count - 1) == 0 else logging.DEBUG
        logger.log(
            level,
            "reset stream %d (%s) of %s for memory: %d bytes unread (%d resets on this "
            "connection). help: if this peer is honest and you see this often, raise "
            "MuxLimits.connection_buffer / PeerOptions.buffer_budget",
            event.stream_id,
            stream.protocol if stream is not None else "?",
            self.remote_peer.short(),
            event.unread,
            count,
        )

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._handler_tasks.discard(task)
        for stream_id, owned in list(self._handler_by_stream.items()):
            if owned is task:
                del self._handler_by_stream[stream_id]
        if not task.cancelled() and task.exception() is not None:
            logger.debug("stream handler ended with %r", task.exception())

    def _dispatch(self, event: object) -> None:
        if isinstance(event, DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._deliver(event)
                self._maybe_forget(stream)
        elif isinstance(event, CreditReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._credit_ready.set()
        elif isinstance(event, StreamOpened):
            stream = Stream(self, event.stream_id, event.protocol)
            self._streams[event.stream_id] = stream
            task = asyncio.ensure_future(self._on_stream(stream))
            self._handler_tasks.add(task)
            self._handler_by_stream[event.stream_id] = task
            task.add_done_callback(self._handler_done)
        elif isinstance(event, StreamResetByPeer):
            stream = self._streams.pop(event.stream_id, None)
            if stream is not None:
                stream._set_error(reset_error(event.code, event.message))
            handler = self._handler_by_stream.pop(event.stream_id, None)
            if handler is not None:
                handler.cancel()  # the opener gave up: stop working for it
        elif isinstance(event, StreamShed):
            self._enqueue(event.frame)
            stream = self._streams.get(event.stream_id)
            self._log_shed(event, stream)
            handler = self._handler_by_stream.pop(event.stream_id, None)
            if handler is not None:
                handler.cancel()  # its stream is gone: nothing it does can reach the opener
            if stream is not None:
                stream._shed(StreamReset(ResetCode.MEMORY.value, MEMORY_RESET))
                self._maybe_forget(stream)
        elif isinstance(event, SendFrame):
            self._enqueue(event.data)
        elif isinstance(event, GoAway):
            self._shutdown(
                ConnectionLost(
                    f"{self.remote_peer.short()} closed the connection ({event.code}): {event.message}"
                )
            )

    def __repr__(self) -> str:
        return f"<Connection to {self.remote_peer.short()} via {self.channel.remote_address}>"

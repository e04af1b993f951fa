"""The asyncio driver of one established connection: streams, a reader task and a writer task.

A :class:`Connection` runs the pure :class:`~kit.p2p.mux.Mux` over a :class:`Channel` (a websocket,
or a stream relayed through another peer) and turns its events into
:class:`~kit.p2p.stream.Stream` objects (which hold the receiving and sending of one stream).

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
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kit.errors import (
    ConnectionLost,
    LocalProtocolError,
    PeerUnavailable,
    RemoteProtocolError,
    StreamReset,
)
from kit.p2p import wire
from kit.p2p.budget import BufferLedger
from kit.p2p.handshake import RemoteHello
from kit.p2p.mux import (
    CreditReceived,
    DataReceived,
    GoAway,
    Mux,
    SendFrame,
    StreamOpened,
    StreamResetByPeer,
    StreamShed,
    StreamState,
)
from kit.p2p.options import MuxLimits
from kit.p2p.stream import Message, Stream, StreamHandler, reset_error
from kit.p2p.wire import FrameType, Refusal, ResetCode

logger = logging.getLogger(__name__)
MEMORY_RESET = (
    "reset locally for memory: the stream held the most unread bytes when this peer was over "
    "its budget. help: read streams as data comes, or raise MuxLimits.connection_buffer / "
    "PeerOptions.buffer_budget"
)


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


class Connection:
    """One authenticated connection to a remote peer, carrying multiplexed streams."""

    def __init__(
        self,
        channel: Channel,
        remote: RemoteHello,
        *,
        is_dialer: bool,
        limits: MuxLimits,
        on_stream: StreamHandler,
        on_closed: Callable[[Connection], None],
        ledger: BufferLedger[Connection] | None = None,
    ) -> None:
        self.channel = channel
        self.remote = remote
        self.remote_peer = remote.peer_id
        self.is_dialer = is_dialer
        self.relayed = False  # through a relay's circuit (kit.p2p.peer prefers direct ones)
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
        self._loop = asyncio.get_running_loop()
        self.last_activity = self._loop.time()  # the one clock read, for idle pruning
        # Channels that can write without waiting (a websocket whose transport is not pushing
        # back) take a frame at once, as the stream hands it over: one task switch less per
        # frame than the writer task (``enqueue``). The writer still sends what is queued.
        self._send_now: Callable[[Message], bool] | None = getattr(channel, "send_now", None)
        self._writing = False  # the writer task is sending a frame
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
        self.enqueue(frame)
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

    def enqueue(self, frame: Message) -> None:
        """Send a frame: at once when nothing is queued before it and the channel takes it
        now (``send_now``: no task switch), else queued for the writer task.

        Raises:
            ConnectionLost: the connection is closed, or its channel is gone.
        """
        if self._closed:
            raise self._close_reason or ConnectionLost("connection closed")
        if self._send_now is not None and not self._outbox and not self._writing:
            try:
                if self._send_now(frame):
                    return
            except ConnectionLost as e:
                self._shutdown(e)
                raise
        self._outbox.append(frame)
        self._outbox_ready.set()

    def send_control(self, frame: Message) -> None:
        """Send a frame that means nothing once the connection is gone (credit, the end or reset
        of a stream): never raises. A channel found gone here closes the connection, as the
        writer would, and whoever waits on its streams learns it from them."""
        if not self._closed:
            with contextlib.suppress(ConnectionLost):
                self.enqueue(frame)

    def consumed(self, stream_id: int, size: int) -> None:
        """A stream's reader took ``size`` bytes: maybe return credit to the remote."""
        frame = self.mux.consumed(stream_id, size)
        if frame is not None:
            self.send_control(frame)

    def forget_if_done(self, stream: Stream) -> None:
        """Drop a closed or reset stream (and close a draining connection left idle)."""
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
            stream.fail(reason)
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
                    self._writing = True  # (enqueue must not overtake this frame)
                    try:
                        await self.channel.send(frame)
                    finally:
                        self._writing = False
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
        try:
            set_receiver = getattr(self.channel, "set_receiver", None)
            if set_receiver is not None:  # frames handled as they arrive (one task switch less
                set_receiver(self._receive)  # each); recv() then raises what ends the reading
            while True:
                self._receive(await self.channel.recv())
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

    def _receive(self, data: bytes | bytearray | memoryview) -> None:
        """Handle one frame from the channel (errors end the reading: see ``_read_loop``)."""
        self.last_activity = self._loop.time()
        frame = wire.decode_frame(data, self.mux.limits.max_frame)
        for event in self.mux.receive(frame):
            self._dispatch(event)
        if self._ledger is not None and frame.type is FrameType.DATA:
            self._shed_for_peer(self._ledger)
            if self.mux.buffers.circuit_ledger is not None:  # this peer relays circuits here
                self._shed_for_peer(self.mux.buffers.circuit_ledger, circuits=True)

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
                stream.deliver(event)
                self.forget_if_done(stream)
        elif isinstance(event, CreditReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.credit_arrived()
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
                stream.fail(reset_error(event.code, event.message))
            handler = self._handler_by_stream.pop(event.stream_id, None)
            if handler is not None:
                handler.cancel()  # the opener gave up: stop working for it
        elif isinstance(event, StreamShed):
            self.send_control(event.frame)
            stream = self._streams.get(event.stream_id)
            self._log_shed(event, stream)
            handler = self._handler_by_stream.pop(event.stream_id, None)
            if handler is not None:
                handler.cancel()  # its stream is gone: nothing it does can reach the opener
            if stream is not None:
                stream.shed(StreamReset(ResetCode.MEMORY.value, MEMORY_RESET))
                self.forget_if_done(stream)
        elif isinstance(event, SendFrame):
            self.send_control(event.data)
        elif isinstance(event, GoAway):
            self._shutdown(
                ConnectionLost(
                    f"{self.remote_peer.short()} closed the connection ({event.code}): {event.message}"
                )
            )

    def __repr__(self) -> str:
        return f"<Connection to {self.remote_peer.short()} via {self.channel.remote_address}>"

"""kit's own RFC 6455 data path: websocket frames read straight into their final buffers.

websockets performs the opening handshake (HTTP upgrade, TLS, proxies); then kit takes the
connection's transport over and speaks the same RFC 6455 framing itself. Why: websockets copies
every payload five times on the way in (socket → chunk → stream buffer → slice → unmask) and
three on the way out, which capped tensor traffic at ~450-600 MB/s here against 1.2 GB/s for
plain TCP. Here the kernel writes payloads into the buffer they are delivered in, masking is an
in-place XOR, and the unmasked (server) side sends with ``writelines`` (no copy at all).

On the wire: binary frames, client frames masked, ping/pong, close frames, fragmented messages
accepted; text frames, reserved bits and unmasked client frames are protocol errors
(``MalformedFrame``). Keepalive: a ping after ``interval`` seconds of silence, and the
connection is dropped when nothing at all arrives within ``interval + timeout``.

Plain frames between kit peers: RFC 6455 masks client frames so that a browser's script cannot
steer what a proxy's cache sees; between two kit processes that proved their keys in the
handshake it buys nothing and costs a copy and an XOR of every byte the dialer sends (and an
XOR of every byte the listener receives). When both hellos offer ``plain-frames``
(``kit.p2p.channel``), the listener accepts unmasked client frames from its hello on
(:meth:`FastWebSocketChannel.accept_plain`) and the dialer sends them from the WELCOME on
(:meth:`FastWebSocketChannel.send_plain`). A dialer that goes through an HTTP proxy does not offer
it (``plain_possible``), nor does a peer with ``PeerOptions.plain_frames`` off: those keep
RFC 6455 to the letter.

The frame parser (:class:`FrameReader`) is a pure core: bytes in, messages and replies out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from kit.errors import ConnectionLost, FrameTooLarge, MalformedFrame
from kit.p2p.payload_pool import PAYLOADS, uninitialized
from kit.p2p.stream import Message, message_parts

OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_DIRECT_READ = 64 * 1024  # payloads at least this large are read straight into their buffer
_STAGE_SIZE = 256 * 1024


def apply_mask(buffer: bytearray | memoryview, key: bytes) -> None:
    """XOR ``buffer`` with the 4-byte masking key, in place (RFC 6455 §5.3)."""
    view = np.frombuffer(buffer, dtype=np.uint8)
    words = len(view) // 4
    if words:
        word_view = view[: words * 4].view(np.uint32)
        np.bitwise_xor(word_view, np.frombuffer(key, dtype=np.uint32)[0], out=word_view)
    for index in range(words * 4, len(view)):
        view[index] ^= key[index % 4]


def mask_into(
    destination: memoryview, source: bytes | bytearray | memoryview, key: bytes, phase: int
) -> None:
    """Write ``source`` XOR the masking key into ``destination`` in one pass; ``phase`` is the
    position of ``source`` in the frame payload modulo 4."""
    rotated = key[phase % 4 :] + key[: phase % 4]
    out = np.frombuffer(destination, dtype=np.uint8)
    data = np.frombuffer(source, dtype=np.uint8)
    words = len(data) // 8
    if words:
        key64 = np.frombuffer(rotated * 2, dtype=np.uint64)[0]
        np.bitwise_xor(
            data[: words * 8].view(np.uint64), key64, out=out[: words * 8].view(np.uint64)
        )
    for index in range(words * 8, len(data)):
        out[index] = data[index] ^ rotated[index % 4]


def frame_header(opcode: int, length: int, mask_key: bytes | None) -> bytes:
    """The header of one final (FIN) frame."""
    mask_bit = 0x80 if mask_key is not None else 0
    if length < 126:
        header = struct.pack("!BB", 0x80 | opcode, mask_bit | length)
    elif length < 65536:
        header = struct.pack("!BBH", 0x80 | opcode, mask_bit | 126, length)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, mask_bit | 127, length)
    return header + mask_key if mask_key is not None else header


class FrameReader:
    """Parses websocket frames from a byte stream (pure; the protocol below feeds it).

    Complete binary messages collect in ``messages``; control frames that need an answer
    (ping → pong, close → close) collect in ``replies`` as (opcode, payload).
    """

    def __init__(self, *, expect_masked: bool, max_size: int) -> None:
        self.expect_masked = expect_masked
        self.accept_unmasked = False  # a listener that agreed on plain frames takes both kinds
        self.max_size = max_size
        self.messages: collections.deque[bytes | bytearray | memoryview] = collections.deque()
        self.replies: list[tuple[int, bytes]] = []
        self.closed_by_peer = False
        self.stage = uninitialized(_STAGE_SIZE)
        self.start = self.end = 0  # unparsed bytes are stage[start:end]
        self.payload: memoryview | None = None  # a large payload being read directly
        self.payload_filled = 0
        self.payload_frame: tuple[int, bool, bytes | None] = (0, True, None)
        self.fragments: list[bytes | bytearray | memoryview] = []
        self.fragments_size = 0

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket should go."""
        if self.payload is not None:
            return self.payload[self.payload_filled :]
        if self.end == len(self.stage):  # compact: move the unparsed tail to the front
            tail = self.end - self.start
            self.stage[:tail] = self.stage[self.start : self.end]
            self.start, self.end = 0, tail
        return self.stage[self.end :]

    def received(self, size: int) -> None:
        """``size`` bytes were written into the last ``buffer()``; parse what is complete."""
        if self.payload is not None:
            self.payload_filled += size
            if self.payload_filled == len(self.payload):
                payload, self.payload = self.payload, None
                opcode, fin, key = self.payload_frame
                self._frame_done(opcode, fin, key, payload)
            return
        self.end += size
        while self.payload is None and self._parse_one():
            pass

    def _parse_one(self) -> bool:
        available = self.end - self.start
        if available < 2:
            return False
        first, second = self.stage[self.start], self.stage[self.start + 1]
        fin, opcode, masked, length = (
            bool(first & 0x80),
            first & 0x0F,
            bool(second & 0x80),
            second & 0x7F,
        )
        if first & 0x70:
            raise MalformedFrame(
                "websocket frame with reserved bits set (no extension was negotiated)"
            )
        if masked != self.expect_masked and not (self.accept_unmasked and not masked):
            raise MalformedFrame("websocket frame masking does not match the connection side")
        offset = 2
        if length == 126:
            if available < 4:
                return False
            (length,) = struct.unpack_from("!H", self.stage, self.start + 2)
            offset = 4
        elif length == 127:
            if available < 10:
                return False
            (length,) = struct.unpack_from("!Q", self.stage, self.start + 2)
            offset = 10
        if opcode >= OP_CLOSE and (length > 125 or not fin):
            raise MalformedFrame("websocket control frame too long or fragmented")
        if opcode not in (OP_CONTINUATION, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG):
            raise MalformedFrame(
                f"websocket opcode {opcode:#x} not accepted (kit sends binary frames only)"
            )
        if length + self.fragments_size > self.max_size:
            raise FrameTooLarge(f"websocket message of more than {self.max_size} bytes")
        key = None
        if masked:
            if available < offset + 4:
                return False
            key = bytes(self.stage[self.start + offset : self.start + offset + 4])
            offset += 4
        body_start = self.start + offset
        have = self.end - body_start
        if have >= length:
            payload = bytearray(self.stage[body_start : body_start + length])  # a copy: the
            self.start = body_start + length  # stage is reused for the next bytes
            self._frame_done(opcode, fin, key, payload)
            return True
        if length >= _DIRECT_READ or offset + length > len(self.stage):
            self.payload = PAYLOADS.take(length)  # resident memory when a frame was freed
            self.payload[:have] = self.stage[body_start : self.end]
            self.payload_filled = have
            self.payload_frame = (opcode, fin, key)
            self.start = self.end = 0
            return False
        return False  # a small frame still arriving in the stage buffer

    def _frame_done(
        self, opcode: int, fin: bool, key: bytes | None, payload: bytearray | memoryview
    ) -> None:
        if key is not None:
            apply_mask(payload, key)
        if opcode == OP_PING:
            self.replies.append((OP_PONG, bytes(payload)))
        elif opcode == OP_CLOSE:
            self.closed_by_peer = True
            self.replies.append((OP_CLOSE, bytes(payload[:2])))
        elif opcode == OP_PONG:
            pass
        elif opcode == OP_BINARY and not self.fragments:
            if fin:
                self.messages.append(payload)
            else:
                self.fragments, self.fragments_size = [payload], len(payload)
        elif opcode == OP_CONTINUATION and self.fragments:
            self.fragments.append(payload)
            self.fragments_size += len(payload)
            if fin:
                self.messages.append(b"".join(self.fragments))
                self.fragments, self.fragments_size = [], 0
        else:
            raise MalformedFrame("websocket fragments out of order")


class FastWebSocketChannel(asyncio.BufferedProtocol):
    """A :class:`~kit.p2p.connection.Channel` over a transport taken over from websockets."""

    def __init__(
        self,
        transport: Any,
        *,
        is_client: bool,
        remote_address: str,
        remote_host: str | None,
        max_size: int,
        keepalive_interval: float,
        keepalive_timeout: float,
        on_lost: Any = None,
        pending: tuple[bytes, ...] = (),
        plain_possible: bool = True,
    ) -> None:
        """``plain_possible``: nothing between the two ends parses websocket frames (False for a
        dialer whose connection goes through an HTTP proxy)."""
        self.remote_address = remote_address
        self.plain_possible = plain_possible
        self._masking = is_client  # clients mask until both ends agreed on plain frames
        self.remote_host = remote_host
        self._transport = transport
        self._reader = FrameReader(expect_masked=not is_client, max_size=max_size)
        self._reader.messages.extend(pending)
        self._message_ready = asyncio.Event()
        self._peer_closed = asyncio.Event()  # close frame or EOF from the peer
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._error: Exception | None = None
        # A protocol error in what the peer sent: recv() raises it (after the messages before
        # it), so that the connection answers with a GOAWAY naming it before closing.
        self._read_error: MalformedFrame | FrameTooLarge | None = None
        self._receiver: Callable[[bytes | bytearray | memoryview], None] | None = None
        self._receiver_error: Exception | None = None  # what it raised: recv() raises it too
        self._close_code = 1000
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._last_received = self._loop.time()
        if transport.is_closing():
            # The peer hung up while websockets still owned the socket (found by fuzzing: a
            # HELLO followed at once by EOF). uvloop raises RuntimeError on a closed transport.
            raise ConnectionLost(f"websocket to {remote_address} closed before the takeover")
        transport.set_write_buffer_limits(high=2**20)
        transport.set_protocol(self)
        # Started last: if the transport calls above raise, no keepalive task is left behind
        # holding this channel (and its buffers) for keepalive_interval + keepalive_timeout.
        self._keepalive = asyncio.ensure_future(
            self._keep_alive(keepalive_interval, keepalive_timeout)
        )
        if pending:
            self._message_ready.set()

    # --- Channel -----------------------------------------------------------------------

    async def send(self, data: Message) -> None:
        while not self._can_write.is_set():
            if self._error is not None:
                raise self._error
            await self._can_write.wait()
        if self._error is not None:
            raise self._error
        self._write(OP_BINARY, data)

    def can_send_now(self) -> bool:
        """Whether :meth:`send_now` would write at once (the transport is not pushing back).

        Raises:
            ConnectionLost: the channel is gone.
        """
        if self._error is not None:
            raise self._error
        return self._can_write.is_set()

    def send_now(self, data: Message) -> bool:
        """Send one message now, without a task switch, if the transport takes it at once
        (:meth:`can_send_now`); False (nothing sent) otherwise.

        Raises:
            ConnectionLost: the channel is gone.
        """
        if not self.can_send_now():
            return False
        self._write(OP_BINARY, data)
        return True

    def set_receiver(self, receiver: Callable[[bytes | bytearray | memoryview], None]) -> bool:
        """Hand every message to ``receiver`` as it is parsed, in the transport's callback, in
        order (the ones already parsed first), instead of queueing it for :meth:`recv`: one task
        switch less per message. What ``receiver`` raises ends the reading: :meth:`recv` raises
        it, as it raises a malformed frame, and nothing more is delivered. True: it is set."""
        self._receiver = receiver
        self._deliver()
        return True

    async def recv(self) -> bytes:
        while not self._reader.messages or self._receiver is not None:  # (a receiver: errors)
            if self._error is not None:
                raise self._error
            if self._read_error is not None:
                raise self._read_error
            if self._receiver_error is not None:
                raise self._receiver_error
            self._message_ready.clear()
            await self._message_ready.wait()
        message = self._reader.messages.popleft()
        if self._transport.is_reading() is False and len(self._reader.messages) < 8:
            self._transport.resume_reading()
        return message  # type: ignore[return-value]  # bytearray: the wire decoder takes bytes-likes

    async def close(self) -> None:
        """The closing handshake (RFC 6455 §7): send a close frame, then wait (at most 1 s) for
        the peer's, reading and dropping whatever it still sends, so that our last frames (a
        GOAWAY with the reason) are not lost to a TCP reset."""
        if self._error is None:
            with contextlib.suppress(Exception):
                self._write(OP_CLOSE, struct.pack("!H", self._close_code))
            self._fail(ConnectionLost(f"websocket to {self.remote_address} closed locally"))
            if self._read_error is None:  # else what follows is unparseable: just hang up
                if not self._transport.is_reading():
                    self._transport.resume_reading()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._peer_closed.wait(), 1.0)
        self._transport.close()  # after our queued frames (the GOAWAY) are written

    def accept_plain(self) -> None:
        """The listener's side of plain frames: take unmasked client frames from now on."""
        self._reader.accept_unmasked = True

    def send_plain(self) -> None:
        """The dialer's side of plain frames: send unmasked from now on (after the WELCOME)."""
        self._masking = False

    def write_buffer_size(self) -> int:
        """Bytes written but not yet handed to the kernel (for memory accounting)."""
        return int(self._transport.get_write_buffer_size())

    def feed(self, data: bytes) -> None:
        """Parse bytes that arrived before this channel took its transport over (what a punched
        socket received first: ``kit.p2p.hole_punch``), as if the transport had delivered them."""
        view = memoryview(data)
        while view:
            target = self.get_buffer(len(view))
            size = min(len(target), len(view))
            target[:size] = view[:size]
            self.buffer_updated(size)
            view = view[size:]

    # --- asyncio.BufferedProtocol ------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._last_received = self._loop.time()
        if self._read_error is not None:
            return  # the stream is unparseable from here on; we are closing
        try:
            self._reader.received(nbytes)
        except (MalformedFrame, FrameTooLarge) as e:
            # As for any protocol error: the connection's reader gets it from recv() (after the
            # messages before it) and sends a GOAWAY with the reason, then close() sends close
            # code 1009 or 1002.
            self._deliver()
            self._read_error = e
            self._close_code = 1009 if isinstance(e, FrameTooLarge) else 1002
            self._transport.pause_reading()
            self._message_ready.set()
            return
        if self._error is not None:  # closing: drain and drop until the peer's close frame
            self._reader.messages.clear()
            self._reader.replies.clear()
            if self._reader.closed_by_peer:
                self._peer_closed.set()
            return
        for opcode, payload in self._reader.replies:
            with contextlib.suppress(Exception):
                self._write(opcode, payload)
        self._reader.replies.clear()
        closed_by_peer = self._reader.closed_by_peer
        if self._reader.messages:
            self._deliver()
        if closed_by_peer:  # (after the messages before the close frame)
            self._peer_closed.set()
            self._fail(ConnectionLost(f"websocket to {self.remote_address} closed by the peer"))
            self._transport.close()

    def _deliver(self) -> None:
        """Hand parsed messages to the receiver, or wake :meth:`recv` for them."""
        messages, receiver = self._reader.messages, self._receiver
        while receiver is not None and messages and self._receiver_error is None:
            try:
                receiver(messages.popleft())
            except Exception as e:  # the connection's reader gets it from recv()
                self._receiver_error = e
                self._transport.pause_reading()
        if messages or self._receiver_error is not None:
            self._message_ready.set()
            if len(messages) > 64:
                self._transport.pause_reading()  # the connection's reader is behind: push back
        elif receiver is not None and self._read_error is None and not self._transport.is_reading():
            # A backlog that paused the reading before the receiver took over is handled: read
            # on (recv(), which resumes otherwise, never takes a message once a receiver is set:
            # the peer's next frames and its EOF went unread until the keepalive gave up).
            self._transport.resume_reading()

    def eof_received(self) -> bool:
        self._peer_closed.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._peer_closed.set()
        self._fail(
            ConnectionLost(f"websocket to {self.remote_address} lost" + (f": {exc}" if exc else ""))
        )
        if self._on_lost is not None:
            with contextlib.suppress(Exception):
                self._on_lost(exc)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # --- internals -----------------------------------------------------------------------

    def _write(self, opcode: int, data: Message) -> None:
        if self._transport.is_closing():
            raise ConnectionLost(f"websocket to {self.remote_address} is closing")
        parts = message_parts(data)
        length = sum(len(part) for part in parts)
        if not self._masking:  # unmasked: hand the parts to the kernel as they are
            self._transport.writelines([frame_header(opcode, length, None), *parts])
            return
        key = os.urandom(4)
        header = frame_header(opcode, length, key)
        # np.empty: no zero-filling pass; the masking XOR writes every byte exactly once.
        frame = np.empty(len(header) + length, dtype=np.uint8)
        view = memoryview(frame)  # type: ignore[arg-type]
        view[: len(header)] = header
        offset = len(header)
        for part in parts:
            mask_into(view[offset : offset + len(part)], part, key, offset - len(header))
            offset += len(part)
        self._transport.write(view)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
            self._keepalive.cancel()
        self._message_ready.set()
        self._can_write.set()

    async def _keep_alive(self, interval: float, timeout: float) -> None:
        while True:
            await asyncio.sleep(interval / 2)
            silent = self._loop.time() - self._last_received
            if silent > interval + timeout:
                self._fail(
                    ConnectionLost(
                        f"websocket to {self.remote_address}: no answer for {silent:.0f} s"
                    )
                )
                self._transport.close()
                return
            if silent > interval:
                with contextlib.suppress(Exception):
                    self._write(OP_PING, b"kit")

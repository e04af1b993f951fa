"""kit's RFC 6455 framing: the pure frame reader, fed in every possible split."""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

import numpy as np
import pytest
from websockets.frames import Frame, Opcode

from kit.errors import ConnectionLost, FrameTooLarge, MalformedFrame
from kit.p2p.websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FastWebSocketChannel,
    FrameReader,
    apply_mask,
    frame_header,
    mask_into,
)


def websockets_frame(opcode: Opcode, data: bytes, *, fin: bool = True, mask: bool = True) -> bytes:
    """A frame serialized by the websockets library itself: the reference encoder."""
    return Frame(opcode, data, fin=fin).serialize(mask=mask)


def feed(reader: FrameReader, data: bytes, step: int) -> None:
    for start in range(0, len(data), step):
        piece = data[start : start + step]
        offset = 0
        while offset < len(piece):
            buffer = reader.buffer()
            size = min(len(buffer), len(piece) - offset)
            buffer[:size] = piece[offset : offset + size]
            reader.received(size)
            offset += size


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_reads_frames_from_websockets_in_any_split(step: int) -> None:
    small, large = os.urandom(100), os.urandom(3 * 1024 * 1024 + 5)
    stream = (
        websockets_frame(Opcode.BINARY, small)
        + websockets_frame(Opcode.PING, b"hi")
        + websockets_frame(Opcode.BINARY, large)
        + websockets_frame(Opcode.BINARY, b"part1-", fin=False)
        + websockets_frame(Opcode.CONT, b"part2", fin=True)
        + websockets_frame(Opcode.BINARY, b"")
    )
    reader = FrameReader(expect_masked=True, max_size=16 * 1024 * 1024)
    feed(reader, stream, step)
    assert [bytes(m) for m in reader.messages] == [small, large, b"part1-part2", b""]
    assert reader.replies == [(OP_PONG, b"hi")]


def test_close_frame_is_answered() -> None:
    reader = FrameReader(expect_masked=False, max_size=1024)
    feed(reader, websockets_frame(Opcode.CLOSE, struct.pack("!H", 1000) + b"bye", mask=False), 3)
    assert reader.closed_by_peer and reader.replies == [(OP_CLOSE, struct.pack("!H", 1000))]


@pytest.mark.parametrize(
    "frame, error",
    [
        (websockets_frame(Opcode.TEXT, b"text"), MalformedFrame),
        (websockets_frame(Opcode.BINARY, b"x", mask=False), MalformedFrame),  # client must mask
        (bytes([0x82 | 0x40, 0x80]) + b"\0" * 4, MalformedFrame),  # reserved bit
        (bytes([0x09, 0x80]) + b"\0" * 4, MalformedFrame),  # fragmented ping
        (websockets_frame(Opcode.CONT, b"x"), MalformedFrame),  # continuation without a start
        (frame_header(OP_BINARY, 2048, b"abcd"), FrameTooLarge),
    ],
    # (named: the random masks would give each pytest-xdist worker other test ids)
    ids=["text", "unmasked", "reserved-bit", "fragmented-ping", "lone-continuation", "too-large"],
)
def test_protocol_errors(frame: bytes, error: type[Exception]) -> None:
    reader = FrameReader(expect_masked=True, max_size=1024)
    with pytest.raises(error):
        feed(reader, frame, 64)


def test_our_encoder_is_read_by_websockets() -> None:
    from websockets.frames import Frame as Parsed
    from websockets.streams import StreamReader

    key, payload = os.urandom(4), os.urandom(70_000)
    header = frame_header(OP_BINARY, len(payload), key)
    masked = bytearray(payload)
    apply_mask(masked, key)
    stream = StreamReader()
    stream.feed_data(header + bytes(masked))
    parser = Parsed.parse(stream.read_exact, mask=True)
    try:
        next(parser)
    except StopIteration as done:
        frame = done.value
    assert frame.opcode == Opcode.BINARY and frame.data == payload


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
@pytest.mark.parametrize("size", [0, 3, 8, 13, 1000])
def test_mask_into_matches_bytewise_xor(phase: int, size: int) -> None:
    key, data = os.urandom(4), os.urandom(size)
    out = np.empty(size, dtype=np.uint8)
    mask_into(memoryview(out), data, key, phase)  # type: ignore[arg-type]
    expected = bytes(b ^ key[(phase + i) % 4] for i, b in enumerate(data))
    assert out.tobytes() == expected


def test_ping_pong_opcodes() -> None:
    assert (OP_PING, OP_PONG) == (0x9, 0xA)


def listener_channel(transport: Any) -> FastWebSocketChannel:
    """The listening side's channel over ``transport`` (small frames; no keepalive in a test)."""
    return FastWebSocketChannel(
        transport,
        is_client=False,
        remote_address="test",
        remote_host=None,
        max_size=1024,
        keepalive_interval=60.0,
        keepalive_timeout=60.0,
    )


@pytest.mark.sockets
async def test_takeover_of_a_closed_transport_leaves_no_task_behind() -> None:
    """Found by tests/p2p/test_fuzz.py: a dialer that sends its HELLO and hangs up at once left
    the channel's keepalive task (and its buffers) alive for keepalive_interval + timeout, since
    uvloop raises on a closed transport after the task had started."""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await asyncio.get_running_loop().create_connection(
        asyncio.Protocol, "127.0.0.1", port
    )
    transport.close()
    before = asyncio.all_tasks()
    with pytest.raises(ConnectionLost, match="closed before the takeover"):
        listener_channel(transport)
    assert asyncio.all_tasks() == before  # no keepalive task was started
    server.close()
    await server.wait_closed()


class _Accepted(asyncio.Protocol):
    """Holds a server-side transport (reading paused) for a channel to take over."""

    def __init__(self, accepted: asyncio.Future[asyncio.Transport]) -> None:
        self.accepted = accepted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]
        self.accepted.set_result(transport)  # type: ignore[arg-type]


@pytest.mark.sockets
async def test_a_backlog_from_before_the_receiver_took_over_does_not_stop_the_reading() -> None:
    """Found by tests/p2p/test_fuzz.py (a peer that never hung up after our EOF): over 64
    messages parsed before the connection's reader set its receiver paused the reading, and
    only recv(), which a receiver never lets take a message, resumed it; the peer's next
    frames and its EOF went unread until the keepalive gave up."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.Transport] = loop.create_future()
    server = await loop.create_server(lambda: _Accepted(accepted), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    channel = listener_channel(await asyncio.wait_for(accepted, 5))
    try:
        # the burst that arrived before the takeover, as a punched socket hands it over
        channel.feed(b"".join(websockets_frame(Opcode.BINARY, b"m%d" % i) for i in range(100)))
        got: list[bytes] = []
        channel.set_receiver(lambda message: got.append(bytes(message)))
        assert len(got) == 100
        writer.write(websockets_frame(Opcode.BINARY, b"after"))
        await writer.drain()
        for _ in range(200):  # at most 2 s
            if got[-1] == b"after":
                break
            await asyncio.sleep(0.01)
        assert got[-1] == b"after"
        writer.write_eof()  # and the peer's EOF ends the channel
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(channel.recv(), 5)
    finally:
        writer.close()
        await channel.close()
        server.close()
        await server.wait_closed()


def test_a_declared_frame_costs_memory_only_as_its_bytes_arrive() -> None:
    """A frame header declaring 8 MiB, then silence: the buffer is there, but untouched pages
    are not resident. Zero-filled (bytearray) buffers made 16 such connections cost 128 MiB
    (found by tests/p2p/test_fuzz.py: hostile peers grew the process by 100+ MiB)."""
    import psutil

    key, declared = b"abcd", 8 * 1024**2
    readers = [FrameReader(expect_masked=True, max_size=16 * 1024**2) for _ in range(16)]
    before = psutil.Process().memory_info().rss
    for reader in readers:
        feed(reader, frame_header(OP_BINARY, declared, key) + os.urandom(100), 4096)
        assert reader.payload is not None and len(reader.payload) == declared
    growth = psutil.Process().memory_info().rss - before
    assert growth < 16 * 1024**2, f"{growth / 2**20:.0f} MiB resident for 1.6 KB received"


@pytest.mark.parametrize("max_frame", [64 * 1024, 1024**2])
def test_the_websocket_bound_follows_the_announced_frame_size(max_frame: int) -> None:
    from kit.p2p import wire
    from kit.p2p.channel import websocket_max_size
    from kit.p2p.frame_auth import TAG_SIZE

    bound = websocket_max_size(max_frame)
    assert bound == max(max_frame, wire.MAX_CONTROL_PAYLOAD) + wire.HEADER_SIZE + TAG_SIZE
    reader = FrameReader(expect_masked=True, max_size=bound)
    feed(reader, websockets_frame(Opcode.BINARY, b"x" * bound), 65536)  # the largest: accepted
    assert len(reader.messages[0]) == bound
    with pytest.raises(FrameTooLarge):  # one byte more is refused at its header, unread
        feed(reader, frame_header(OP_BINARY, bound + 1, b"abcd"), 64)


def test_a_listener_takes_unmasked_frames_only_once_plain_frames_were_agreed() -> None:
    unmasked = websockets_frame(Opcode.BINARY, b"plain", mask=False)
    masked = websockets_frame(Opcode.BINARY, b"masked")
    reader = FrameReader(expect_masked=True, max_size=1024)
    with pytest.raises(MalformedFrame, match="masking"):
        feed(reader, unmasked, 64)
    reader = FrameReader(expect_masked=True, max_size=1024)
    reader.accept_unmasked = True  # FastWebSocketChannel.accept_plain, after both hellos offer it
    feed(reader, masked + unmasked, 3)
    assert [bytes(m) for m in reader.messages] == [b"masked", b"plain"]
    client = FrameReader(expect_masked=False, max_size=1024)
    with pytest.raises(MalformedFrame, match="masking"):  # a server never masks
        feed(client, masked, 64)

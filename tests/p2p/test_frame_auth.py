"""Authenticated frames: a modified, injected, replayed or reordered frame is rejected."""

from __future__ import annotations

import asyncio
import os

import pytest

from kit.errors import ConnectionLost, FrameAuthenticationFailed, StreamReset
from kit.p2p import wire
from kit.p2p.frame_auth import AuthenticatedChannel, FrameAuthenticator
from kit.p2p.handshake import SessionKeys
from kit.p2p.identity import PeerID
from kit.p2p.peer import create_peer
from kit.p2p.websocket import OP_BINARY, FastWebSocketChannel, apply_mask, frame_header
from kit.p2p.wire import FrameType


def pair() -> tuple[FrameAuthenticator, FrameAuthenticator]:
    a, b = os.urandom(32), os.urandom(32)
    return FrameAuthenticator(SessionKeys(a, b)), FrameAuthenticator(SessionKeys(b, a))


def test_seal_open_round_trip_in_order() -> None:
    sender, receiver = pair()
    for payload in (b"first", b"", b"x" * 100_000):
        assert bytes(receiver.open(sender.seal(payload))) == payload


@pytest.mark.parametrize("attack", ["modify", "inject", "replay", "reorder", "truncate"])
def test_attacks_fail(attack: str) -> None:
    sender, receiver = pair()
    first, second = sender.seal(b"frame one"), sender.seal(b"frame two")
    if attack == "modify":
        tampered = bytearray(first)
        tampered[3] ^= 0x01
        messages = [bytes(tampered)]
    elif attack == "inject":
        messages = [b"frame zero" + b"\0" * 16]
    elif attack == "replay":
        receiver.open(first)
        messages = [first]
    elif attack == "reorder":
        messages = [second]
    else:
        messages = [first[:10]]
    with pytest.raises(FrameAuthenticationFailed):
        for message in messages:
            receiver.open(message)


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request


async def test_injected_frame_drops_the_connection() -> None:
    a = await create_peer(run_id="test", frame_auth=True)
    b = await create_peer(a.get_visible_addresses(), run_id="test")  # asks nothing; a requires it
    try:
        a.add_unary_handler("echo", echo)
        assert await b.call(a.peer_id, "echo", b"hello", timeout=5) == b"hello"
        connection = a.connection(b.peer_id)
        assert connection is not None and isinstance(connection.channel, AuthenticatedChannel)
        assert isinstance(b.connection(a.peer_id).channel, AuthenticatedChannel)  # type: ignore[union-attr]
        inner = connection.channel.inner
        assert isinstance(inner, FastWebSocketChannel)
        # an attacker on the path slips a well-formed RESET frame in, with a made-up tag: it
        # arrives as websocket bytes from the dialer would (a masked frame)
        forged = wire.encode_control(FrameType.RESET, 1, {"code": "cancelled", "message": ""})
        forged += b"\0" * 16
        key = b"\x01\x02\x03\x04"
        masked = bytearray(forged)
        apply_mask(masked, key)
        inner.feed(frame_header(OP_BINARY, len(forged), key) + bytes(masked))
        with pytest.raises((ConnectionLost, StreamReset)):
            await b.call(a.peer_id, "echo", b"x", timeout=5)
        await asyncio.sleep(0.1)
        assert connection.closed
        assert (
            await b.call(a.peer_id, "echo", b"again", timeout=5) == b"again"
        )  # a fresh connection
    finally:
        await b.shutdown()
        await a.shutdown()


class TamperingProxy:
    """A TCP relay on the path that can flip one byte in the dialer's next large write."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.flip = False
        self.flipped = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )

        async def pump(
            source: asyncio.StreamReader, sink: asyncio.StreamWriter, tamper: bool
        ) -> None:
            try:
                while data := await source.read(65536):
                    if tamper and self.flip and len(data) > 10_000:
                        mutable = bytearray(data)
                        mutable[len(data) // 2] ^= 0x40  # inside a large DATA payload
                        data = bytes(mutable)
                        self.flip = False
                        self.flipped += 1
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(
            pump(reader, upstream_writer, True), pump(upstream_reader, writer, False)
        )

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("frame_auth", [True, False])
async def test_modified_frame_on_the_path(frame_auth: bool) -> None:
    a = await create_peer(run_id="test", frame_auth=frame_auth)
    b = await create_peer(run_id="test", frame_auth=frame_auth)
    proxy = TamperingProxy(a.listen_port)  # type: ignore[arg-type]
    port = await proxy.start()
    try:
        a.add_unary_handler("echo", echo, max_request=2**20)
        await b.connect(f"/ip4/127.0.0.1/tcp/{port}/ws/p2p/{a.peer_id}", timeout=5)
        payload = os.urandom(200_000)
        assert await b.call(a.peer_id, "echo", payload, timeout=5, max_response=2**20) == payload
        proxy.flip = True
        if frame_auth:
            with pytest.raises((ConnectionLost, StreamReset)):
                await b.call(a.peer_id, "echo", payload, timeout=5, max_response=2**20)
        else:  # without authentication the damage goes through unnoticed
            answer = await b.call(a.peer_id, "echo", payload, timeout=5, max_response=2**20)
            assert answer != payload and len(answer) == len(payload)
        assert proxy.flipped == 1
    finally:
        proxy.close()
        await b.shutdown()
        await a.shutdown()

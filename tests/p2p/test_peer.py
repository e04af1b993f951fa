"""Real peers on loopback sockets: calls, streams, flow control, refusals, bad input, crashes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import websockets
import websockets.asyncio.client
import websockets.exceptions
from websockets.protocol import State

from kit.errors import (
    ConnectionLost,
    HandshakeRefused,
    InvalidTensor,
    KitTimeout,
    PeerUnavailable,
    RemoteError,
    StateNotHeld,
    StreamReset,
    UnknownProtocol,
)
from kit.p2p import wire
from kit.p2p.api import StreamAPI
from kit.p2p.connection import Connection
from kit.p2p.handshake import DialerHandshake, HandshakeSettings
from kit.p2p.identity import Identity, PeerID
from kit.p2p.options import MuxLimits
from kit.p2p.peer import Peer, create_peer
from kit.p2p.tensors import TensorHeader, receive_tensor, send_tensor
from kit.p2p.websocket import FastWebSocketChannel
from kit.p2p.wire import FrameType
from tests.conftest import MS

pytestmark = pytest.mark.sockets
ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def peers(count: int, **options: object) -> AsyncIterator[list[Peer]]:
    first = await create_peer(run_id="test", **options)  # type: ignore[arg-type]
    started = [first]
    try:
        for _ in range(count - 1):
            started.append(
                await create_peer(first.get_visible_addresses(), run_id="test", **options)
            )  # type: ignore[arg-type]
        yield started
    finally:
        for peer in started:
            await peer.shutdown()


def in_use(peer: Peer, remote: PeerID) -> Connection:
    """``peer``'s connection in use to ``remote`` (there must be one)."""
    connection = peer.connection(remote)
    assert connection is not None, f"{peer} has no connection to {remote.short()}"
    return connection


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request + b"!" + caller.to_bytes()[:2]


async def test_unary_call_and_caller_identity() -> None:
    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)
        assert (
            await b.call(a.peer_id, "echo", b"hi", timeout=5) == b"hi!" + b.peer_id.to_bytes()[:2]
        )
        assert a.connected_peers() == [b.peer_id] and b.connected_peers() == [a.peer_id]


async def test_hundred_concurrent_calls_share_one_connection() -> None:
    async with peers(2) as (a, b):

        async def slow_echo(caller: PeerID, request: bytes) -> bytes:
            await asyncio.sleep(0.2)
            return request

        a.add_unary_handler("slow", slow_echo)
        started = time.perf_counter()
        answers = await asyncio.gather(
            *(b.call(a.peer_id, "slow", str(i).encode(), timeout=10) for i in range(100))
        )
        assert answers == [str(i).encode() for i in range(100)]
        assert time.perf_counter() - started < 5  # concurrent, not one after another (100 x 0.2 s)
        assert len(b.connections) == 1


async def test_bidirectional_stream_and_half_close() -> None:
    async with peers(2) as (a, b):

        async def upper(stream: StreamAPI) -> None:
            while (message := await stream.receive_message(timeout=5)) is not None:
                await stream.send_message(message.upper(), timeout=5)

        a.add_stream_handler("upper", upper)
        stream = await b.open_stream(a.peer_id, "upper", timeout=5)
        for word in (b"one", b"two", b"x" * 3_000_000):
            await stream.send_message(word, timeout=5)
            assert await stream.receive_message(timeout=5) == word.upper()
        await stream.close()
        assert await stream.receive_message(timeout=5) is None


async def test_a_message_in_parts_crosses_frames_uncopied_and_arrives_whole() -> None:
    """A header and a 9 MiB payload given as parts (an all-reduce chunk) go out as frames that
    are views of the parts (nothing joined), and arrive as one message."""
    payload = os.urandom(9 * 2**20 + 3)
    async with peers(2) as (a, b):
        received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def sink(stream: StreamAPI) -> None:
            parts = await stream.receive_message_parts(max_size=2**24, timeout=10)  # type: ignore[attr-defined]
            received.set_result(b"".join(parts))

        a.add_stream_handler("sink", sink)
        stream = await b.open_stream(a.peer_id, "sink", timeout=5)
        framed: list[object] = []
        connection = in_use(b, a.peer_id)
        enqueue = connection.enqueue
        connection.enqueue = lambda frame: (framed.append(frame), enqueue(frame))[1]  # type: ignore[method-assign]
        await stream.send_message((b"head", memoryview(payload)), timeout=10)  # type: ignore[arg-type]
        assert await asyncio.wait_for(received, 10) == b"head" + payload
        views = [part for frame in framed for part in frame[1:]]  # type: ignore[index]
        assert len(framed) >= 3 and all(isinstance(v, memoryview) for v in views[1:])
        assert all(v.obj is payload for v in views[1:])  # slices of the caller's buffer


@pytest.mark.parametrize("listener_plain", [True, False])
async def test_kit_peers_drop_masking_after_the_handshake_unless_one_declines(
    listener_plain: bool,
) -> None:
    """Two kit peers agree on unmasked frames (the dialer's masking costs a copy and an XOR of
    every byte); a peer with plain_frames=False (a proxy that parses frames) keeps RFC 6455."""
    listener = await create_peer(run_id="test", plain_frames=listener_plain)
    dialer = await create_peer(listener.get_visible_addresses(), run_id="test")
    try:
        listener.add_unary_handler("echo", echo)
        assert (await dialer.call(listener.peer_id, "echo", b"hi", timeout=5)).startswith(b"hi!")
        dialed = in_use(dialer, listener.peer_id).channel
        accepted = in_use(listener, dialer.peer_id).channel
        assert isinstance(dialed, FastWebSocketChannel)
        assert isinstance(accepted, FastWebSocketChannel)
        assert dialed._masking is not listener_plain
        assert accepted._reader.accept_unmasked is listener_plain
        big = os.urandom(3 * 2**20)  # a large message both ways, after the switch
        listener.add_unary_handler("big", lambda caller, request: _reversed(request))
        reply = await dialer.call(listener.peer_id, "big", big, timeout=10)
        assert reply == big[::-1]
    finally:
        await dialer.shutdown()
        await listener.shutdown()


async def _reversed(request: bytes) -> bytes:
    return request[::-1]


async def test_remote_errors_are_typed() -> None:
    async with peers(2) as (a, b):

        async def broken(caller: PeerID, request: bytes) -> bytes:
            raise ValueError("no such thing")

        a.add_unary_handler("broken", broken)
        with pytest.raises(UnknownProtocol):
            await b.call(a.peer_id, "missing", b"", timeout=5)
        with pytest.raises(RemoteError, match="no such thing"):
            await b.call(a.peer_id, "broken", b"", timeout=5)
        a.add_unary_handler("echo", echo)
        assert await b.call(a.peer_id, "echo", b"", timeout=5)  # the connection survived both


async def test_an_expected_handler_failure_is_not_logged_as_our_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="kit.p2p.handlers")
    async with peers(2) as (a, b):

        async def moved_on(caller: PeerID, request: bytes) -> bytes:
            raise StateNotHeld("the state asked for is gone")

        async def broken(caller: PeerID, request: bytes) -> bytes:
            raise ValueError("a bug")

        a.add_unary_handler("moved-on", moved_on)
        a.add_unary_handler("broken", broken)
        with pytest.raises(RemoteError, match="StateNotHeld: the state asked for is gone"):
            await b.call(a.peer_id, "moved-on", b"", timeout=5)
        levels = {r.levelno for r in caplog.records if "moved-on" in r.getMessage()}
        assert levels == {logging.DEBUG}  # transient and expected: one DEBUG line
        with pytest.raises(RemoteError, match="a bug"):
            await b.call(a.peer_id, "broken", b"", timeout=5)
        assert any(
            r.levelno == logging.WARNING and "broken" in r.getMessage() for r in caplog.records
        )


async def test_call_timeout_resets_the_stream() -> None:
    async with peers(2) as (a, b):
        cancelled = asyncio.Event()

        async def hang(stream: StreamAPI) -> None:
            try:
                await asyncio.sleep(30)
            finally:
                cancelled.set()

        a.add_stream_handler("hang", hang)
        with pytest.raises(KitTimeout):
            await b.call(a.peer_id, "hang", b"", timeout=200 * MS)
        await asyncio.wait_for(cancelled.wait(), 5)


@pytest.mark.async_timeout(120)
async def test_slow_receiver_bounds_the_senders_memory() -> None:
    """256 MiB to a receiver that reads slowly: the sender never buffers more than ~one window."""
    limits = MuxLimits(receive_window=4 * 1024**2)
    async with peers(2, limits=limits) as (a, b):
        received = 0

        async def slow_sink(stream: StreamAPI) -> None:
            nonlocal received
            while (message := await stream.receive_message(max_size=2**21, timeout=30)) is not None:
                received += len(message)
                if received % (16 * 1024**2) == 0:
                    await asyncio.sleep(0.05)

        a.add_stream_handler("sink", slow_sink)
        stream = await b.open_stream(a.peer_id, "sink", timeout=5)
        connection = b.connection(a.peer_id)
        assert connection is not None
        chunk = b"\0" * 1024**2
        peak = 0
        for _ in range(256):
            await stream.send_message(chunk, timeout=30)
            buffered = sum(map(len, connection._outbox)) + connection.channel.write_buffer_size()  # type: ignore[attr-defined]
            peak = max(peak, buffered)
        await stream.close()
        deadline = time.monotonic() + 60
        while received < 256 * 1024**2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert received == 256 * 1024**2
        bound = (
            limits.receive_window + limits.max_frame + 2**20
        )  # window + one frame + write buffer
        assert peak <= bound, f"sender buffered {peak} bytes, bound {bound}"


async def test_wrong_run_id_is_refused_with_a_message() -> None:
    async with peers(1) as (a,):
        with pytest.raises(HandshakeRefused) as info:
            other = await create_peer(run_id="other-run", client_mode=False)
            try:
                await other.connect(a.get_visible_addresses()[0], timeout=5)
            finally:
                await other.shutdown()
        assert info.value.reason == "wrong_run" and "help:" in str(info.value)


@pytest.mark.processes
@pytest.mark.parametrize("remote_is", ["newer", "older"])
async def test_version_mismatch_is_refused_with_what_to_upgrade(remote_is: str) -> None:
    """A peer of the previous protocol (1: masked frames, two messages per all-reduce chunk)
    and one of a next protocol are both refused at once, each told which side to upgrade."""
    remote_version = wire.PROTOCOL_VERSION + (1 if remote_is == "newer" else -1)
    process, address = start_peer_process("--protocol-version", str(remote_version))
    try:
        local = await create_peer(run_id="test")
        try:
            with pytest.raises(HandshakeRefused) as info:
                await local.connect(address, timeout=10)
            assert info.value.reason == "version_mismatch"
            older = "dialing" if remote_is == "newer" else "listening"
            assert f"upgrade kit on the {older} peer" in str(info.value)
        finally:
            await local.shutdown()
    finally:
        process.kill()
        process.wait(10)


# --- bad input from a raw attacker ---------------------------------------------------------


async def raw_session(
    peer: Peer, run_id: str = "test"
) -> websockets.asyncio.client.ClientConnection:
    """A websocket that completed kit's handshake with ``peer``, for sending arbitrary frames."""
    websocket = await websockets.asyncio.client.connect(
        f"ws://127.0.0.1:{peer.listen_port}/",
        compression=None,
        max_size=None,
        max_queue=100_000,  # keep every frame the peer sends back until the test reads it
    )
    handshake = DialerHandshake(Identity.generate(), HandshakeSettings(run_id=run_id))
    await websocket.send(handshake.hello())
    _, auth = handshake.receive_hello(wire.decode_frame(await websocket.recv(), 0))
    await websocket.send(auth)
    handshake.receive_welcome(wire.decode_frame(await websocket.recv(), 0))
    return websocket


async def goaway_code(websocket: websockets.asyncio.client.ClientConnection) -> str:
    """Read until the peer's GOAWAY and return its code (the attacker's typed error)."""
    while True:
        frame = wire.decode_frame(await asyncio.wait_for(websocket.recv(), 5), 2**30)
        if frame.type is FrameType.GOAWAY:
            return wire.decode_reason(frame.payload, "GOAWAY")[0]


@pytest.mark.parametrize(
    "frame",
    [
        b"garbage",
        b"\x06\x00\x00",  # truncated
        bytes([99, 0, 0, 0, 0, 1]),  # unknown type
        wire.encode_frame(FrameType.DATA, 1, b"x" * (2 * 1024**2)),  # over the frame size
        wire.encode_frame(FrameType.DATA, 77, b"x"),  # data on a stream never opened
        os.urandom(64),
    ],
    ids=["garbage", "truncated", "unknown-type", "oversized", "no-stream", "random"],
)
async def test_bad_frames_drop_only_the_offender(frame: bytes) -> None:
    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)
        attacker = await raw_session(a)
        await attacker.send(frame)
        assert await goaway_code(attacker) == "protocol_error"
        await asyncio.wait_for(attacker.wait_closed(), 5)
        assert await b.call(a.peer_id, "echo", b"still serving", timeout=5)  # everyone else is fine


async def test_garbage_before_the_handshake() -> None:
    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)
        url = f"ws://127.0.0.1:{a.listen_port}/"
        async with websockets.asyncio.client.connect(url, compression=None) as attacker:
            await attacker.send(os.urandom(100))
            assert await goaway_code(attacker) == "protocol_error"
        attacker = await websockets.asyncio.client.connect(url, compression=None)
        with contextlib.suppress(Exception):  # the peer hangs up in the middle of this send
            await attacker.send(b"x" * (17 * 1024**2))  # beyond websockets' max_size
        await asyncio.wait_for(attacker.wait_closed(), 5)
        assert (
            attacker.protocol.state is State.CLOSED
        )  # "message too big" (1009), or cut off mid-send
        assert await b.call(a.peer_id, "echo", b"ok", timeout=5)


@pytest.mark.skipif(
    int(websockets.__version__.split(".")[0]) < 14,
    reason="websockets < 14 as the attacking client drops messages queued before a close frame",
)
async def test_ten_thousand_streams() -> None:
    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)

        async def hold(stream: StreamAPI) -> None:
            await asyncio.sleep(30)

        a.add_stream_handler("hold", hold)
        attacker = await raw_session(a)
        reader = asyncio.ensure_future(goaway_code(attacker))  # read while sending, as a peer would
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            for stream_id in range(1, 20_001, 2):
                await attacker.send(
                    wire.encode_control(FrameType.OPEN, stream_id, {"protocol": "hold"})
                )
        assert await reader == "too_many_streams"
        assert await b.call(a.peer_id, "echo", b"ok", timeout=5)
        assert len(a.connections) == 1  # the attacker's connection and its handlers are gone


async def test_wrong_tensor_is_rejected_before_allocation() -> None:
    async with peers(2) as (a, b):
        errors: list[Exception] = []

        async def tensor_sink(stream: StreamAPI) -> None:
            try:
                await receive_tensor(stream, expected=TensorHeader("float32", (4, 4)), timeout=5)
            except InvalidTensor as e:
                errors.append(e)
                raise

        a.add_stream_handler("tensor", tensor_sink)
        for header in (TensorHeader("float16", (4, 4)), TensorHeader("float32", (4, 5))):
            stream = await b.open_stream(a.peer_id, "tensor", timeout=5)
            await send_tensor(stream, header, b"\0" * header.nbytes, timeout=5)
            with pytest.raises(RemoteError, match="InvalidTensor"):
                await stream.receive_message(timeout=5)
        stream = await b.open_stream(a.peer_id, "tensor", timeout=5)
        await stream.send_message(
            wire.packb({"dtype": "object", "shape": [1], "nbytes": 8}), timeout=5
        )
        with pytest.raises(RemoteError, match="not allowed"):
            await stream.receive_message(timeout=5)
        assert len(errors) == 3


async def test_tensor_is_received_into_the_buffer_the_caller_allocates() -> None:
    async with peers(2) as (a, b):
        buffers: list[bytearray] = []
        got: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        def allocate(header: TensorHeader) -> memoryview:
            buffers.append(bytearray(b"x" * header.nbytes))  # not zeroed: every byte is written
            return memoryview(buffers[-1])

        async def tensor_sink(stream: StreamAPI) -> None:
            got.set_result(await receive_tensor(stream, timeout=5, allocate=allocate))

        a.add_stream_handler("tensor", tensor_sink)
        payload = bytes(range(256)) * 4096  # 1 MiB: several frames
        header = TensorHeader("uint8", (len(payload),))
        stream = await b.open_stream(a.peer_id, "tensor", timeout=5)
        await send_tensor(stream, header, payload, timeout=5)
        received = await asyncio.wait_for(got, 5)
        assert received is not None and received[0] == header  # type: ignore[index]
        assert received[1].obj is buffers[0] and bytes(buffers[0]) == payload  # type: ignore[index]


# --- real processes ------------------------------------------------------------------------


def start_peer_process(*args: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.p2p.peer_process", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    address = process.stdout.readline().strip()
    assert address, "peer process did not start"
    return process, address


@pytest.mark.processes
async def test_peer_killed_mid_stream_gives_a_typed_error_quickly() -> None:
    process, address = start_peer_process()
    try:
        peer = await create_peer(run_id="test")
        try:
            remote = await peer.connect(address, timeout=10)
            stream = await peer.open_stream(remote, "drip", timeout=5)
            assert await stream.receive_message(timeout=5) is not None
            os.kill(process.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises((ConnectionLost, StreamReset)):
                while True:
                    await stream.receive_message(timeout=10)
            assert time.monotonic() - started < 5
            with pytest.raises(PeerUnavailable):
                await peer.call(remote, "echo", b"", timeout=2)
        finally:
            await peer.shutdown()
    finally:
        process.kill()
        process.wait(10)


async def test_tls_wss(tmp_path: Path) -> None:
    import ssl

    from tests.p2p.tls import make_certificate

    certfile, keyfile = make_certificate(tmp_path)
    client_ssl = ssl.create_default_context(cafile=str(certfile))
    server = await create_peer(run_id="test", tls_certfile=str(certfile), tls_keyfile=str(keyfile))
    try:
        server.add_unary_handler("echo", echo)
        address = server.get_visible_addresses()[0]
        assert "/wss/" in address
        client = await create_peer([address], run_id="test", client_ssl=client_ssl)
        try:
            assert await client.call(server.peer_id, "echo", b"tls", timeout=5)
        finally:
            await client.shutdown()
        untrusting = await create_peer(run_id="test")  # default: system CAs, verification on
        try:
            with pytest.raises(PeerUnavailable, match="SSL|certificate"):
                await untrusting.connect(address, timeout=5)
        finally:
            await untrusting.shutdown()
    finally:
        await server.shutdown()


async def test_simultaneous_dials_keep_one_connection() -> None:
    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)
        b.add_unary_handler("echo", echo)
        await b.shutdown()
        b2 = await create_peer(run_id="test")
        try:
            a.add_address(b2.peer_id, b2.get_visible_addresses()[0])
            b2.add_address(a.peer_id, a.get_visible_addresses()[0])
            await asyncio.gather(
                a.connect(b2.get_visible_addresses()[0], timeout=5),
                b2.connect(a.get_visible_addresses()[0], timeout=5),
            )
            b2.add_unary_handler("echo", echo)
            for _ in range(3):
                await asyncio.gather(
                    a.call(b2.peer_id, "echo", b"", timeout=5),
                    b2.call(a.peer_id, "echo", b"", timeout=5),
                )
            await asyncio.sleep(0.2)
            assert a.connection(b2.peer_id) is not None
            assert a.connection(b2.peer_id).is_dialer != b2.connection(a.peer_id).is_dialer  # type: ignore[union-attr]
        finally:
            await b2.shutdown()


async def test_idle_connections_are_closed_and_redialed() -> None:
    async with peers(2, idle_timeout=0.3) as (a, b):
        a.add_unary_handler("echo", echo)
        await b.call(a.peer_id, "echo", b"", timeout=5)
        first = b.connection(a.peer_id)
        deadline = time.monotonic() + 5
        while b.connection(a.peer_id) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert b.connection(a.peer_id) is None and first is not None and first.closed
        assert await b.call(
            a.peer_id, "echo", b"again", timeout=5
        )  # redialed from the address book


async def test_http_routes_share_the_websocket_port() -> None:
    import json
    import urllib.error
    import urllib.request

    from kit.p2p.peer import HttpRequest, HttpResponse

    async with peers(2) as (a, b):
        a.add_unary_handler("echo", echo)

        async def status(request: HttpRequest) -> HttpResponse:
            body = {
                "path": request.path,
                "who": request.query.get("who"),
                "auth": request.headers.get("authorization"),
            }
            return HttpResponse(200, json.dumps(body).encode())

        async def broken(request: HttpRequest) -> HttpResponse:
            raise RuntimeError("boom")

        a.add_http_route("/api/status", status)
        a.add_http_route("/api/broken", broken)
        base = f"http://127.0.0.1:{a.listen_port}"

        def get(path: str) -> tuple[int, bytes]:
            request = urllib.request.Request(base + path, headers={"Authorization": "Bearer x"})
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                with opener.open(request, timeout=5) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        status_code, body = await asyncio.to_thread(get, "/api/status?who=me")
        assert status_code == 200 and json.loads(body) == {
            "path": "/api/status",
            "who": "me",
            "auth": "Bearer x",
        }
        assert (await asyncio.to_thread(get, "/api/broken"))[0] == 500
        assert (await asyncio.to_thread(get, "/nothing"))[
            0
        ] == 426  # websockets: "Upgrade Required"
        assert await b.call(a.peer_id, "echo", b"", timeout=5)  # websockets unaffected


async def test_hello_and_auth_in_one_write_are_refused_at_once() -> None:
    """A dialer must wait for the listener's HELLO (its AUTH signs the listener's nonce). One
    that sends more in the same write used to have it lost at the takeover, then waited for the
    handshake timeout; now it is refused at once, with the reason."""
    import base64
    import struct

    from kit.p2p.websocket import OP_BINARY, apply_mask, frame_header

    def masked(payload: bytes) -> bytes:
        key = os.urandom(4)
        body = bytearray(payload)
        apply_mask(body, key)
        return frame_header(OP_BINARY, len(payload), key) + bytes(body)

    async with peers(1, handshake_timeout=10.0) as (a,):
        reader, writer = await asyncio.open_connection("127.0.0.1", a.listen_port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        hello = DialerHandshake(Identity.generate(), HandshakeSettings(run_id="test")).hello()
        auth = wire.encode_control(FrameType.AUTH, 0, {"sig": b"\0" * 64})
        started = time.monotonic()
        writer.write(masked(hello) + masked(auth))  # one write
        first, second = await asyncio.wait_for(reader.readexactly(2), 5)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", await reader.readexactly(2))
        frame = wire.decode_frame(await reader.readexactly(length), 0)
        assert frame.type is FrameType.GOAWAY
        code, message = wire.decode_reason(frame.payload, "GOAWAY")
        assert code == "protocol_error" and "must wait for our HELLO" in message
        await asyncio.wait_for(reader.read(), 5)  # then it hangs up: EOF within 5 s
        assert time.monotonic() - started < 3.0  # not the 10 s handshake timeout
        writer.close()

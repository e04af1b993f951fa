"""Protocol fuzzing against a LIVE kit peer: 10,000 malformed inputs, no crash, no hang, bounded memory.

One peer listens on 127.0.0.1 in its own process (``tests/p2p/fuzz_target.py``, on kit's runtime
loop) for the whole module, and a raw attacker in the test's process (plain asyncio sockets, its
own HTTP and RFC 6455 encoder) attacks it at four layers, with inputs built by hypothesis
(``derandomize=True``: the same inputs every run):

a) raw TCP garbage and malformed HTTP upgrade requests (``websockets``' HTTP parser, kit's HTTP routes);
b) a valid upgrade, then malformed websocket frames: before the HELLO (``websockets``' parser) and
   after it (kit's own framing, :mod:`kit.p2p.websocket`);
c) a valid websocket, then malformed handshake messages (:mod:`kit.p2p.handshake`);
d) a completed handshake with a fresh identity, then malformed mux frames (:mod:`kit.p2p.mux`).

Every attacking connection ends with our EOF and must then be closed by the peer within a
timeout (a hang fails the test). After each layer the peer must serve a fresh legitimate peer
(a unary call and a stream round trip), its connections and asyncio tasks must return to their
baseline, nothing may be logged at ERROR level, no log record may carry a traceback, nothing may
reach the loop's exception handler (kit logs its "this is a bug" paths with
``logger.exception``), the garbage of layers a and b may cost at most one log line per
connection (DEBUG included), and the peer's RSS may grow by at most ``RSS_BOUND``.

Why the peer has its own process: the bound is on the peer's memory. hypothesis' example
generation and the attacker's buffers alone grew the test's process by 14 MiB in layer d and
by 32 MiB over the module (measured here), and by much more on a loaded machine; in one process
they were counted as the peer's.

Reproduce (about 30-60 s on 2 cores)::

    python -m pytest -q -p no:cacheprovider tests/p2p/test_fuzz.py -m sockets
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kit.errors import KitError
from kit.p2p import wire
from kit.p2p.channel import WEBSOCKET_MAX_SIZE
from kit.p2p.handshake import NONCE_SIZE, DialerHandshake, HandshakeSettings
from kit.p2p.identity import Identity
from kit.p2p.peer import create_peer
from kit.p2p.websocket import apply_mask
from kit.p2p.wire import FrameType
from kit.runtime import Runtime
from tests.conftest import TIMEOUT_FACTOR
from tests.p2p.fuzz_target import HEALTH_PATH, RUN_ID

pytestmark = [pytest.mark.sockets, pytest.mark.processes]

RSS_BOUND = 100 * 1024**2  # bytes the peer's process may grow by over the whole module
IO_TIMEOUT = 10.0 * TIMEOUT_FACTOR  # any single socket operation of the attacker
CLOSE_TIMEOUT = 10.0 * TIMEOUT_FACTOR  # after our EOF, the peer must hang up within this
SETTLE_TIMEOUT = 20.0 * TIMEOUT_FACTOR  # tasks and connections back to their baseline
START_TIMEOUT = 60.0 * TIMEOUT_FACTOR  # the peer's process prints its address
PARALLEL = 12  # attacking connections in flight at once
#: Inputs per layer (4 layers: 10,000 in total). Each hypothesis example is one batch.
PER_LAYER = 2500
BATCH = 10
ROOT = Path(__file__).resolve().parents[2]


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),  # shrinking against a live peer takes ages
        suppress_health_check=list(HealthCheck),
    )


# --- the live peer (another process) and its health ----------------------------------------------


@dataclass
class Target:
    runtime: Runtime  # the attacker's loop (this process)
    process: subprocess.Popen[str]
    address: str
    port: int
    baseline_tasks: int = 0
    baseline_rss: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    last_check: float = field(default_factory=time.perf_counter)
    layer_connections: int = 0  # attacking connections since the last check

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return self.runtime.call(coro, timeout=timeout * TIMEOUT_FACTOR)

    def count(self, key: str, amount: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + amount


async def health(target: Target, *, reset: bool = False) -> dict[str, Any]:
    """The peer's own report (``tests/p2p/fuzz_target.py``), over plain HTTP."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", target.port), IO_TIMEOUT
    )
    try:
        query = "?reset=1" if reset else ""
        writer.write(
            f"GET {HEALTH_PATH}{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        answer = await asyncio.wait_for(reader.read(), IO_TIMEOUT)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    result: dict[str, Any] = json.loads(body)
    return result


async def _round_trip(target: Target) -> None:
    """A fresh legitimate peer connects, calls, streams, and leaves."""
    client = await create_peer(run_id=RUN_ID)
    try:
        remote = await client.connect(target.address, timeout=IO_TIMEOUT)
        assert await client.call(remote, "echo", b"ping", timeout=IO_TIMEOUT) == b"ping"
        stream = await client.open_stream(remote, "stream", timeout=IO_TIMEOUT)
        await stream.send_message(b"abc", timeout=IO_TIMEOUT)
        assert await stream.receive_message(timeout=IO_TIMEOUT) == b"cba"
        await stream.close()
        assert await stream.receive_message(timeout=IO_TIMEOUT) is None
    finally:
        await client.shutdown()


async def _settle(target: Target, *, tasks: bool = True) -> dict[str, Any]:
    """Wait until connections (and ``tasks``) are back at baseline; returns what the peer last
    said. The baseline itself is taken with ``tasks=False``: once no connection is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT
    while True:
        seen = await health(target)
        settled = seen["connections"] == 0 and seen["websockets"] == 0
        if settled and (not tasks or len(seen["tasks"]) <= target.baseline_tasks):
            return seen
        if loop.time() > deadline:
            return seen
        await asyncio.sleep(0.05)


async def _fewest_tasks(target: Target) -> int:
    """The peer's task count at rest: the fewest seen in one second (closing tasks end)."""
    fewest = len((await health(target))["tasks"])
    for _ in range(10):
        await asyncio.sleep(0.1)
        fewest = min(fewest, len((await health(target))["tasks"]))
    return fewest


def check_health(target: Target, layer: str, *, lines_per_connection: int | None = None) -> None:
    target.stats[f"{layer}_seconds"] = round(time.perf_counter() - target.last_check)
    records = target.run(_settle(target), timeout=60)["records"]  # the layer's own log lines
    target.run(_round_trip(target), timeout=60)
    seen = target.run(_settle(target), timeout=60)
    assert (seen["connections"], seen["websockets"]) == (0, 0), (
        f"after layer {layer}: {seen['connections']} kit connections and {seen['websockets']} "
        "websockets still open"
    )
    tasks = seen["tasks"]
    assert len(tasks) <= target.baseline_tasks, (
        f"after layer {layer}: {len(tasks)} tasks, baseline {target.baseline_tasks}: {tasks[:6]}"
    )
    report = target.run(health(target, reset=True), timeout=60)  # each layer reports its own
    growth = report["rss"] - target.baseline_rss
    target.stats[f"rss_growth_after_{layer}"] = growth
    target.stats[f"{layer}_log_records"] = records
    assert growth < RSS_BOUND, f"after layer {layer}: RSS grew by {growth / 2**20:.1f} MiB"
    assert not report["errors"], f"after layer {layer}: errors logged: {report['errors'][:3]}"
    assert not report["tracebacks"], f"after layer {layer}: tracebacks: {report['tracebacks'][:3]}"
    assert not report["loop_errors"], (
        f"after layer {layer}: loop exception handler: {report['loop_errors'][:3]}"
    )
    if lines_per_connection is not None:  # garbage costs one line at most, DEBUG included
        assert records <= lines_per_connection * target.layer_connections, (
            f"after layer {layer}: {records} log records for {target.layer_connections} connections"
        )
    target.layer_connections = 0
    target.last_check = time.perf_counter()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.p2p.fuzz_target"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    runtime = Runtime("kit-fuzz")
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()  # bounded by the module's timeout
        assert address, "the fuzz target did not start (see its stderr above)"
        port = int(address.split("/tcp/")[1].split("/")[0])
        fuzz_target = Target(runtime, process, address, port)
        fuzz_target.run(_round_trip(fuzz_target), timeout=60)  # warm up: lazy state exists now
        fuzz_target.run(_settle(fuzz_target, tasks=False), timeout=60)
        fuzz_target.baseline_tasks = fuzz_target.run(_fewest_tasks(fuzz_target), timeout=60)
        fuzz_target.baseline_rss = fuzz_target.run(health(fuzz_target, reset=True))["rss"]
        fuzz_target.last_check = time.perf_counter()
        yield fuzz_target
        print(f"\nfuzz stats: {fuzz_target.stats}")  # the numbers for the report (pytest -s)
    finally:
        with contextlib.suppress(KitError):
            runtime.shutdown()
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()  # the target shuts down when its stdin closes
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# --- the raw attacker --------------------------------------------------------------------------


class PeerHung(AssertionError):
    """The peer did not hang up (or answer) within the timeout: a hang."""


class Attacker:
    """A plain TCP socket speaking hand-made HTTP and websocket frames (client side: masked)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Attacker:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT
        )
        return cls(reader, writer)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def upgrade(self, port: int) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        self.write(
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
        assert head.startswith(b"HTTP/1.1 101"), head[:100]

    def send_message(self, payload: bytes) -> None:
        """One valid, masked, binary websocket message."""
        self.write(ws_frame(0x2, payload))

    async def recv_message(self) -> bytes:
        """The next data message from the peer (unmasked server frames; control frames skipped)."""
        while True:
            first, second = await asyncio.wait_for(self.reader.readexactly(2), IO_TIMEOUT)
            length = second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
            payload = await asyncio.wait_for(self.reader.readexactly(length), IO_TIMEOUT)
            if first & 0x0F in (0x1, 0x2):
                return payload
            if first & 0x0F == 0x8:
                raise ConnectionError("peer sent a close frame")

    async def finish(self) -> None:
        """Send EOF, then the peer must close the connection: read and drop until it does."""
        with contextlib.suppress(OSError):
            if self.writer.can_write_eof():
                self.writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise PeerHung("the peer kept the connection open after our EOF")
                try:
                    chunk = await asyncio.wait_for(self.reader.read(65536), remaining)
                except asyncio.TimeoutError:
                    raise PeerHung("the peer kept the connection open after our EOF") from None
                except OSError:
                    return  # reset by the peer: closed too
                if not chunk:
                    return
        finally:
            self.writer.transport.abort()


def ws_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv: int = 0,
    masked: bool = True,
    declared: int | None = None,
    width: int | None = None,
) -> bytes:
    """A websocket frame, possibly lying: ``declared`` length, non-minimal length ``width``."""
    length = len(payload) if declared is None else declared
    first = (0x80 if fin else 0) | (rsv & 7) << 4 | (opcode & 0x0F)
    mask_bit = 0x80 if masked else 0
    width = width or (7 if length < 126 else 16 if length < 65536 else 64)
    if width == 7:
        header = struct.pack("!BB", first, mask_bit | min(length, 125))
    elif width == 16:
        header = struct.pack("!BBH", first, mask_bit | 126, length & 0xFFFF)
    else:
        header = struct.pack("!BBQ", first, mask_bit | 127, length & (2**64 - 1))
    if not masked:
        return header + payload
    key = os.urandom(4)
    body = bytearray(payload)
    apply_mask(body, key)
    return header + key + body


Attack = Callable[[Attacker], Awaitable[int]]


async def run_batch(target: Target, attacks: list[Attack]) -> int:
    """Run each attack on its own connection (PARALLEL at a time); returns the inputs sent."""
    port = target.port
    gate = asyncio.Semaphore(PARALLEL)

    async def one(attack: Attack) -> int:
        async with gate:
            attacker = await Attacker.open(port)
            try:
                sent = await attack(attacker)
            except (ConnectionError, asyncio.IncompleteReadError):
                sent = 1  # the peer hung up during the attack: that is a fine answer
            await attacker.finish()
            return sent

    sent = await asyncio.gather(*(one(attack) for attack in attacks))
    target.count("connections", len(attacks))
    target.layer_connections += len(attacks)
    return sum(sent)


# --- layer a: raw TCP and HTTP ------------------------------------------------------------------

HEADER_NAMES = ["Host", "Upgrade", "Connection", "Sec-WebSocket-Key", "Sec-WebSocket-Version"]
header_value = st.one_of(
    st.sampled_from(
        ["websocket", "Upgrade", "13", "8", "", "dGhlIHNhbXBsZSBub25jZQ==", "x" * 9000, "\x00\xff"]
    ),
    st.text(max_size=40),
)
http_request = st.builds(
    lambda method, path, version, headers, eol, cut: (
        f"{method} {path} {version}{eol}"
        + "".join(f"{name}: {value}{eol}" for name, value in headers)
        + eol
    ).encode("utf-8", "surrogatepass")[: cut if cut else None],
    method=st.sampled_from(["GET", "POST", "get", "GE T", "", "\x00", "GET" * 3000]),
    path=st.one_of(
        st.sampled_from(["/", "//", "*", "", "/%00", "/api/fuzz?%zz=&a=b&a", "/" + "a" * 10000]),
        st.text(max_size=30).map(lambda s: "/api/fuzz?" + s),
    ),
    version=st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/9.9", "", "HTTP/1.1 x"]),
    headers=st.lists(
        st.tuples(st.one_of(st.sampled_from(HEADER_NAMES), st.text(max_size=12)), header_value),
        max_size=8,
    ).map(lambda h: h * 40 if len(h) == 7 else h),  # sometimes far too many header lines
    eol=st.sampled_from(["\r\n", "\r\n", "\n", "\r"]),
    cut=st.one_of(st.just(0), st.integers(1, 200)),
)
raw_input = st.one_of(st.binary(max_size=300), http_request)


def send_raw(data: bytes) -> Attack:
    async def attack(attacker: Attacker) -> int:
        attacker.write(data)
        return 1

    return attack


def test_layer_a_raw_tcp_and_http(target: Target) -> None:
    @fuzz_settings(PER_LAYER // BATCH)
    @given(batch=st.lists(raw_input, min_size=BATCH, max_size=BATCH))
    def attack(batch: list[bytes]) -> None:
        target.count("a_inputs", target.run(run_batch(target, [send_raw(b) for b in batch])))

    attack()
    assert target.stats["a_inputs"] >= PER_LAYER * 0.9
    check_health(target, "a", lines_per_connection=1)


# --- layer b: websocket frames --------------------------------------------------------------------


@st.composite
def bad_ws_frame(draw: st.DrawFn) -> bytes:
    opcode = draw(st.sampled_from([0x0, 0x1, 0x2, 0x2, 0x3, 0x7, 0x8, 0x9, 0xA, 0xB, 0xF]))
    payload = draw(st.binary(max_size=200))
    lie = draw(
        st.sampled_from(["none", "rsv", "unmasked", "nofin", "long", "short", "huge", "wide"])
    )
    options: dict[str, Any] = {}
    if lie == "rsv":
        options["rsv"] = draw(st.integers(1, 7))
    elif lie == "unmasked":
        options["masked"] = False
    elif lie == "nofin":
        options["fin"] = False  # fragmented (control frames must not be)
    elif lie == "long":  # declares more than follows: truncated
        options["declared"] = len(payload) + draw(st.integers(1, 70_000))
    elif lie == "short":  # declares less: the rest parses as the next frame
        options["declared"] = draw(st.integers(0, len(payload)))
    elif lie == "huge":
        options["declared"] = draw(
            st.sampled_from(
                [WEBSOCKET_MAX_SIZE, WEBSOCKET_MAX_SIZE + 1, 2**31, 2**63 - 1, 2**64 - 1]
            )
        )
    elif lie == "wide":  # a small length in a non-minimal 16- or 64-bit encoding
        options["width"] = draw(st.sampled_from([16, 64]))
    if opcode >= 0x8 and draw(st.booleans()):
        payload += b"x" * 130  # control frame longer than 125 bytes
    return ws_frame(opcode, payload, **options)


def ws_attack(frames: list[bytes], after_hello: bool) -> Attack:
    async def attack(attacker: Attacker) -> int:
        port = attacker.writer.get_extra_info("peername")[1]
        await attacker.upgrade(port)
        if after_hello:  # past the HELLO the peer parses frames itself (kit.p2p.websocket)
            hello = DialerHandshake(Identity.generate(), HandshakeSettings(run_id=RUN_ID))
            attacker.send_message(hello.hello())
            await attacker.recv_message()
        attacker.write(b"".join(frames))
        return len(frames)

    return attack


def test_layer_b_websocket_frames(target: Target) -> None:
    frames_per_connection = 5

    @fuzz_settings(PER_LAYER // BATCH)
    @given(
        frames=st.lists(bad_ws_frame(), min_size=BATCH, max_size=BATCH),
        after_hello=st.lists(st.booleans(), min_size=2, max_size=2),
    )
    def attack(frames: list[bytes], after_hello: list[bool]) -> None:
        attacks = [
            ws_attack(
                frames[i : i + frames_per_connection], after_hello[i // frames_per_connection]
            )
            for i in range(0, BATCH, frames_per_connection)
        ]
        target.count("b_inputs", target.run(run_batch(target, attacks)))

    attack()
    assert target.stats["b_inputs"] >= PER_LAYER * 0.9
    check_health(target, "b", lines_per_connection=1)


# --- layer c: handshake messages ------------------------------------------------------------------

_IDENTITY = Identity.generate()  # the attacker's key in layer c (its signing is not the point)
_VALID_HELLO: dict[str, Any] = msgpack.unpackb(
    DialerHandshake(_IDENTITY, HandshakeSettings(run_id=RUN_ID)).hello()[wire.HEADER_SIZE :]
)
msgpack_value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.binary(max_size=40),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)
hello_field_value = st.one_of(
    msgpack_value,
    st.sampled_from(
        [
            0,
            2,
            -1,
            2**64 - 1,  # versions
            "other-run",
            "x" * 70_000,  # an oversized string (beyond the control frame limit)
            b"\0" * 31,
            b"\0" * 33,
            b"\0" * 32,  # key and nonce sizes
            b"c" * (16 * 1024 + 1),  # credentials over MAX_CREDENTIALS
            ["relay"] * 33,
            ["x" * 65],
            [1, 2],  # feature lists
            63 * 1024,
            2**40,
            16 * 1024**2 + 1,  # windows and frame sizes out of range
        ]
    ),
)


@st.composite
def bad_hello(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "drop", "extra", "garbage", "shape", "frame"]))
    body = dict(_VALID_HELLO)
    body["nonce"] = os.urandom(NONCE_SIZE)
    frame_type: int = FrameType.HELLO
    flags, stream_id = 0, 0
    if kind == "field":
        for key in draw(st.lists(st.sampled_from(sorted(body)), min_size=1, max_size=3)):
            body[key] = draw(hello_field_value)
    elif kind == "drop":
        del body[draw(st.sampled_from(sorted(body)))]
    elif kind == "extra":
        body[draw(st.text(max_size=10))] = draw(msgpack_value)
    elif kind == "frame":  # a well-formed hello in the wrong frame
        frame_type = draw(st.sampled_from([t for t in range(256) if t != FrameType.HELLO]))
        flags = draw(st.integers(0, 255))
        stream_id = draw(st.sampled_from([0, 1, 2**32 - 1]))
    if kind == "garbage":
        payload = draw(st.binary(max_size=200))
    elif kind == "shape":  # msgpack that is not a map, or a map with non-string keys
        payload = msgpack.packb(draw(st.one_of(msgpack_value, st.just({1: 2}))))
    else:
        payload = msgpack.packb(body, use_bin_type=True)
    if draw(st.integers(0, 9)) == 0:
        payload = payload[: draw(st.integers(0, len(payload)))]  # truncated
    return struct.pack("!BBI", frame_type, flags, stream_id) + payload


@st.composite
def bad_auth(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    """A corruption of the correct AUTH frame (which is only known once the peer answered)."""
    kind = draw(st.sampled_from(["flip", "length", "type", "other_key", "garbage", "valid"]))
    position = draw(st.integers(0, 10_000))
    value = draw(msgpack_value)
    garbage = draw(st.binary(max_size=100))
    frame_type = draw(st.sampled_from([1, 3, 4, 5, 6, 7, 8, 0, 255]))

    def corrupt(auth: bytes) -> bytes:
        signature = msgpack.unpackb(auth[wire.HEADER_SIZE :])["sig"]
        if kind == "flip":
            index = position % len(signature)
            signature = signature[:index] + bytes([signature[index] ^ 1]) + signature[index + 1 :]
            return wire.encode_control(FrameType.AUTH, 0, {"sig": signature})
        if kind == "length":
            return wire.encode_control(FrameType.AUTH, 0, {"sig": signature[: position % 64]})
        if kind == "type":
            return wire.encode_control(FrameType.AUTH, 0, {"sig": value})
        if kind == "other_key":  # a real signature, by the wrong key
            return wire.encode_control(FrameType.AUTH, 0, {"sig": Identity.generate().sign(b"x")})
        if kind == "garbage":
            return auth[: wire.HEADER_SIZE] + garbage
        if frame_type == FrameType.AUTH or kind == "valid":
            return auth  # occasionally the real thing: the connection must still end cleanly
        return struct.pack("!BBI", frame_type, 0, 0) + auth[wire.HEADER_SIZE :]

    return corrupt


def hello_attack(hello: bytes) -> Attack:
    async def attack(attacker: Attacker) -> int:
        await attacker.upgrade(attacker.writer.get_extra_info("peername")[1])
        attacker.send_message(hello)
        return 1

    return attack


def auth_attack(corrupt: Callable[[bytes], bytes]) -> Attack:
    async def attack(attacker: Attacker) -> int:
        await attacker.upgrade(attacker.writer.get_extra_info("peername")[1])
        handshake = DialerHandshake(_IDENTITY, HandshakeSettings(run_id=RUN_ID))
        attacker.send_message(handshake.hello())
        reply = wire.decode_frame(await attacker.recv_message(), 0)
        _, auth = handshake.receive_hello(reply)
        attacker.send_message(corrupt(auth))
        return 1

    return attack


def test_layer_c_handshake_messages(target: Target) -> None:
    @fuzz_settings(PER_LAYER // BATCH)
    @given(
        hellos=st.lists(bad_hello(), min_size=BATCH // 2, max_size=BATCH // 2),
        auths=st.lists(bad_auth(), min_size=BATCH // 2, max_size=BATCH // 2),
    )
    def attack(hellos: list[bytes], auths: list[Callable[[bytes], bytes]]) -> None:
        attacks = [hello_attack(h) for h in hellos] + [auth_attack(a) for a in auths]
        target.count("c_inputs", target.run(run_batch(target, attacks)))

    attack()
    assert target.stats["c_inputs"] >= PER_LAYER * 0.9
    check_health(target, "c")


# --- layer d: mux frames on an established connection ---------------------------------------------

stream_id = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 5, 7, 9, 2**31, 2**32 - 2, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
protocol_name = st.one_of(
    st.sampled_from(["echo", "stream", "nope", "", "p" * 201]), st.text(max_size=12)
)
reason = st.one_of(
    st.builds(
        lambda c, m: msgpack.packb({"code": c, "message": m}), st.text(max_size=70), st.text()
    ),
    msgpack_value.map(msgpack.packb),
    st.binary(max_size=40),
)


def header(frame_type: int, flags: int, sid: int) -> bytes:
    return struct.pack("!BBI", frame_type & 0xFF, flags & 0xFF, sid & 0xFFFFFFFF)


@st.composite
def bad_mux_frames(draw: st.DrawFn) -> list[bytes]:
    """One malformed input: usually one frame, sometimes a storm of them (counted as one input)."""
    kind = draw(
        st.sampled_from(
            ["open", "open", "data", "data", "credit", "reset", "connection", "unknown",
             "truncated", "random", "oversized", "credit_storm", "reset_storm", "open_storm"]
        )
    )  # fmt: skip
    sid = draw(stream_id)
    if kind == "open":
        payload = draw(
            st.one_of(
                protocol_name.map(lambda p: msgpack.packb({"protocol": p})),
                msgpack_value.map(msgpack.packb),
                st.binary(max_size=30),
            )
        )
        return [header(FrameType.OPEN, draw(st.sampled_from([0, 0, 1, 255])), sid) + payload]
    if kind == "data":
        flags = draw(st.sampled_from([0, 1, 2, 3, 4, 0x80, 0xFF]))
        return [header(FrameType.DATA, flags, sid) + draw(st.binary(max_size=300))]
    if kind == "credit":
        increment = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1]))
        payload = draw(st.sampled_from([struct.pack("!I", increment), b"", b"\0" * 5, b"\1\2"]))
        return [header(FrameType.CREDIT, 0, sid) + payload]
    if kind == "reset":
        return [header(FrameType.RESET, 0, sid) + draw(reason)]
    if kind == "connection":  # handshake or GOAWAY frames after the handshake
        frame_type = draw(st.sampled_from([FrameType.HELLO, FrameType.AUTH, FrameType.WELCOME]))
        frame_type = draw(st.sampled_from([frame_type, FrameType.GOAWAY]))
        return [header(frame_type, 0, draw(st.sampled_from([0, sid]))) + draw(reason)]
    if kind == "unknown":
        return [header(draw(st.sampled_from([0, *range(9, 256)])), 0, sid) + b"x"]
    if kind == "truncated":
        return [draw(st.binary(max_size=wire.HEADER_SIZE - 1))]
    if kind == "random":
        return [draw(st.binary(min_size=wire.HEADER_SIZE, max_size=200))]
    if kind == "oversized":  # DATA over max_frame, or a control frame over its limit
        if draw(st.booleans()):
            return [header(FrameType.DATA, 0, sid) + b"d" * (1024**2 + 1)]
        return [header(FrameType.RESET, 0, sid) + b"r" * (wire.MAX_CONTROL_PAYLOAD + 1)]
    opened = 2 * draw(st.integers(0, 1000)) + 1  # an odd id: the dialer's side
    opening = header(FrameType.OPEN, 0, opened) + msgpack.packb({"protocol": "stream"})
    if kind == "credit_storm":  # overflows the send credit (2**40) after ~256 frames
        return [opening] + [header(FrameType.CREDIT, 0, opened) + b"\xff" * 4] * 300
    if kind == "reset_storm":
        ids = draw(st.lists(stream_id, min_size=1, max_size=5))
        return [opening] + [header(FrameType.RESET, 0, i) + draw(reason) for i in ids] * 40
    # open_storm: streams of an unknown protocol, each refused, then more
    return [
        header(FrameType.OPEN, 0, opened + 2 * i) + msgpack.packb({"protocol": "nope"})
        for i in range(200)
    ]


@st.composite
def valid_prefix(draw: st.DrawFn) -> list[bytes]:
    """Legitimate traffic before the attack, so malformed frames meet streams in every state."""
    frames: list[bytes] = []
    for index in range(draw(st.integers(0, 3))):
        sid = 2 * index + 1
        frames.append(header(FrameType.OPEN, 0, sid) + msgpack.packb({"protocol": "stream"}))
        flags = draw(st.sampled_from([0, 1, 3]))  # partial, whole message, message + end
        frames.append(header(FrameType.DATA, flags, sid) + b"hello")
    return frames


def mux_attack(prefix: list[bytes], inputs: list[list[bytes]]) -> Attack:
    async def attack(attacker: Attacker) -> int:
        await attacker.upgrade(attacker.writer.get_extra_info("peername")[1])
        handshake = DialerHandshake(Identity.generate(), HandshakeSettings(run_id=RUN_ID))
        attacker.send_message(handshake.hello())
        _, auth = handshake.receive_hello(wire.decode_frame(await attacker.recv_message(), 0))
        attacker.send_message(auth)
        handshake.receive_welcome(wire.decode_frame(await attacker.recv_message(), 0))
        frames = [*prefix, *(frame for one in inputs for frame in one)]
        attacker.write(b"".join(ws_frame(0x2, frame) for frame in frames))
        return len(inputs)

    return attack


def test_layer_d_mux_frames(target: Target) -> None:
    per_connection = 5  # malformed inputs per established connection (most end it at the first)

    @fuzz_settings(PER_LAYER // BATCH)
    @given(
        inputs=st.lists(bad_mux_frames(), min_size=BATCH, max_size=BATCH),
        prefixes=st.lists(valid_prefix(), min_size=2, max_size=2),
    )
    def attack(inputs: list[list[bytes]], prefixes: list[list[bytes]]) -> None:
        attacks = [
            mux_attack(prefixes[i // per_connection], inputs[i : i + per_connection])
            for i in range(0, BATCH, per_connection)
        ]
        target.count("d_frames", sum(len(one) for one in inputs))
        target.count("d_inputs", target.run(run_batch(target, attacks)))

    attack()
    assert target.stats["d_inputs"] >= PER_LAYER * 0.9
    check_health(target, "d")

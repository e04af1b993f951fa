"""Garbage and half-closed connections to a peer's port cost one DEBUG line each at most, never a
traceback; kit's own bugs behind websockets (a failing HTTP route) are still logged in full."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os

import pytest

from kit.p2p.peer import HttpRequest, HttpResponse, create_peer
from kit.p2p.websockets_log import WebsocketsLog

pytestmark = pytest.mark.sockets


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def every_line(*names: str):  # type: ignore[no-untyped-def]
    """All records of these loggers, DEBUG included (as an organizer debugging would see)."""
    handler = Records()
    saved = []
    for name in names:
        log = logging.getLogger(name)
        saved.append((log, log.level))
        log.setLevel(logging.DEBUG)
        log.addHandler(handler)
    try:
        yield handler.records
    finally:
        for log, level in saved:
            log.removeHandler(handler)
            log.setLevel(level)


def upgrade(port: int, path: str = "/") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def send(port: int, data: bytes, ending: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    if ending == "half-close":
        writer.write_eof()
    elif ending == "abort":
        writer.transport.abort()
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(reader.read(), 5)
    writer.close()


async def test_garbage_and_half_closed_handshakes_cost_one_debug_line_each() -> None:
    peer = await create_peer(run_id="test", handshake_timeout=1.0)  # also the HTTP upgrade's

    async def slow_route(request: HttpRequest) -> HttpResponse:
        await asyncio.sleep(0.05)  # the half-close arrives while the route works
        return HttpResponse(body=b"{}")

    peer.add_http_route("/api/run", slow_route)
    port = peer.listen_port
    assert port is not None
    request = b"GET /api/run HTTP/1.1\r\nHost: x\r\n\r\n"
    inputs = [
        request + request,  # pipelined: websockets logged "unexpected internal error" + traceback
        b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)),
        upgrade(port) + os.urandom(64),  # garbage right after a valid upgrade
        upgrade(port)[:40],
        os.urandom(300),
        b"garbage\r\n\r\n",
    ]
    try:
        with every_line("kit", "websockets") as records:
            endings = ("half-close", "abort", "read")
            await asyncio.gather(
                *(send(port, data, ending) for data in inputs for ending in endings * 4)
            )
            connections = len(inputs) * len(endings) * 4
            await asyncio.sleep(0.5)  # the last connections are closed and logged
            lines = list(records)
    finally:
        await peer.shutdown()
    tracebacks = [r.getMessage() for r in lines if r.exc_info]
    loud = [f"{r.levelname} {r.getMessage()}" for r in lines if r.levelno > logging.DEBUG]
    assert not tracebacks, tracebacks[:3]
    assert not loud, loud[:3]
    assert len(lines) <= connections, f"{len(lines)} lines for {connections} connections"


async def test_failures_of_kits_own_callbacks_stay_loud() -> None:
    """A bug in kit's code behind websockets must not be hidden with the remote's noise."""
    with every_line("kit") as records:
        log = WebsocketsLog()
        try:
            raise RuntimeError("a bug in a route")
        except RuntimeError:
            log.error("process_request failed", exc_info=True)
            log.error("unexpected internal error", exc_info=True)  # the remote's doing
        log.info("connection open")
    by_level = [(r.levelname, r.getMessage(), bool(r.exc_info)) for r in records]
    assert by_level == [
        ("ERROR", "process_request failed", True),
        ("DEBUG", "websocket: unexpected internal error (RuntimeError: a bug in a route)", False),
    ]
    assert not WebsocketsLog().isEnabledFor(logging.DEBUG)  # websockets' per-frame chatter off

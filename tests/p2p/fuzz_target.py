"""The live peer of tests/p2p/test_fuzz.py, in its own process: ``python -m tests.p2p.fuzz_target``.

Runs one kit peer on kit's runtime loop (as kit runs it: uvloop when installed), serving ``echo``
(unary), ``stream`` (reversed echo) and ``/api/fuzz`` (an HTTP route), prints its address, and
serves until its stdin closes (so it never outlives the test). Its own process, so that the
memory the fuzz test bounds is this peer's: the attacker and hypothesis (whose example
generation alone grows the test process by tens of MiB) live in the test's process.

``GET /fuzz/health`` answers JSON: kit connections and open websockets (the health request's own
connection excluded), the asyncio tasks, the process RSS, and what was logged since the last
``?reset=1``: ERROR records (any logger), records carrying a traceback (any level), and how
many records ``kit`` and ``websockets`` wrote at all (DEBUG included), with the loop's exception
handler calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import psutil

from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.peer import HttpRequest, HttpResponse, Peer, create_peer
from kit.runtime import Runtime

RUN_ID = "fuzz"
HEALTH_PATH = "/fuzz/health"


class LogWatch(logging.Handler):
    """Counts every record of the watched loggers; keeps ERRORs and tracebacks (as text)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = 0
        self.errors: list[str] = []
        self.tracebacks: list[str] = []
        self.loop_errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        if record.levelno >= logging.ERROR and len(self.errors) < 20:
            self.errors.append(f"{record.name}: {record.getMessage()[:300]}")
        if record.exc_info and len(self.tracebacks) < 20:
            self.tracebacks.append(f"{record.name}: {record.getMessage()[:300]}")

    def reset(self) -> None:
        self.records, self.errors, self.tracebacks, self.loop_errors = 0, [], [], []


async def _echo(caller: PeerID, request: bytes) -> bytes:
    return request


async def _stream_echo(stream: StreamAPI) -> None:
    while (message := await stream.receive_message(timeout=5)) is not None:
        await stream.send_message(message[::-1], timeout=5)


async def _http_route(request: HttpRequest) -> HttpResponse:
    return HttpResponse(body=repr(sorted(request.query.items())).encode())


def _health(peer: Peer, watch: LogWatch) -> Any:
    async def health(request: HttpRequest) -> HttpResponse:
        server = peer._listener.server
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        body = {
            "connections": len(peer.connections),  # closed ones not yet forgotten too
            # this request's own connection is not open as a websocket (it is plain HTTP)
            "websockets": len(server.connections) if server is not None else 0,
            "tasks": [repr(t)[:200] for t in tasks],
            "rss": psutil.Process().memory_info().rss,
            "records": watch.records,
            "errors": watch.errors,
            "tracebacks": watch.tracebacks,
            "loop_errors": watch.loop_errors,
        }
        if request.query.get("reset") == "1":
            watch.reset()
        return HttpResponse(body=json.dumps(body).encode())

    return health


def main() -> int:
    watch = LogWatch()
    root = logging.getLogger()
    root.addHandler(watch)
    root.setLevel(logging.WARNING)
    for name in ("kit", "websockets"):  # every line they write counts, DEBUG included
        logging.getLogger(name).setLevel(logging.DEBUG)
    runtime = Runtime("kit-fuzz-target")
    runtime.loop.set_exception_handler(
        lambda loop, context: watch.loop_errors.append(str(context.get("message"))[:300])
    )

    async def start() -> Peer:
        peer = await create_peer(run_id=RUN_ID, handshake_timeout=5.0, request_timeout=5.0)
        peer.add_unary_handler("echo", _echo)
        peer.add_stream_handler("stream", _stream_echo)
        peer.add_http_route("/api/fuzz", _http_route)
        peer.add_http_route(HEALTH_PATH, _health(peer, watch))
        return peer

    peer = runtime.call(start(), timeout=30)
    print(peer.get_visible_addresses()[0], flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    runtime.call(peer.shutdown(), timeout=30)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

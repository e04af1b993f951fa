"""The one file that speaks ``websockets``: listening, dialing, plain HTTP routes, the takeover.

``websockets`` performs what it does well: the HTTP upgrade, TLS, proxies, and answering plain
HTTP GETs on the same port (the coordinator's API and dashboard). Once a websocket is open, kit
takes its transport over (``kit.p2p.websocket``: payloads read straight into their buffers,
2x websockets' throughput) unless ``fast_framing`` is off. What comes out is a
:class:`~kit.p2p.connection.Channel`: the peer (``kit.p2p.peer``) runs the handshake over it and
keeps the connection; this module never sees a kit frame beyond the dialer's first HELLO.

* :func:`dial` opens a websocket to an address and returns its channel.
* :class:`Listener` serves a port: upgrades become channels handed to the peer's callback,
  GETs of registered paths go to their :data:`HttpHandler`.

What this module does not do: handshakes (``kit.p2p.channel``), the connection registry and the
protocol handlers (``kit.p2p.peer``), kit's frame format (``kit.p2p.wire``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import logging
import socket
import ssl
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import websockets
import websockets.asyncio.client
import websockets.asyncio.server
from websockets.asyncio.connection import Connection as WebSocket
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.http11 import Response

from kit.address import Address
from kit.errors import (
    ConnectionLost,
    HandshakeRefused,
    KitTimeout,
    KitUsageError,
    MalformedFrame,
    PeerError,
    PeerUnavailable,
)
from kit.p2p.channel import refuse, websocket_max_size
from kit.p2p.connection import Channel
from kit.p2p.hole_punch import reuse_port_socket
from kit.p2p.identity import PeerID
from kit.p2p.options import PeerOptions
from kit.p2p.stream import Message, message_bytes, wait_bounded
from kit.p2p.websocket import FastWebSocketChannel
from kit.p2p.websockets_log import WEBSOCKETS_LOG
from kit.p2p.wire import Refusal

logger = logging.getLogger(__name__)

_WEBSOCKETS_VERSION = tuple(
    int(part) for part in websockets.__version__.split(".")[:2] if part.isdigit()
)


@dataclass(frozen=True)
class HttpRequest:
    """A plain HTTP GET that reached a peer's listening port (not a websocket upgrade)."""

    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    remote_host: str


@dataclass(frozen=True)
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


HttpHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]
#: What the listener does with each accepted channel: handshake, then serve until it closes.
ChannelHandler = Callable[[Channel], Awaitable[None]]


class WebSocketChannel:
    """A websocket connection as a :class:`~kit.p2p.connection.Channel`."""

    def __init__(
        self, websocket: WebSocket, remote_address: str, remote_host: str | None = None
    ) -> None:
        self._websocket = websocket
        self.remote_address = remote_address
        self.remote_host = remote_host  # the IP we see the remote side at (accepted connections)

    async def send(self, data: Message) -> None:
        try:
            await self._websocket.send(message_bytes(data))
        except ConnectionClosed as e:
            raise ConnectionLost(
                f"websocket to {self.remote_address} closed: {_describe(e)}"
            ) from None

    async def recv(self) -> bytes:
        try:
            data = await self._websocket.recv(decode=False)
        except ConnectionClosed as e:
            raise ConnectionLost(
                f"websocket to {self.remote_address} closed: {_describe(e)}"
            ) from None
        return data

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._websocket.close(), 2.0)

    def write_buffer_size(self) -> int:
        """Bytes written but not yet handed to the kernel (for memory accounting)."""
        return int(self._websocket.transport.get_write_buffer_size())


def _describe(error: ConnectionClosed) -> str:
    close = error.rcvd or error.sent
    if close is None:
        return "connection lost without a close frame"
    return f"code {close.code}" + (f" ({close.reason})" if close.reason else "")


# --- dialing ----------------------------------------------------------------------------------


async def dial(
    address: Address, options: PeerOptions, timeout: float, *, local_port: int | None = None
) -> Channel:
    """Open a websocket to ``address.url`` and return it as a channel (taken over by kit's
    framing unless ``options.fast_framing`` is off).

    ``local_port``: leave from this port, shared with other sockets (``SO_REUSEPORT``): a
    client-mode peer's punch port, so that its NAT shows every peer one mapping
    (``kit.p2p.hole_punch``). Where that cannot be (a proxy in the way, the port busy towards
    this address), the connection leaves from any port.

    Raises:
        PeerUnavailable: nothing answers there, or not with a websocket.
        MalformedFrame: the listener sent frames before the dialer's HELLO.
    """
    ssl_context = (options.client_ssl or ssl.create_default_context()) if address.secure else None
    connection_options: dict[str, Any] = {}
    if local_port is not None and not _proxied():
        sock = await _from_port(address, local_port, timeout)
        if sock is not None:
            connection_options["sock"] = sock
            if ssl_context is not None:
                connection_options["server_hostname"] = address.host
    try:
        websocket = await websockets.asyncio.client.connect(
            address.url,
            compression=None,
            max_size=websocket_max_size(options.limits.max_frame),
            max_queue=4,
            write_limit=2**20,
            open_timeout=timeout,
            ping_interval=None if options.fast_framing else options.keepalive_interval,
            ping_timeout=options.keepalive_timeout,
            ssl=ssl_context,
            logger=WEBSOCKETS_LOG,
            **(connection_options or _proxy_options(address)),
        )
    except (OSError, EOFError, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as e:
        if "sock" in connection_options:
            connection_options["sock"].close()
        # (websockets 13 lets EOFError out when the remote side hangs up mid-upgrade.)
        raise PeerUnavailable(
            f"cannot open a websocket to {address.url}: {type(e).__name__}: {e}"
        ) from None
    if not options.fast_framing:
        return WebSocketChannel(websocket, address.url)
    # The listener sends nothing before our HELLO, so nothing is buffered in websockets yet.
    try:
        # Through an HTTP proxy, keep RFC 6455's masking: a proxy may parse the frames.
        proxied = "sock" not in connection_options and _proxied() and _proxy_options(address) == {}
        return _take_over(
            websocket,
            options,
            is_client=True,
            remote_address=address.url,
            remote_host=None,
            plain_possible=not proxied,
        )
    except PeerError:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(websocket.close(), 1.0)
        raise


def _proxied() -> bool:
    """An HTTP(S) proxy is configured: connections go through it (no punch port then)."""
    return any(name in urllib.request.getproxies() for name in ("http", "https", "all"))


async def _from_port(address: Address, local_port: int, timeout: float) -> socket.socket | None:
    """A TCP connection to ``address`` from ``local_port`` (None: that cannot be done here)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM), timeout
        )
    except (OSError, asyncio.TimeoutError):
        return None  # the plain dial reports it
    for *_, where in infos:
        try:
            sock = reuse_port_socket(str(where[0]), local_port)
        except OSError:
            continue
        try:
            await asyncio.wait_for(loop.sock_connect(sock, where[:2]), timeout)
        except OSError as e:
            sock.close()
            if e.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                # Our port's last connection there is still in TIME_WAIT: any port will do.
                logger.debug("dialing %s from port %d: %s", address, local_port, e)
                return None
            raise PeerUnavailable(f"cannot connect to {address}: {e}") from None
        except asyncio.TimeoutError:
            sock.close()
            raise PeerUnavailable(f"cannot connect to {address}: timed out") from None
        return sock
    return None


def _take_over(
    websocket: Any,
    options: PeerOptions,
    *,
    is_client: bool,
    remote_address: str,
    remote_host: str | None,
    pending: tuple[bytes, ...] = (),
    plain_possible: bool = True,
) -> FastWebSocketChannel:
    early = _received_beyond(websocket)
    if early:  # the remote did not wait for its turn (see callers): never lose them silently
        raise MalformedFrame(
            f"{remote_address} sent {early} bytes or messages out of turn in the handshake "
            "- help: upgrade kit on that side"
        )
    return FastWebSocketChannel(
        websocket.transport,
        is_client=is_client,
        remote_address=remote_address,
        remote_host=remote_host,
        max_size=websocket_max_size(options.limits.max_frame),
        keepalive_interval=options.keepalive_interval,
        keepalive_timeout=options.keepalive_timeout,
        on_lost=websocket.connection_lost,
        pending=pending,
        plain_possible=plain_possible and options.plain_frames,
    )


# --- listening --------------------------------------------------------------------------------


class Listener:
    """A peer's listening port: websocket upgrades become channels, plain GETs go to routes.

    Args:
        options: where to listen (``host``, ``port``, TLS) and the websocket limits.
        accept: called with each accepted channel; it runs the handshake and returns when the
            connection is over (websockets keeps the socket until then).
    """

    def __init__(self, options: PeerOptions, accept: ChannelHandler) -> None:
        self.options = options
        self._accept = accept
        self._server: websockets.asyncio.server.Server | None = None
        self._routes: dict[str, HttpHandler] = {}
        self.addresses: list[Address] = []  # where it listens, once started

    @property
    def server(self) -> websockets.asyncio.server.Server | None:
        """websockets' server while listening (diagnostics: its open connections)."""
        return self._server

    async def start(self, peer_id: PeerID) -> None:
        ssl_context = None
        if self.options.tls_certfile:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.options.tls_certfile, self.options.tls_keyfile)
        self._server = await websockets.asyncio.server.serve(
            self._serve_websocket,
            self.options.host,
            self.options.port,
            compression=None,  # permessage-deflate costs 20x throughput on tensors (measured here)
            max_size=websocket_max_size(self.options.limits.max_frame),
            max_queue=4,
            write_limit=2**20,
            ping_interval=None if self.options.fast_framing else self.options.keepalive_interval,
            ping_timeout=self.options.keepalive_timeout,
            close_timeout=1.0,
            open_timeout=self.options.handshake_timeout,  # slowloris: the HTTP upgrade too
            ssl=ssl_context,
            process_request=self._serve_http,
            logger=WEBSOCKETS_LOG,  # what strangers cause: one DEBUG line each, no traceback
        )
        secure = ssl_context is not None
        for sock in self._server.sockets:
            host, port = sock.getsockname()[:2]
            self.addresses.append(Address(host, port, secure, "/", peer_id))

    async def stop(self) -> None:
        server, self._server = self._server, None
        self.addresses = []
        if server is not None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    def add_route(self, path: str, handler: HttpHandler) -> None:
        """Answer plain HTTP GETs of ``path`` on the listening port."""
        if not path.startswith("/") or path in self._routes:
            raise KitUsageError(f"HTTP route {path!r} must start with / and be registered once")
        self._routes[path] = handler

    async def _serve_http(self, connection: Any, request: Any) -> Any:
        path, _, query = request.path.partition("?")
        handler = self._routes.get(path)
        # get_all, not get: a repeated Upgrade header made get() raise MultipleValuesError,
        # logged by websockets as an ERROR per request (found by tests/p2p/test_fuzz.py).
        upgrade = any(v.lower() == "websocket" for v in request.headers.get_all("Upgrade"))
        if handler is None or upgrade:
            # A websocket upgrade (peers dial "/", where the dashboard's page also lives), or
            # websockets' own 426 answer.
            return None
        host = connection.remote_address[0] if connection.remote_address else ""
        http_request = HttpRequest(
            path=path,
            query=dict(urllib.parse.parse_qsl(query)),
            headers={name.lower(): value for name, value in request.headers.raw_items()},
            remote_host=host,
        )
        try:
            response = await asyncio.wait_for(handler(http_request), self.options.request_timeout)
        except Exception as e:
            logger.warning("HTTP %s failed: %r", path, e)
            response = HttpResponse(
                500, f"internal error: {type(e).__name__}".encode(), "text/plain"
            )
        headers = Headers(
            [("Content-Type", response.content_type), ("Content-Length", str(len(response.body)))]
        )
        for name, value in response.headers:
            headers[name] = value
        return Response(
            response.status, http.HTTPStatus(response.status).phrase, headers, response.body
        )

    async def _serve_websocket(self, websocket: websockets.asyncio.server.ServerConnection) -> None:
        host, port = websocket.remote_address[:2]
        channel: Channel = WebSocketChannel(websocket, f"{host}:{port}", remote_host=host)
        if self.options.fast_framing:
            try:
                channel = await self._take_over_accepted(websocket, channel, host)
            except (HandshakeRefused, PeerError, KitTimeout) as e:
                # Anyone can send garbage or half a handshake: one DEBUG line each, never more.
                logger.debug("refused connection from %s: %s", channel.remote_address, e)
                return
            except Exception as e:
                logger.debug(
                    "handshake with %s failed: %s: %s", channel.remote_address, type(e).__name__, e
                )
                return
        await self._accept(channel)

    async def _take_over_accepted(
        self, websocket: Any, channel: Channel, host: str
    ) -> FastWebSocketChannel:
        # The dialer sends its HELLO and then waits for ours: once websockets has handed us that
        # one message, nothing else is in flight, and we take the transport over.
        hello = await wait_bounded(
            channel.recv(), self.options.handshake_timeout, "waiting for HELLO"
        )
        if _received_beyond(websocket):  # e.g. HELLO and AUTH in one write: refuse now
            refusal = HandshakeRefused(
                Refusal.PROTOCOL.value,
                "frames arrived after the HELLO, before ours: a dialer must wait for our "
                "HELLO (its AUTH signs our nonce) - help: upgrade kit on the dialing side",
            )
            await refuse(channel, refusal)
            raise refusal
        return _take_over(
            websocket,
            self.options,
            is_client=False,
            remote_address=channel.remote_address,
            remote_host=host,
            pending=(hello,),
        )


def _received_beyond(websocket: Any) -> int:
    """Bytes and messages ``websockets`` holds that nobody has read yet (0 before a takeover)."""
    buffered = len(websocket.protocol.reader.buffer)
    frames = getattr(getattr(websocket, "recv_messages", None), "frames", None)
    try:
        queued = len(frames) if frames is not None else 0
    except TypeError:  # another websockets version's queue: the raw buffer check remains
        queued = 0
    return buffered + queued


def _proxy_options(address: Address) -> dict[str, Any]:
    """websockets >= 15 dials through the HTTP(S) proxy of the environment, as volunteers behind
    proxies need; never for loopback addresses. Older websockets (13, 14) have no proxy support."""
    if _WEBSOCKETS_VERSION < (15,):
        return {}
    return {"proxy": None} if address.host in ("127.0.0.1", "::1", "localhost") else {}


__all__ = [
    "HttpHandler",
    "HttpRequest",
    "HttpResponse",
    "Listener",
    "WebSocketChannel",
    "dial",
]

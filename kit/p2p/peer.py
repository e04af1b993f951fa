"""A running peer: listens (unless in client mode), dials, keeps one connection per remote peer,
and serves protocol handlers. Implements :class:`kit.p2p.api.PeerAPI`.

Start one with :func:`create_peer`. Choosing where to listen:

* ``host="127.0.0.1"`` (the default) accepts connections from this machine only: tests, demos.
* ``host="0.0.0.0"`` accepts them on every interface: a public DHT/bootstrap peer or a home PC
  with a forwarded port. Pass ``announce=["/ip4/<public ip>/tcp/<port>/ws"]`` when the address
  others must dial differs from the listening one (NAT with port forwarding, reverse proxies).
* ``client_mode=True`` opens no listening socket at all (Colab, Kaggle): the peer keeps outbound
  connections to relays and is reachable at relayed addresses. ``client_mode=None`` decides by
  itself: it listens, asks an initial peer to dial it back, and falls back to client mode when
  that fails.

TLS: pass ``tls_certfile``/``tls_keyfile`` to serve ``wss://``; dialing ``wss://`` verifies the
certificate by default (``client_ssl`` for a custom CA).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import os
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import websockets
import websockets.asyncio.client
import websockets.asyncio.server
from websockets.datastructures import Headers
from websockets.exceptions import InvalidHandshake, InvalidURI
from websockets.http11 import Response

from kit.errors import (
    AuthError,
    HandshakeRefused,
    KitTimeout,
    KitUsageError,
    MalformedFrame,
    PeerError,
    PeerUnavailable,
    RemoteProtocolError,
    Revoked,
)
from kit.p2p import reachability, relay
from kit.p2p.address import Address, parse_address
from kit.p2p.api import DEFAULT_MAX_MESSAGE, StreamHandler, UnaryHandler
from kit.p2p.channel import (
    Authorizer,
    OpenAuthorizer,
    WebSocketChannel,
    accept_handshake,
    dial_handshake,
    refuse,
    websocket_max_size,
)
from kit.p2p.connection import Channel, Connection, Stream, wait_bounded
from kit.p2p.frame_auth import AuthenticatedChannel
from kit.p2p.handshake import HandshakeSettings, RemoteHello
from kit.p2p.identity import Identity, IdentityLock, PeerID, load_identity
from kit.p2p.mux import MuxLimits
from kit.p2p.relay import RelayLimits
from kit.p2p.websocket import FastWebSocketChannel
from kit.p2p.websockets_log import WEBSOCKETS_LOG
from kit.p2p.wire import Refusal, ResetCode

logger = logging.getLogger(__name__)

_WEBSOCKETS_VERSION = tuple(
    int(part) for part in websockets.__version__.split(".")[:2] if part.isdigit()
)
MAX_ADDRESSES_PER_PEER = 8
MAX_ADDRESS_BOOK = 10_000
RELAY_FRAME_MARGIN = 64
#: A hello with this feature is a reachability probe: the listener answers the handshake, then
#: hangs up without keeping the connection (see kit.p2p.reachability).
PROBE_FEATURE = "probe"


@dataclass(frozen=True)
class PeerOptions:
    """How a peer listens, dials and limits its peers. Every field has a working default."""

    run_id: str = "kit"  # peers of other runs are refused at the handshake
    config_hash: str = (
        ""  # hash of the run config; peers with another one are refused ("" = no check)
    )
    host: str = "127.0.0.1"  # where to listen; "0.0.0.0" = every interface (public peers)
    port: int = 0  # 0 = any free port
    announce: tuple[str, ...] = ()  # addresses others should dial, if not the listening one
    client_mode: bool | None = False  # True = no listening socket (NAT); None = detect by dial-back
    relay_service: bool = False  # relay streams for client-mode peers (public peers, coordinators)
    relays: tuple[
        str, ...
    ] = ()  # relays a client-mode peer registers with (default: initial peers)
    relay_limits: RelayLimits = field(default_factory=RelayLimits)  # what a relay grants each peer
    tls_certfile: str | None = None  # serve wss:// with this certificate chain (PEM)
    tls_keyfile: str | None = None  # ... and this private key (PEM)
    client_ssl: ssl.SSLContext | None = (
        None  # for dialing wss://; None = system CAs, verification on
    )
    limits: MuxLimits = field(default_factory=MuxLimits)  # per-connection stream and flow limits
    handshake_timeout: float = 10.0  # increase if you see handshake timeouts on slow links
    dial_timeout: float = 10.0  # TCP + websocket opening; increase on very slow links
    keepalive_interval: float = (
        20.0  # websocket pings; a dead peer is noticed after interval+timeout
    )
    keepalive_timeout: float = 20.0
    request_timeout: float = 30.0  # how long a unary handler may wait for the caller's request
    idle_timeout: float = 300.0  # close connections without streams for this long (0 = never)
    frame_auth: bool = False  # MAC every frame (on by itself with a private-run authorizer)
    fast_framing: bool = True  # kit's own zero-copy websocket framing after the upgrade (2x faster)


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


class Peer:
    """A running kit peer. Create it with :func:`create_peer`; stop it with :meth:`shutdown`."""

    def __init__(
        self, identity: Identity, options: PeerOptions, authorizer: Authorizer | None = None
    ) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.options = options
        self.authorizer: Authorizer = authorizer or OpenAuthorizer()
        self._identity_lock: IdentityLock | None = None
        self._client_mode = bool(options.client_mode)
        self._server: websockets.asyncio.server.Server | None = None
        self._listen_addresses: list[Address] = []
        self._connections: dict[PeerID, Connection] = {}
        self._all_connections: set[Connection] = set()
        self._dials: dict[str, asyncio.Future[PeerID]] = {}
        self._address_book: dict[PeerID, list[Address]] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._http_routes: dict[str, HttpHandler] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.relay_client: relay.RelayClient | None = None  # in client mode
        self.relay_service: relay.RelayService | None = None  # on relays

    # --- lifecycle -----------------------------------------------------------------------

    async def _start(self, initial_peers: Sequence[str]) -> None:
        attach = getattr(self.authorizer, "attach", None)
        if callable(attach):  # private runs: re-check established connections (kit.auth)
            attach(self)
        if self.options.relay_service:
            self.relay_service = relay.RelayService(self, self.options.relay_limits)
        reachability.serve_dialback(self)
        if self.options.idle_timeout > 0:
            self.spawn(self._close_idle_connections(), "idle-pruning")
        if not self._client_mode:
            await self._listen()
        if self.options.client_mode is None and initial_peers:
            reachable = await reachability.check_reachable(self, initial_peers)
            if not reachable:
                logger.info("not reachable from outside: switching to client mode (relayed)")
                await self._stop_listening()
                self._client_mode = True
        if self._client_mode:
            relays = list(self.options.relays) or list(initial_peers)
            self.relay_client = client = relay.RelayClient(self, relays)
            await client.start()
        else:
            for address in initial_peers:
                try:
                    await self.connect(address, timeout=self.options.dial_timeout)
                except (PeerError, AuthError, KitTimeout) as e:
                    logger.warning("initial peer %s unavailable: %s", address, e)

    async def _listen(self) -> None:
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
            self._listen_addresses.append(Address(host, port, secure, "/", self.peer_id))
        logger.info(
            "%s listening on %s", self.peer_id.short(), ", ".join(map(str, self._listen_addresses))
        )

    async def _stop_listening(self) -> None:
        server, self._server = self._server, None
        self._listen_addresses = []
        if server is not None:
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    async def shutdown(self) -> None:
        """Close every connection and the listening socket, cancel every task (bounded)."""
        if self._closing:
            return
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        relay_client = self.relay_client
        if relay_client is not None:
            await relay_client.stop()
        connections = list(self._all_connections)
        for connection in connections:
            connection.close(Refusal.SHUTDOWN, "peer shutting down")
        await self._stop_listening()
        if connections:
            await asyncio.wait(
                [asyncio.ensure_future(c.wait_closed(2.0)) for c in connections], timeout=3.0
            )
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._identity_lock is not None:
            self._identity_lock.release()
        logger.debug("%s shut down", self.peer_id.short())

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # --- PeerAPI -------------------------------------------------------------------------

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    def get_visible_addresses(self) -> list[str]:
        if self._client_mode:
            client = self.relay_client
            return [str(a) for a in client.relayed_addresses()] if client is not None else []
        if self.options.announce:
            return [str(self._with_own_id(parse_address(a))) for a in self.options.announce]
        return [str(a) for a in self._listen_addresses]

    def _with_own_id(self, address: Address) -> Address:
        return address if address.peer_id is not None else address.with_peer_id(self.peer_id)

    @property
    def listen_port(self) -> int | None:
        return self._listen_addresses[0].port if self._listen_addresses else None

    def add_address(self, peer_id: PeerID, address: str | Address) -> None:
        parsed = parse_address(address) if isinstance(address, str) else address
        if parsed.peer_id is not None and parsed.peer_id != peer_id:
            return
        if peer_id == self.peer_id:
            return
        known = self._address_book.setdefault(peer_id, [])
        parsed = parsed.with_peer_id(peer_id) if parsed.relay is None else parsed
        if parsed in known:
            known.remove(parsed)
        known.insert(0, parsed)
        del known[MAX_ADDRESSES_PER_PEER:]
        if len(self._address_book) > MAX_ADDRESS_BOOK:
            self._address_book.pop(next(iter(self._address_book)))

    def add_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        if protocol in self._stream_handlers:
            raise KitUsageError(f"protocol {protocol!r} already has a handler")
        self._stream_handlers[protocol] = handler  # type: ignore[assignment]

    def add_unary_handler(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = DEFAULT_MAX_MESSAGE
    ) -> None:
        async def serve(stream: Stream) -> None:
            request = await stream.receive_message(
                max_size=max_request, timeout=self.options.request_timeout
            )
            if request is None:
                raise RemoteProtocolError(f"{protocol}: the caller closed without a request")
            response = await handler(stream.remote_peer, request)
            await stream.send_message(response, timeout=self.options.request_timeout)

        self.add_stream_handler(protocol, serve)  # type: ignore[arg-type]

    async def call(
        self,
        peer_id: PeerID,
        protocol: str,
        request: bytes,
        *,
        timeout: float,
        max_response: int = DEFAULT_MAX_MESSAGE,
    ) -> bytes:
        stream = await self.open_stream(peer_id, protocol, timeout=timeout)
        try:
            await stream.send_message(request, timeout=timeout)
            await stream.close()
            response = await stream.receive_message(max_size=max_response, timeout=timeout)
        except BaseException as e:
            stream.reset(
                ResetCode.TIMEOUT if isinstance(e, KitTimeout) else ResetCode.CANCELLED,
                type(e).__name__,
            )
            raise
        if response is None:
            raise RemoteProtocolError(
                f"{protocol}: {peer_id.short()} closed the stream without a response"
            )
        return response

    async def open_stream(self, peer_id: PeerID, protocol: str, *, timeout: float) -> Stream:
        connection = await self._connection_to(peer_id, timeout)
        return await connection.open_stream(protocol)

    async def connect(self, address: str | Address, *, timeout: float) -> PeerID:
        parsed = parse_address(address) if isinstance(address, str) else address
        if parsed.peer_id is not None:
            existing = self._connections.get(parsed.peer_id)
            if existing is not None and not existing.closed:
                return parsed.peer_id
        key = str(parsed)
        pending = self._dials.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._dial(parsed, timeout))
            self._dials[key] = pending
            pending.add_done_callback(lambda _: self._dials.pop(key, None))
            pending.add_done_callback(_consume_exception)
        return await wait_bounded(asyncio.shield(pending), timeout, f"dialing {parsed}")

    def all_connections(self) -> list[Connection]:
        """Every open connection, including ones draining after a duplicate was replaced."""
        return [connection for connection in self._all_connections if not connection.closed]

    def connected_peers(self) -> list[PeerID]:
        return [p for p, c in self._connections.items() if not c.closed]

    def connection(self, peer_id: PeerID) -> Connection | None:
        connection = self._connections.get(peer_id)
        return connection if connection is not None and not connection.closed else None

    # --- dialing and accepting -----------------------------------------------------------

    async def _connection_to(self, peer_id: PeerID, timeout: float) -> Connection:
        if peer_id == self.peer_id:
            raise KitUsageError("a peer cannot open a stream to itself")
        connection = self.connection(peer_id)
        if connection is not None and not connection.draining:
            return connection
        errors = []
        # Direct addresses first: a relayed path costs the relay's bandwidth.
        for address in sorted(
            self._address_book.get(peer_id, []), key=lambda a: a.relay is not None
        ):
            try:
                await self.connect(address, timeout=timeout)
            except (PeerError, AuthError, KitTimeout) as e:
                errors.append(f"{address}: {e}")
                continue
            connection = self.connection(peer_id)
            if connection is not None:
                return connection
        if connection is not None:
            return connection  # draining but alive
        detail = "; ".join(errors) if errors else "no known address"
        raise PeerUnavailable(f"cannot reach {peer_id}: {detail}")

    async def _dial(self, address: Address, timeout: float) -> PeerID:
        if self._closing:
            raise PeerUnavailable("this peer is shutting down")
        if address.relay is not None:
            channel: Channel = await relay.open_relayed_channel(self, address, timeout)
        else:
            channel = await self._open_websocket(address, min(timeout, self.options.dial_timeout))
        settings = self._handshake_settings(relayed=address.relay is not None)
        remote, keys = await dial_handshake(
            channel,
            self.identity,
            settings,
            self.authorizer,
            expected_peer=address.peer_id,
            timeout=min(timeout, self.options.handshake_timeout),
        )
        if settings.frame_auth or remote.frame_auth:
            channel = AuthenticatedChannel(channel, keys)
        self._register(channel, remote, is_dialer=True)
        if address.relay is None or address.peer_id is None:
            self.add_address(remote.peer_id, address)
        return remote.peer_id

    async def _open_websocket(self, address: Address, timeout: float) -> Channel:
        ssl_context = (
            (self.options.client_ssl or ssl.create_default_context()) if address.secure else None
        )
        try:
            websocket = await websockets.asyncio.client.connect(
                address.url,
                compression=None,
                max_size=websocket_max_size(self.options.limits.max_frame),
                max_queue=4,
                write_limit=2**20,
                open_timeout=timeout,
                ping_interval=None
                if self.options.fast_framing
                else self.options.keepalive_interval,
                ping_timeout=self.options.keepalive_timeout,
                ssl=ssl_context,
                logger=WEBSOCKETS_LOG,
                **_proxy_options(address),
            )
        except (OSError, EOFError, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as e:
            # (websockets 13 lets EOFError out when the remote side hangs up mid-upgrade.)
            raise PeerUnavailable(
                f"cannot open a websocket to {address.url}: {type(e).__name__}: {e}"
            ) from None
        if not self.options.fast_framing:
            return WebSocketChannel(websocket, address.url)
        # The listener sends nothing before our HELLO, so nothing is buffered in websockets yet.
        try:
            return self._take_over(
                websocket, is_client=True, remote_address=address.url, remote_host=None
            )
        except PeerError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(websocket.close(), 1.0)
            raise

    def _take_over(
        self,
        websocket: Any,
        *,
        is_client: bool,
        remote_address: str,
        remote_host: str | None,
        pending: tuple[bytes, ...] = (),
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
            max_size=websocket_max_size(self.options.limits.max_frame),
            keepalive_interval=self.options.keepalive_interval,
            keepalive_timeout=self.options.keepalive_timeout,
            on_lost=websocket.connection_lost,
            pending=pending,
        )

    def add_http_route(self, path: str, handler: HttpHandler) -> None:
        """Answer plain HTTP GETs of ``path`` on the listening port (the coordinator's API and
        dashboard share the port, and the TLS certificate, of its websocket endpoint)."""
        if not path.startswith("/") or path in self._http_routes:
            raise KitUsageError(f"HTTP route {path!r} must start with / and be registered once")
        self._http_routes[path] = handler

    async def _serve_http(self, connection: Any, request: Any) -> Any:
        path, _, query = request.path.partition("?")
        handler = self._http_routes.get(path)
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
        settings = self._handshake_settings()
        try:
            if self.options.fast_framing:
                # The dialer sends its HELLO and then waits for ours: once websockets has handed
                # us that one message, nothing else is in flight, and we take the transport over.
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
                channel = self._take_over(
                    websocket,
                    is_client=False,
                    remote_address=channel.remote_address,
                    remote_host=host,
                    pending=(hello,),  # type: ignore[arg-type]
                )
            remote, keys = await accept_handshake(
                channel,
                self.identity,
                settings,
                self.authorizer,
                timeout=self.options.handshake_timeout,
            )
        except (HandshakeRefused, PeerError, KitTimeout) as e:
            # Anyone can send garbage or half a handshake: one DEBUG line each, never more. A
            # banned user coming back holds a token signed by the authority: the organizer's news.
            level = logging.INFO if isinstance(e.__cause__, Revoked) else logging.DEBUG
            logger.log(level, "refused connection from %s: %s", channel.remote_address, e)
            return
        except Exception as e:
            logger.debug(
                "handshake with %s failed: %s: %s", channel.remote_address, type(e).__name__, e
            )
            return
        if PROBE_FEATURE in remote.features:
            await channel.close()  # a dial-back probe: it only wanted to see that we answer
            return
        if settings.frame_auth or remote.frame_auth:
            channel = AuthenticatedChannel(channel, keys)
        connection = self._register(channel, remote, is_dialer=False)
        await connection.wait_closed(timeout=None)

    async def accept_channel(self, channel: Channel) -> None:
        """Run the listener's handshake on a channel a relay handed us, then serve it."""
        settings = self._handshake_settings(relayed=True)
        remote, keys = await accept_handshake(
            channel,
            self.identity,
            settings,
            self.authorizer,
            timeout=self.options.handshake_timeout,
        )
        if settings.frame_auth or remote.frame_auth:
            channel = AuthenticatedChannel(channel, keys)
        connection = self._register(channel, remote, is_dialer=False)
        await connection.wait_closed(timeout=None)

    def _handshake_settings(
        self, *, relayed: bool = False, probe: bool = False
    ) -> HandshakeSettings:
        features = ("relay",) if self.options.relay_service else ()
        max_frame = self.options.limits.max_frame
        if relayed:
            # A relayed frame travels inside one relay-stream message: keep it under the relay's
            # frame size so that each inner frame is one outer frame, not two.
            max_frame -= RELAY_FRAME_MARGIN
        return HandshakeSettings(
            run_id=self.options.run_id,
            config_hash=self.options.config_hash,
            features=features + (PROBE_FEATURE,) if probe else features,
            receive_window=self.options.limits.receive_window,
            max_frame=max_frame,
            frame_auth=self.options.frame_auth or bool(getattr(self.authorizer, "private", False)),
        )

    def _register(self, channel: Channel, remote: RemoteHello, *, is_dialer: bool) -> Connection:
        connection = Connection(
            channel,
            remote,
            is_dialer=is_dialer,
            limits=self.options.limits,
            on_stream=self._serve_stream,
            on_closed=self._forget_connection,
        )
        self._all_connections.add(connection)
        if self._closing:
            connection.close(Refusal.SHUTDOWN, "peer shutting down")
            return connection
        existing = self.connection(remote.peer_id)
        if existing is not None:
            # Both sides dialed at once. Keep the connection dialed by the smaller PeerID: both
            # sides decide the same without talking, and the loser drains instead of breaking.
            dialer_of_new = self.peer_id if is_dialer else remote.peer_id
            smaller = min(self.peer_id, remote.peer_id)
            if dialer_of_new != smaller and existing.is_dialer == (self.peer_id == smaller):
                connection.close_when_idle()
                return connection
            existing.close_when_idle()
        self._connections[remote.peer_id] = connection
        logger.debug(
            "%s connected to %s (%s)",
            self.peer_id.short(),
            remote.peer_id.short(),
            channel.remote_address,
        )
        return connection

    def _forget_connection(self, connection: Connection) -> None:
        self._all_connections.discard(connection)
        if self._connections.get(connection.remote_peer) is connection:
            del self._connections[connection.remote_peer]

    async def _serve_stream(self, stream: Stream) -> None:
        handler = self._stream_handlers.get(stream.protocol)
        if handler is None:
            stream.reset(ResetCode.UNKNOWN_PROTOCOL, f"no handler for {stream.protocol!r}")
            return
        try:
            await handler(stream)
        except asyncio.CancelledError:
            stream.reset(ResetCode.SHUTDOWN, "handler cancelled")
            raise
        except (PeerError, KitTimeout) as e:
            logger.debug("%s handler: %s: %s", stream.protocol, type(e).__name__, e)
            stream.reset(ResetCode.HANDLER_ERROR, f"{type(e).__name__}: {e}")
        except Exception as e:
            logger.warning(
                "%s handler failed for %s: %r", stream.protocol, stream.remote_peer.short(), e
            )
            stream.reset(ResetCode.HANDLER_ERROR, f"{type(e).__name__}: {e}")
        else:
            await stream.close()

    async def _close_idle_connections(self) -> None:
        # Connections cost a socket and two tasks each; a DHT touches many peers once.
        # Relay registrations hold a stream open, so they are never idle.
        timeout = self.options.idle_timeout
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(timeout / 4, 30.0))
            now = loop.time()
            for connection in list(self._connections.values()):
                if connection.idle and now - connection.last_activity > timeout:
                    connection.close(Refusal.IDLE, f"no streams for {timeout:.0f} s")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a background task owned by this peer (cancelled at shutdown)."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.peer_id.short()}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_consume_exception)
        return task

    def __repr__(self) -> str:
        mode = "client" if self._client_mode else "public"
        return f"<Peer {self.peer_id.short()} {mode} {len(self._connections)} connections>"


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


def _consume_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("background task ended with %r", future.exception())


async def create_peer(
    initial_peers: Sequence[str] = (),
    *,
    identity: Identity | None = None,
    identity_path: str | os.PathLike[str] | None = None,
    authorizer: Authorizer | None = None,
    **options: object,
) -> Peer:
    """Start a peer (on the running loop) and connect it to ``initial_peers``.

    Args:
        initial_peers: addresses of peers already in the run (any form of ``kit.p2p.address``).
        identity: an explicit identity; default: ``identity_path`` or a fresh one.
        identity_path: a key file, created if missing and locked while this peer runs.
        authorizer: who may connect (default: everyone in the same run).
        **options: fields of :class:`PeerOptions`.

    Raises:
        IdentityInUse: another running peer holds ``identity_path``.
        ConfigError / TypeError: an unknown or invalid option.
    """
    lock = None
    if identity is None and identity_path is not None:
        identity, lock = load_identity(identity_path)
    peer_options = PeerOptions(**options)  # type: ignore[arg-type]
    for address in initial_peers:
        parse_address(address)  # fail early on a typo, before any socket is opened
    peer = Peer(identity or Identity.generate(), peer_options, authorizer)
    peer._identity_lock = lock
    try:
        await peer._start(list(initial_peers))
    except BaseException:
        await peer.shutdown()
        raise
    return peer


__all__ = ["HttpRequest", "HttpResponse", "Peer", "PeerOptions", "create_peer"]

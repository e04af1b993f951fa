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
import logging
import os
import socket
from collections.abc import Coroutine, Sequence
from typing import Any

from kit.address import Address, parse_address
from kit.errors import (
    AuthError,
    KitTimeout,
    KitUsageError,
    PeerError,
    PeerUnavailable,
    RemoteProtocolError,
)
from kit.p2p import hole_punch, interfaces, reachability, relay, transport
from kit.p2p.admission import accept_over, admit, dial_over, handshake_settings
from kit.p2p.api import DEFAULT_MAX_MESSAGE, StreamHandler, UnaryHandler
from kit.p2p.budget import BufferLedger
from kit.p2p.channel import Authorizer, OpenAuthorizer, dial_handshake
from kit.p2p.connection import Channel, Connection
from kit.p2p.connection_table import AddressBook, ConnectionTable
from kit.p2p.handlers import Handlers
from kit.p2p.handshake import RemoteHello
from kit.p2p.identity import Identity, IdentityLock, PeerID, load_identity
from kit.p2p.options import PeerOptions, RelayLimits
from kit.p2p.stream import Stream, wait_bounded
from kit.p2p.transport import HttpHandler, HttpRequest, HttpResponse, Listener
from kit.p2p.wire import Refusal, ResetCode

logger = logging.getLogger(__name__)


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
        self._listener = Listener(options, self._accept_websocket)
        self.connections = ConnectionTable(self.peer_id)  # one in use per remote peer
        # Unread received bytes of all connections, against one budget (kit.p2p.budget).
        self.buffer_ledger: BufferLedger[Connection] = BufferLedger(options.buffer_budget)
        self._dials: dict[str, asyncio.Future[PeerID]] = {}
        self.address_book = AddressBook(self.peer_id)  # where other peers are
        self.handlers = Handlers(options.request_timeout)  # what this peer serves
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.relay_client: relay.RelayClient | None = None  # in client mode
        self.relay_service: relay.RelayService | None = None  # on relays
        self.puncher: hole_punch.HolePuncher | None = None  # relayed -> direct connections
        self._punch_socket: socket.socket | None = None  # holds the punch port (client mode)

    # --- lifecycle -----------------------------------------------------------------------

    async def _start(self, initial_peers: Sequence[str]) -> None:
        attach = getattr(self.authorizer, "attach", None)
        if callable(attach):  # private runs: re-check established connections (kit.auth)
            attach(self)
        if self.options.relay_service:
            self.relay_service = relay.RelayService(self, self.options.relay_limits)
        reachability.serve_dialback(self)
        if self.options.hole_punching and hole_punch.supported():
            self.puncher = hole_punch.HolePuncher(self)
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
            if self.puncher is not None:
                # Every outbound connection leaves from one port from now on, so that relays
                # see (and tell us) the one public port our NAT gives it (kit.p2p.hole_punch).
                # The dial-back probe's connections left from others: they go.
                self._punch_socket = hole_punch.reuse_port_socket("0.0.0.0", 0)
                for connection in self.connections.every_open():
                    connection.close(Refusal.SHUTDOWN, "reconnecting from the punch port")
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
        await self._listener.start(self.peer_id)
        logger.info(
            "%s listening on %s",
            self.peer_id.short(),
            ", ".join(map(str, self._listener.addresses)),
        )

    async def _stop_listening(self) -> None:
        await self._listener.stop()

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
        connections = self.connections.every_open()
        for connection in connections:
            connection.close(Refusal.SHUTDOWN, "peer shutting down")
        await self._stop_listening()
        if self._punch_socket is not None:
            self._punch_socket.close()
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

    @property
    def can_accept(self) -> bool:
        """Others can connect to it directly (PeerAPI): it listens; or, in client mode, relays
        see it at a public port and its relayed connections are upgraded by hole punching
        (``kit.p2p.hole_punch``), unless its punches keep failing (a symmetric NAT)."""
        if not self._client_mode:
            return True
        puncher = self.puncher
        return puncher is not None and bool(self.observed_endpoints()) and not puncher.hopeless

    @property
    def punch_port(self) -> int | None:
        """The local port every outbound connection of a client-mode peer leaves from."""
        sock = self._punch_socket
        return None if sock is None else int(sock.getsockname()[1])

    def observed_endpoints(self) -> list[tuple[str, int]]:
        """Where relays see our connections come from (our NAT's public side), newest first."""
        client = self.relay_client
        return list(client.observed) if client is not None and self._punch_socket else []

    def get_visible_addresses(self) -> list[str]:
        if self._client_mode:
            client = self.relay_client
            return [str(a) for a in client.relayed_addresses()] if client is not None else []
        # A wildcard listener hands out its interfaces' addresses, never 0.0.0.0 (kit.p2p.interfaces).
        addresses = interfaces.visible_addresses(self._listener.addresses, self.options.announce)
        own = [a if a.peer_id is not None else a.with_peer_id(self.peer_id) for a in addresses]
        return [str(address) for address in own]

    @property
    def listen_port(self) -> int | None:
        return self._listener.addresses[0].port if self._listener.addresses else None

    def add_address(self, peer_id: PeerID, address: str | Address) -> None:
        self.address_book.add(
            peer_id, parse_address(address) if isinstance(address, str) else address
        )

    def add_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self.handlers.add_stream(protocol, handler)

    def add_unary_handler(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = DEFAULT_MAX_MESSAGE
    ) -> None:
        self.handlers.add_unary(protocol, handler, max_request=max_request)

    def remove_handler(self, protocol: str) -> None:
        self.handlers.remove(protocol)

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
        if parsed.peer_id is not None and self.connections.get(parsed.peer_id) is not None:
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
        return self.connections.every_open()

    def connected_peers(self) -> list[PeerID]:
        return self.connections.peers()

    def connection(self, peer_id: PeerID) -> Connection | None:
        return self.connections.get(peer_id)

    # --- dialing and accepting -----------------------------------------------------------

    async def _connection_to(self, peer_id: PeerID, timeout: float) -> Connection:
        if peer_id == self.peer_id:
            raise KitUsageError("a peer cannot open a stream to itself")
        connection = self.connection(peer_id)
        if connection is not None and not connection.draining:
            return connection
        errors = []
        for address in self.address_book.to_dial(peer_id):
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
        relayed = address.relay is not None
        if relayed:
            channel: Channel = await relay.open_relayed_channel(self, address, timeout)
        else:
            channel = await transport.dial(
                address,
                self.options,
                min(timeout, self.options.dial_timeout),
                local_port=self.punch_port,
            )
        settings = handshake_settings(self.options, self.authorizer, relayed=relayed)
        channel, remote = await dial_over(
            channel,
            self.identity,
            settings,
            self.authorizer,
            expected_peer=address.peer_id,
            timeout=min(timeout, self.options.handshake_timeout),
        )
        self._register(channel, remote, is_dialer=True, relayed=relayed)
        if not relayed or address.peer_id is None:
            self.add_address(remote.peer_id, address)
        elif self.puncher is not None:  # try for a direct connection, in the background
            self.spawn(self.puncher.upgrade(remote.peer_id), f"upgrade-{remote.peer_id.short()}")
        return remote.peer_id

    async def dial_direct(self, address: Address, *, timeout: float) -> PeerID:
        """Dial ``address`` although a connection to its peer exists: a direct connection to
        replace a relayed one (connection reversal, ``kit.p2p.hole_punch``)."""
        if address.relay is not None:
            raise KitUsageError(f"{address} is relayed: dial_direct takes a direct address")
        return await wait_bounded(self._dial(address, timeout), timeout, f"dialing {address}")

    async def adopt_direct(
        self, channel: Channel, *, is_dialer: bool, expected_peer: PeerID, timeout: float
    ) -> None:
        """Run the handshake on a direct channel to a peer we reach through a relay (a punched
        socket: ``kit.p2p.hole_punch``), and register it in place of the relayed connection.

        Raises:
            PeerError / AuthError / KitTimeout: the handshake failed (the channel is closed).
        """
        settings = handshake_settings(self.options, self.authorizer)
        try:
            if is_dialer:
                channel, remote = await dial_over(
                    channel,
                    self.identity,
                    settings,
                    self.authorizer,
                    expected_peer=expected_peer,
                    timeout=timeout,
                )
            else:
                channel, remote = await accept_over(
                    channel, self.identity, settings, self.authorizer, timeout=timeout
                )
                if remote.peer_id != expected_peer:
                    raise RemoteProtocolError(
                        f"a punched connection answered as {remote.peer_id.short()}, "
                        f"not {expected_peer.short()}"
                    )
        except BaseException:
            await channel.close()
            raise
        self._register(channel, remote, is_dialer=is_dialer, relayed=False)

    async def probe(self, address: Address, timeout: float) -> None:
        """Dial ``address`` and run the handshake as a reachability probe, then hang up: the
        listener answers and keeps no connection (``kit.p2p.reachability``'s dial-back).

        Raises:
            PeerError / KitTimeout / OSError: nothing answered there with ``address.peer_id``.
        """
        channel = await transport.dial(address, self.options, timeout)
        await dial_handshake(
            channel,
            self.identity,
            handshake_settings(self.options, self.authorizer, probe=True),
            self.authorizer,
            expected_peer=address.peer_id,
            timeout=timeout,
        )
        await channel.close()

    def add_http_route(self, path: str, handler: HttpHandler) -> None:
        """Answer plain HTTP GETs of ``path`` on the listening port (the coordinator's API and
        dashboard share the port, and the TLS certificate, of its websocket endpoint)."""
        self._listener.add_route(path, handler)

    async def _accept_websocket(self, channel: Channel) -> None:
        """Run the listener's handshake on a channel our listening port accepted, then serve it."""
        admitted = await admit(
            channel,
            self.identity,
            handshake_settings(self.options, self.authorizer),
            self.authorizer,
            timeout=self.options.handshake_timeout,
        )
        if admitted is None:  # refused (logged), or a reachability probe (answered)
            return
        connection = self._register(*admitted, is_dialer=False, relayed=False)
        await connection.wait_closed(timeout=None)

    async def accept_channel(self, channel: Channel) -> None:
        """Run the listener's handshake on a channel a relay handed us, then serve it."""
        channel, remote = await accept_over(
            channel,
            self.identity,
            handshake_settings(self.options, self.authorizer, relayed=True),
            self.authorizer,
            timeout=self.options.handshake_timeout,
        )
        connection = self._register(channel, remote, is_dialer=False, relayed=True)
        await connection.wait_closed(timeout=None)

    def _register(
        self, channel: Channel, remote: RemoteHello, *, is_dialer: bool, relayed: bool
    ) -> Connection:
        connection = Connection(
            channel,
            remote,
            is_dialer=is_dialer,
            limits=self.options.limits,
            on_stream=self.handlers.serve,
            on_closed=self.connections.forget,
            ledger=self.buffer_ledger,
        )
        connection.relayed = relayed
        self.connections.add(connection, closing=self._closing)
        logger.debug(
            "%s connected to %s (%s)",
            self.peer_id.short(),
            remote.peer_id.short(),
            channel.remote_address,
        )
        return connection

    async def _close_idle_connections(self) -> None:
        # Connections cost a socket and two tasks each; a DHT touches many peers once.
        # Relay registrations hold a stream open, so they are never idle.
        timeout = self.options.idle_timeout
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(timeout / 4, 30.0))
            self.connections.close_idle(loop.time(), timeout)

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
        return f"<Peer {self.peer_id.short()} {mode} {len(self.connected_peers())} connections>"


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
        initial_peers: addresses of peers already in the run (any form of ``kit.address``).
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


# HttpRequest, HttpResponse and RelayLimits live in kit.p2p.transport and kit.p2p.options; they
# stay importable from here, where route handlers and relays have always found them.
__all__ = ["HttpRequest", "HttpResponse", "Peer", "PeerOptions", "RelayLimits", "create_peer"]

"""In-process peers: :class:`MemoryNetwork` and :class:`MemoryPeer`, which implements ``PeerAPI``.

Tests and dry runs of the DHT and the averaging code use these instead of websockets: every peer
of one :class:`MemoryNetwork` lives in the same event loop, and a ``call`` or ``open_stream`` runs
the target peer's handler as an asyncio task owned by that peer. Addresses look like
``memory://<peer id in base58>``.

What is emulated, because code above p2p depends on it:

* dialing: ``call`` / ``open_stream`` to a peer need an open connection or a known address of it
  (``add_address`` or ``connect``), as on the real network; a connection opened by either side
  can be used by both.
* NAT (``kit.p2p.memory_nat``): a peer is public, or in client mode behind a punchable or a
  symmetric NAT, reached through its relay: directly once punched, or relayed (the relay's
  links carry the bytes). A relay that shuts down breaks the streams it carried.
* flow control: a stream is two bounded queues of messages; ``send_message`` waits while the
  receiver's queue is full (``kit.p2p.memory_stream``).
* failures: a shut-down peer raises ``PeerUnavailable`` for new calls and ``ConnectionLost`` for
  calls in flight; a handler's exception reaches the caller as ``RemoteError("handler_error",
  "<class name>: <message>")``, as with the websocket peer; every wait ends with ``KitTimeout``
  after the given timeout.
* faults: :meth:`MemoryNetwork.link` gives a :class:`FaultyLink` that drops, refuses or delays
  what is sent to one peer.
* links (optional): a :class:`LinkModel` (``kit.testing.links.SimulatedLinks``) gives every
  message a delivery time from the sender's uplink, the receiver's downlink and their latency;
  on a loop on virtual time (``kit.testing.virtual_time``) that is what simulated peers measure.
  One stream's pipes, windows and delivery times are ``kit.p2p.memory_stream``.

What is not emulated: message loss inside a connection, failed punches, authentication.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any

from kit.errors import (
    ConfigError,
    ConnectionLost,
    FrameTooLarge,
    IdentityInUse,
    KitTimeout,
    KitUsageError,
    PeerUnavailable,
    RemoteError,
    UnknownProtocol,
)
from kit.p2p.api import DEFAULT_MAX_MESSAGE, StreamHandler, UnaryHandler
from kit.p2p.identity import Identity, IdentityLock, PeerID, load_identity
from kit.p2p.memory_nat import (
    NAT,
    known_routes,
    memory_address,
    nat_kind,
    parse_memory_address,
    relayed_memory_address,
    route,
)
from kit.p2p.memory_stream import LinkModel, MemoryStream, MessagePipe, deadline_in, time_left

logger = logging.getLogger(__name__)

#: Addresses remembered per remote peer; older ones are forgotten first.
MAX_ADDRESSES_PER_PEER = 8


#: Codes of the ``RemoteError`` a caller gets, as ``kit.p2p.peer`` reports them.
HANDLER_ERROR = "handler_error"
UNKNOWN_PROTOCOL = "unknown_protocol"


def _as_remote_error(exc: BaseException) -> RemoteError:
    """How a handler's exception looks to the caller (as the real peer reports it)."""
    return RemoteError(HANDLER_ERROR, f"{type(exc).__name__}: {exc}")


class FaultyLink:
    """Faults injected on what is sent *to* one peer: dials, calls and new streams.

    Example::

        with network.link(peer_b.peer_id).drop():
            await peer_a.call(peer_b.peer_id, "p", b"", timeout=0.1)  # KitTimeout
    """

    def __init__(self) -> None:
        self.dropping = False
        self.refusing = False
        self.extra_delay = 0.0

    @contextlib.contextmanager
    def drop(self) -> Iterator[FaultyLink]:
        """Requests are lost: the sender waits until its timeout (an unresponsive peer)."""
        self.dropping = True
        try:
            yield self
        finally:
            self.dropping = False

    @contextlib.contextmanager
    def refuse(self) -> Iterator[FaultyLink]:
        """Requests fail at once with ``PeerUnavailable`` (a peer whose port is closed)."""
        self.refusing = True
        try:
            yield self
        finally:
            self.refusing = False

    @contextlib.contextmanager
    def delay(self, seconds: float) -> Iterator[FaultyLink]:
        """Every request waits ``seconds`` before it reaches the peer (a slow link)."""
        self.extra_delay += seconds
        try:
            yield self
        finally:
            self.extra_delay -= seconds

    async def apply(self, peer_id: PeerID, deadline: float | None) -> None:
        if self.refusing:
            raise PeerUnavailable(f"peer {peer_id.short()} refused the connection (FaultyLink)")
        if self.dropping:
            if deadline is None:
                raise KitUsageError("a dropped link with no timeout would wait forever")
            await asyncio.sleep(time_left(deadline) or 0.0)
            raise KitTimeout(f"no answer from {peer_id.short()} (dropped by FaultyLink)")
        if self.extra_delay > 0:
            remaining = time_left(deadline)
            if remaining is not None and remaining < self.extra_delay:
                await asyncio.sleep(remaining)
                raise KitTimeout(f"no answer from {peer_id.short()} (delayed by FaultyLink)")
            await asyncio.sleep(self.extra_delay)


class MemoryNetwork:
    """A set of in-process peers that can dial each other; one per test or dry run.

    Args:
        stream_window: messages a stream buffers (or has in flight) for its receiver before
            ``send_message`` waits. Increase it to emulate long fat links; 1 makes every send
            wait for the reader.
        links: delivery times of messages (None: at once).
    """

    def __init__(self, *, stream_window: int = 8, links: LinkModel | None = None) -> None:
        if stream_window < 1:
            raise ConfigError(f"stream_window must be >= 1, got {stream_window} - help: use 8")
        self.stream_window = stream_window
        self.links = links
        self._peers: dict[PeerID, MemoryPeer] = {}
        self._links: dict[PeerID, FaultyLink] = {}

    async def create_peer(
        self,
        initial_peers: Sequence[str] = (),
        *,
        identity: Identity | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        client_mode: bool | None = None,
        nat: NAT | str | None = None,
        **options: object,
    ) -> MemoryPeer:
        """Start a peer on this network, with ``kit.p2p.peer.create_peer``'s signature.

        It is a ``peer_factory`` for ``kit.dht.DHT`` and tests. ``initial_peers`` and the
        websocket options (``host``, ``port``, ``announce``, ``run_id``, ...) are accepted and
        ignored; ``client_mode=None`` means False (nothing to detect in memory). ``nat``: how
        it can be reached (``kit.p2p.memory_nat.nat_kind``).

        Raises:
            IdentityInUse: another running peer uses the same identity (file).
            ConfigError: ``nat`` contradicts ``client_mode``, or is no :class:`NAT`.
        """
        del initial_peers, options  # meaningless in memory
        kind = nat_kind(nat, client_mode)
        lock: IdentityLock | None = None
        if identity is None and identity_path is not None:
            identity, lock = load_identity(identity_path)
        elif identity is None:
            identity = Identity.generate()
        if identity.peer_id in self._peers:
            if lock is not None:
                lock.release()
            raise IdentityInUse(str(identity_path or identity.peer_id))
        peer = MemoryPeer(self, identity, nat=kind, identity_lock=lock)
        self._peers[peer.peer_id] = peer
        return peer

    def link(self, peer_id: PeerID) -> FaultyLink:
        """The fault injector for everything sent to ``peer_id``."""
        return self._links.setdefault(peer_id, FaultyLink())

    def peers(self) -> list[MemoryPeer]:
        """The running peers."""
        return list(self._peers.values())

    def get_peer(self, peer_id: PeerID) -> MemoryPeer | None:
        return self._peers.get(peer_id)

    def _unregister(self, peer: MemoryPeer) -> None:
        gone = peer.peer_id
        if self._peers.get(gone) is peer:
            del self._peers[gone]
        for other in self._peers.values():
            other._connections.pop(gone, None)
            for remote, via in list(other._connections.items()):
                if via == gone:  # a connection it relayed
                    del other._connections[remote]
            if other._relay == gone:
                other._relay = other._public_connection()


class MemoryPeer:
    """An in-process peer of a :class:`MemoryNetwork` (implements ``kit.p2p.api.PeerAPI``).

    Create it with :meth:`MemoryNetwork.create_peer`; stop it with :meth:`shutdown`.
    ``stats`` counts the calls and streams this peer served, per protocol (for tests).
    """

    def __init__(
        self,
        network: MemoryNetwork,
        identity: Identity,
        *,
        nat: NAT = NAT.PUBLIC,
        identity_lock: IdentityLock | None = None,
    ) -> None:
        self.peer_id: PeerID = identity.peer_id
        self.identity = identity
        self.stats: collections.Counter[str] = collections.Counter()
        self._network = network
        self._nat = nat
        self._relay: PeerID | None = None  # where a client-mode peer registered (a public peer)
        self._identity_lock = identity_lock
        self._running = True
        self._connections: dict[PeerID, PeerID | None] = {}  # remote -> the relay carrying it
        self._relayed_streams: weakref.WeakSet[MemoryStream] = weakref.WeakSet()
        self._addresses: dict[PeerID, list[str]] = {}
        self._unary: dict[str, tuple[UnaryHandler, int]] = {}
        self._streaming: dict[str, StreamHandler] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._streams: weakref.WeakSet[MemoryStream] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"MemoryPeer({self.peer_id.short()}, {self._nat.value}, running={self._running})"

    @property
    def client_mode(self) -> bool:
        return self._nat is not NAT.PUBLIC

    @property
    def can_accept(self) -> bool:
        return self._nat is not NAT.SYMMETRIC

    @property
    def nat(self) -> NAT:
        return self._nat

    @property
    def relay(self) -> PeerID | None:
        """The public peer a client-mode peer registered with (None: not yet, or public)."""
        return self._relay

    @property
    def is_running(self) -> bool:
        return self._running

    def get_visible_addresses(self) -> list[str]:
        if not self._running:
            return []
        if self._nat is NAT.PUBLIC:
            return [memory_address(self.peer_id)]
        return [] if self._relay is None else [relayed_memory_address(self._relay, self.peer_id)]

    def add_address(self, peer_id: PeerID, address: str) -> None:
        if peer_id == self.peer_id:
            return
        known = self._addresses.setdefault(peer_id, [])
        if address in known:
            known.remove(address)
        known.append(address)
        del known[:-MAX_ADDRESSES_PER_PEER]

    def add_unary_handler(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = DEFAULT_MAX_MESSAGE
    ) -> None:
        self._unary[protocol] = (handler, max_request)

    def add_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._streaming[protocol] = handler

    def remove_handler(self, protocol: str) -> None:
        self._unary.pop(protocol, None)
        self._streaming.pop(protocol, None)

    async def connect(self, address: str, *, timeout: float) -> PeerID:
        peer_id = parse_memory_address(address)
        self.add_address(peer_id, address)
        await self._dial(peer_id, deadline_in(timeout))
        return peer_id

    async def call(
        self,
        peer_id: PeerID,
        protocol: str,
        request: bytes,
        *,
        timeout: float,
        max_response: int = DEFAULT_MAX_MESSAGE,
    ) -> bytes:
        deadline = deadline_in(timeout)
        target = await self._dial(peer_id, deadline)
        entry = target._unary.get(protocol)
        if entry is None:
            raise UnknownProtocol(UNKNOWN_PROTOCOL, f"{peer_id.short()} serves no {protocol!r}")
        handler, max_request = entry
        if len(request) > max_request:  # the real peer's handler fails to receive it
            too_large = FrameTooLarge(f"request of {len(request)} bytes > max_size {max_request}")
            raise _as_remote_error(too_large)
        target.stats[protocol] += 1
        links, via = self._network.links, self._connections.get(peer_id)
        if links is None:
            task = target._spawn(handler(self.peer_id, bytes(request)))
        else:
            route = (self.peer_id, target.peer_id, via)
            task = target._spawn(_over_links(links, route, handler, request))
        try:
            done, _ = await asyncio.wait({task}, timeout=time_left(deadline))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            raise KitTimeout(f"{protocol!r} call to {peer_id.short()} timed out after {timeout} s")
        if task.cancelled():
            raise ConnectionLost(f"{peer_id.short()} shut down while serving {protocol!r}")
        error = task.exception()
        if error is not None:
            raise _as_remote_error(error)
        response = task.result()
        if not isinstance(response, bytes | bytearray | memoryview):
            raise _as_remote_error(TypeError(f"handler returned {type(response).__name__}"))
        if len(response) > max_response:
            raise FrameTooLarge(f"response of {len(response)} bytes > max_response {max_response}")
        return bytes(response)

    async def open_stream(self, peer_id: PeerID, protocol: str, *, timeout: float) -> MemoryStream:
        target = await self._dial(peer_id, deadline_in(timeout))
        handler = target._streaming.get(protocol)
        if handler is None:
            raise UnknownProtocol(UNKNOWN_PROTOCOL, f"{peer_id.short()} serves no {protocol!r}")
        window, links = self._network.stream_window, self._network.links
        via = self._connections.get(peer_id)
        to_target = MessagePipe(window, links, (self.peer_id, peer_id), via)
        to_self = MessagePipe(window, links, (peer_id, self.peer_id), via)
        ours = MemoryStream(peer_id, protocol, inbound=to_self, outbound=to_target)
        theirs = MemoryStream(self.peer_id, protocol, inbound=to_target, outbound=to_self)
        self._streams.add(ours)
        target._streams.add(theirs)
        relay = self._network.get_peer(via) if via is not None else None
        if relay is not None:  # its shutdown breaks the stream
            relay._relayed_streams.add(ours)
        target.stats[protocol] += 1
        target._spawn(_serve_stream(handler, theirs))
        return ours

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving: calls to this peer fail, streams break, handler tasks are cancelled."""
        if not self._running:
            return
        self._running = False
        self._network._unregister(self)
        self._connections.clear()
        for stream in list(self._streams):
            stream.fail(ConnectionLost(f"peer {self.peer_id.short()} shut down"))
        for stream in list(self._relayed_streams):
            stream.fail(ConnectionLost(f"relay {self.peer_id.short()} shut down"))
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if self._identity_lock is not None:
            self._identity_lock.release()
            self._identity_lock = None

    # --- internals --------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        coroutine = work if asyncio.iscoroutine(work) else _await(work)
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here; the caller re-raises it as RemoteError

    def _public_connection(self) -> PeerID | None:
        """A public peer this client-mode peer is directly connected to (a relay), if any."""
        if self._nat is NAT.PUBLIC:
            return None
        for remote, via in self._connections.items():
            peer = self._network.get_peer(remote)
            if via is None and peer is not None and peer._nat is NAT.PUBLIC and peer._running:
                return remote
        return None

    def _route_to(self, peer_id: PeerID, target: MemoryPeer | None) -> tuple[PeerID | None, bool]:
        """How a new connection to ``peer_id`` goes: (the relay it goes through or None,
        whether that relay only coordinates a hole punch).

        Raises:
            PeerUnavailable: no known address reaches it, it is not running, or its relay is not.
        """
        routes = known_routes(peer_id, self._addresses.get(peer_id, []))
        if target is None:
            raise PeerUnavailable(f"peer {peer_id.short()} is not running")
        via, punch = route(peer_id, routes, target._nat, target._relay)
        relay = self._network.get_peer(via) if via is not None else None
        if via is not None and (relay is None or not relay._running):
            raise PeerUnavailable(f"the relay of {peer_id.short()} is not running")
        return via, punch

    async def _dial(self, peer_id: PeerID, deadline: float | None) -> MemoryPeer:
        if not self._running:
            raise KitUsageError(
                f"peer {self.peer_id.short()} was shut down - help: create a new peer"
            )
        if peer_id == self.peer_id:
            raise KitUsageError("a peer cannot dial itself - help: handle local requests locally")
        target = self._network.get_peer(peer_id)
        connected = peer_id in self._connections
        via, punch = None, False
        if not connected:
            via, punch = self._route_to(peer_id, target)
        elif target is None:  # pragma: no cover - connections are dropped on shutdown
            raise PeerUnavailable(f"peer {peer_id.short()} is not running")
        assert target is not None
        await self._network.link(peer_id).apply(peer_id, deadline)
        links = self._network.links
        if links is not None and not connected:
            delay = links.connect_delay(self.peer_id, peer_id, via, punch)
            remaining = time_left(deadline)
            if remaining is not None and remaining < delay:
                await asyncio.sleep(remaining)
                raise KitTimeout(f"connecting to {peer_id.short()} timed out (simulated link)")
            await asyncio.sleep(delay)
        if not target._running:
            raise ConnectionLost(f"peer {peer_id.short()} shut down while being dialed")
        if peer_id not in self._connections:  # (another dial may have connected meanwhile)
            if via is not None and self._network.get_peer(via) is None:
                raise ConnectionLost(f"the relay of {peer_id.short()} shut down while dialing")
            route = None if punch else via
            self._connections[peer_id] = route
            target._connections[self.peer_id] = route
        for peer in (self, target):  # a client-mode peer registers with a public peer it reached
            peer._relay = peer._relay or peer._public_connection()
        return target


async def _await(work: Awaitable[Any]) -> Any:
    return await work


async def _over_links(
    links: LinkModel,
    route: tuple[PeerID, PeerID, PeerID | None],
    handler: UnaryHandler,
    request: bytes,
) -> Any:
    """A unary call whose request and response take the time the links give them (``route``:
    caller, callee, and the relay between them or None)."""
    caller, callee, via = route
    loop = asyncio.get_running_loop()
    _, arrives_at = links.transmit(caller, callee, len(request), loop.time(), via)
    await asyncio.sleep(max(0.0, arrives_at - loop.time()))
    response = await handler(caller, bytes(request))
    if isinstance(response, bytes | bytearray | memoryview):
        _, arrives_at = links.transmit(callee, caller, len(response), loop.time(), via)
        await asyncio.sleep(max(0.0, arrives_at - loop.time()))
    return response


async def _serve_stream(handler: StreamHandler, stream: MemoryStream) -> None:
    try:
        await handler(stream)
    except asyncio.CancelledError:
        stream.fail(ConnectionLost("the serving peer shut down"))
        raise
    except Exception as e:  # the handler failed: the remote side learns it as RemoteError
        stream.fail(_as_remote_error(e))
        logger.debug("stream handler for %r failed", stream.protocol, exc_info=True)
    else:
        await stream.close()

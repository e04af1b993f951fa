"""Direct connections to peers behind NATs: a relayed connection upgraded by connection reversal
or by TCP hole punching, coordinated through the relay (libp2p's DCUtR, "Direct Connection
Upgrade through Relay"; Seemann et al. 2022, "Decentralized Hole Punching").

Most volunteers (Colab, Kaggle, home PCs) sit behind NATs and are reached through a relay
(``kit.p2p.relay``), which then carries every byte of theirs: the relay's bandwidth becomes the
swarm's. Right after a peer opens a relayed connection it tries to replace it with a direct one,
over the relayed connection itself (``kit/dcutr/1``, end to end, so the relay can neither read
nor forge it)::

    initiator I (opened the circuit)               responder R (client mode, behind a NAT)
      CONNECT {addrs: I's observed, listen: I's}  ──►
                                                   if I listens: R dials I's address (reversal)
                                              ◄──  CONNECT {addrs: R's observed}    (else)
      (I measures the round trip t)
      SYNC                                        ──►
      waits t/2, then connects                         connects at once
      ──────── both SYNs cross: TCP simultaneous open through both NATs ────────
      kit's websocket framing (I masks, as a client) and kit's handshake, as on any channel

*Observed addresses* are what a relay sees a client-mode peer's connection come from (its NAT's
public address and port), returned when the peer registers there (``kit.p2p.relay``). They are
useful because every outbound connection of a client-mode peer leaves from one local port, its
*punch port*, bound with ``SO_REUSEPORT`` (``kit.p2p.transport.dial``): a NAT that keeps one
mapping per local port (endpoint-independent mapping, RFC 4787: most home routers and cloud NATs)
then shows every peer the same public port, and a SYN sent from that port to the other peer's
observed address opens the way in for the other peer's SYN (address- and port-dependent filtering
lets in what answers something sent out). A symmetric NAT (a new public port per destination)
defeats this: the punch fails and the relayed connection stays.

A connection that works is registered like any direct one; the relayed one drains (its streams
finish, new ones go direct: ``kit.p2p.peer``). Failures cost a few seconds in the background and
leave the relayed connection as it was. Not on Windows (no ``SO_REUSEPORT``), nor over TLS
(punched connections carry kit's handshake and, in private runs, its frame MACs, not TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

from kit.address import Address, parse_address
from kit.errors import KitTimeout, PeerError, RemoteProtocolError
from kit.p2p import wire
from kit.p2p.channel import websocket_max_size
from kit.p2p.identity import PeerID
from kit.p2p.options import PeerOptions
from kit.p2p.stream import Stream
from kit.p2p.websocket import FastWebSocketChannel
from kit.p2p.wire import ResetCode

logger = logging.getLogger(__name__)

PROTOCOL = "kit/dcutr/1"
MESSAGE_MAX = 4096
MAX_ADDRESSES = 8  # observed or listening addresses in one CONNECT
PUNCH_SECONDS = 8.0  # how long the two sides keep sending SYNs at each other
ATTEMPT_SECONDS = 1.5  # one connect attempt (the kernel's first SYN retransmission is at 1 s)
UPGRADE_TIMEOUT = 20.0  # the whole upgrade, coordination included
RETRY_AFTER = 60.0  # s before another upgrade with the same peer (either side asking)
OFFER_WAIT = 5.0  # s either side waits for a relay to tell where our NAT shows us (start-up)
HOPELESS_AFTER = 3  # failed punches, none ever working: this NAT gives no way in (symmetric)

Endpoint = tuple[str, int]  # (IP address, TCP port)


def _stamp(table: dict[PeerID, float], remote: PeerID, now: float) -> None:
    """Note when ``remote`` last did something, in a table bounded by forgetting the oldest (a
    peer must not grow our memory by showing up under new ids)."""
    table.pop(remote, None)  # (re-inserted last: the order stays oldest first)
    if len(table) >= 10_000:
        table.pop(next(iter(table)))
    table[remote] = now


def supported() -> bool:
    """Hole punching needs several sockets bound to one port (``SO_REUSEPORT``: Linux, macOS)."""
    return hasattr(socket, "SO_REUSEPORT") and sys.platform != "win32"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound to ``port`` (0: any) that other sockets of this process may
    bind too: the punch port's outbound connections and its punches share one NAT mapping."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _FirstBytes(asyncio.Protocol):
    """Holds what a punched socket receives before its channel takes the transport over."""

    def __init__(self) -> None:
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data


async def channel_over_socket(
    sock: socket.socket, options: PeerOptions, *, is_client: bool, remote: Endpoint
) -> FastWebSocketChannel:
    """A connected socket as a channel in kit's websocket framing (no HTTP upgrade: both ends
    agreed on it over the relayed connection; ``is_client`` masks, as RFC 6455's client)."""
    loop = asyncio.get_running_loop()
    transport, first = await loop.create_connection(_FirstBytes, sock=sock)
    channel = FastWebSocketChannel(
        transport,
        is_client=is_client,
        remote_address=f"{remote[0]}:{remote[1]} (punched)",
        remote_host=remote[0],
        max_size=websocket_max_size(options.limits.max_frame),
        keepalive_interval=options.keepalive_interval,
        keepalive_timeout=options.keepalive_timeout,
        plain_possible=options.plain_frames,  # a direct TCP connection: nothing parses frames
    )
    if first.data:
        channel.feed(bytes(first.data))
    return channel


async def simultaneous_connect(
    local_port: int, remotes: Sequence[Endpoint], deadline: float
) -> tuple[socket.socket, Endpoint]:
    """Connect from ``local_port`` to one of ``remotes`` (its other side doing the same towards
    us: TCP simultaneous open), trying them in turn until ``deadline`` (``time.monotonic``).

    Raises:
        KitTimeout: no attempt connected in time.
    """
    loop = asyncio.get_running_loop()
    errors: list[str] = []
    attempt = 0
    while time.monotonic() < deadline:
        remote = remotes[attempt % len(remotes)]
        attempt += 1
        sock = reuse_port_socket(remote[0], local_port)
        try:
            budget = min(ATTEMPT_SECONDS, max(0.05, deadline - time.monotonic()))
            await asyncio.wait_for(loop.sock_connect(sock, remote), budget)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            errors.append(f"{remote[0]}:{remote[1]}: {type(e).__name__}")
            # A refusal comes back at once (a NAT that answers unknown SYNs with RST): wait a
            # little before the next SYN, or the two sides keep missing each other.
            await asyncio.sleep(0.05 + 0.1 * random.random())
            continue
        return sock, remote
    raise KitTimeout(f"no hole punched in time ({'; '.join(errors[-3:]) or 'no attempt'})")


async def punch_and_accept(
    local_port: int, remotes: Sequence[Endpoint], deadline: float
) -> tuple[socket.socket, Endpoint]:
    """The responder's side: :func:`simultaneous_connect`, and meanwhile accept on the punch port
    what comes from one of ``remotes``' addresses (a SYN that reaches us before ours left: no
    NAT on the way, as on one LAN or loopback, where crossing SYNs would each meet a refusal).
    One TCP connection can come of it either way (one pair of ports).

    Raises:
        KitTimeout: nothing connected in time.
    """
    loop = asyncio.get_running_loop()
    listener = reuse_port_socket(remotes[0][0], local_port)
    listener.listen(4)
    hosts = {host for host, _ in remotes}

    async def accept() -> tuple[socket.socket, Endpoint]:
        while True:
            sock, where = await loop.sock_accept(listener)
            if where[0] in hosts:
                sock.setblocking(False)
                return sock, (where[0], where[1])
            sock.close()  # not the peer we punch for

    tasks = [
        asyncio.ensure_future(accept()),
        asyncio.ensure_future(simultaneous_connect(local_port, remotes, deadline)),
    ]
    winner: asyncio.Future[tuple[socket.socket, Endpoint]] | None = None
    try:
        wait = max(0.0, deadline - time.monotonic()) + 1.0
        done, _ = await asyncio.wait(tasks, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task in done and task.exception() is None:
                winner = task
                return task.result()
        failed = [e for e in (task.exception() for task in done) if e is not None]
        raise failed[0] if failed else KitTimeout("no hole punched in time")
    finally:
        listener.close()
        for task in tasks:
            if task is winner:
                continue
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                task.result()[0].close()  # (one pair of ports makes one connection: not seen)


class PunchHost(Protocol):
    """What hole punching needs of the peer it runs on (``kit.p2p.peer.Peer`` has it)."""

    peer_id: PeerID
    options: PeerOptions

    @property
    def client_mode(self) -> bool: ...

    @property
    def punch_port(self) -> int | None: ...

    def observed_endpoints(self) -> list[Endpoint]: ...

    def get_visible_addresses(self) -> list[str]: ...

    def add_stream_handler(self, protocol: str, handler: Any) -> None: ...

    async def open_stream(self, peer_id: PeerID, protocol: str, *, timeout: float) -> Stream: ...

    async def dial_direct(self, address: Address, *, timeout: float) -> PeerID: ...

    async def adopt_direct(
        self, channel: Any, *, is_dialer: bool, expected_peer: PeerID, timeout: float
    ) -> None: ...


class HolePuncher:
    """Upgrades relayed connections of ``peer`` to direct ones (see the module).

    Counters (``statistics``) say how the upgrades went: tried, reversed, punched, failed.
    """

    def __init__(self, peer: PunchHost) -> None:
        self.peer = peer
        self.tried = self.reversed = self.punched = self.failed = 0
        # When we last tried with each peer: an upgrade costs SYNs for seconds, and a peer must
        # not be able to make us dial or punch over and over (nor at addresses of its choice).
        self._last: dict[PeerID, float] = {}
        self._initiating: set[PeerID] = set()  # our upgrades in flight (both may ask at once)
        # Smaller peers whose "busy" ended our attempt, and when: theirs goes on, and its request
        # may reach us only after ours ended (a loaded machine). It is still served, once, if it
        # comes within UPGRADE_TIMEOUT (see ``_serve``).
        self._yielded: dict[PeerID, float] = {}
        peer.add_stream_handler(PROTOCOL, self._serve)

    @property
    def hopeless(self) -> bool:
        """Punches keep failing and none ever worked: our NAT maps each destination to a new
        port (symmetric), so others should not count on reaching us directly. Reversals do not
        count against it: dialing a public peer ourselves says nothing of whether NAT'd peers,
        most of a run, can reach us (a symmetric NAT's peer reverses fine)."""
        return self.failed >= HOPELESS_AFTER and self.punched == 0

    def _allowed(self, remote: PeerID) -> bool:
        now = time.monotonic()
        if now - self._last.get(remote, -RETRY_AFTER) < RETRY_AFTER:
            return False
        _stamp(self._last, remote, now)
        return True

    def statistics(self) -> dict[str, int]:
        return {
            "tried": self.tried,
            "reversed": self.reversed,
            "punched": self.punched,
            "failed": self.failed,
        }

    # --- the initiator ----------------------------------------------------------------------

    async def upgrade(self, remote: PeerID) -> bool:
        """Replace the relayed connection to ``remote`` with a direct one; True if it worked
        (a failure is logged at DEBUG and leaves the relayed connection alone)."""
        if not self._allowed(remote):
            return False
        self._initiating.add(remote)
        try:
            done = await asyncio.wait_for(self._upgrade(remote), UPGRADE_TIMEOUT)
        except (PeerError, KitTimeout, OSError, asyncio.TimeoutError) as e:
            logger.debug("no direct connection to %s: %s", remote.short(), e)
            done = False
        finally:
            self._initiating.discard(remote)
        if done is None:  # the other side declined (busy with its own attempt): no verdict
            return False
        self.tried += 1  # attempts with a verdict
        if not done:
            self.failed += 1
        return done

    async def _upgrade(self, remote: PeerID) -> bool | None:
        peer = self.peer
        listen = [] if peer.client_mode else _direct(peer.get_visible_addresses())
        mine = await self._observed() if peer.client_mode else []
        if not listen and (not mine or peer.punch_port is None):
            return None  # nothing the other side could reach: stay relayed, no verdict
        stream = await peer.open_stream(remote, PROTOCOL, timeout=10.0)
        try:
            began = time.monotonic()
            await _send(stream, {"addrs": _pack(mine), "listen": listen})
            answer = await _receive(stream, 10.0)
            if answer.get("busy") is True:
                await stream.close()
                if remote < peer.peer_id:  # its own attempt goes on: serve it when it comes
                    _stamp(self._yielded, remote, time.monotonic())
                return None
            rtt = time.monotonic() - began
            theirs = _unpack(answer.get("addrs"))
            if not listen and theirs:
                await _send(stream, {"sync": True})
            # Closed, not reset: a reset would cancel the responder's handler mid-punch.
            await stream.close()
        except BaseException:
            stream.reset(ResetCode.CANCELLED, "coordination failed")
            raise
        if listen:  # the responder dialed us back (connection reversal)
            if answer.get("reversed") is True:
                self.reversed += 1
                logger.debug("%s dialed us back directly", remote.short())
                return True
            return False
        if not theirs:
            return False
        await asyncio.sleep(rtt / 2)  # both SYNs leave at about the same time
        assert peer.punch_port is not None
        sock, where = await simultaneous_connect(
            peer.punch_port, theirs, time.monotonic() + PUNCH_SECONDS
        )
        channel = await channel_over_socket(sock, peer.options, is_client=True, remote=where)
        await peer.adopt_direct(channel, is_dialer=True, expected_peer=remote, timeout=10.0)
        self.punched += 1
        logger.info("direct connection to %s (hole punched at %s:%d)", remote.short(), *where)
        return True

    async def _observed(self) -> list[Endpoint]:
        """Where relays see our punch port. A peer that dials, or is asked, right after it
        started may have no relay's answer yet: wait for one (at most ``OFFER_WAIT``) rather
        than spend this pair's attempt, and its ``RETRY_AFTER``, on no verdict (the relayed
        dial is the only trigger)."""
        peer = self.peer
        deadline = time.monotonic() + OFFER_WAIT
        mine = peer.observed_endpoints()
        while not mine and peer.punch_port is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            mine = peer.observed_endpoints()
        return mine

    # --- the responder ----------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        peer, remote = self.peer, stream.remote_peer
        request = await _receive(stream, 10.0)
        # Both sides often ask at once (each dialed the other through the relay): then the
        # attempt of the smaller peer id goes on, and the other side serves it (its own attempt
        # is declined as busy). Otherwise, one attempt per RETRY_AFTER. The smaller side's request
        # can arrive after its "busy" already ended our attempt: served all the same (found under
        # load: both sides answered "busy" and the pair kept its relay for RETRY_AFTER).
        yielded = time.monotonic() - self._yielded.pop(remote, -UPGRADE_TIMEOUT) < UPGRADE_TIMEOUT
        collides = remote < peer.peer_id and (remote in self._initiating or yielded)
        if not collides and not self._allowed(remote):
            await _send(stream, {"addrs": [], "reversed": False, "busy": True})
            return
        listen = [a for a in request.get("listen", ()) if isinstance(a, str)][:MAX_ADDRESSES]
        if listen:
            reversed_ = await self._dial_back(remote, listen)
            await _send(stream, {"reversed": reversed_})
            return
        theirs = _unpack(request.get("addrs"))
        mine = await self._observed() if theirs else []  # (within the initiator's 10 s wait)
        if not theirs or not mine or peer.punch_port is None:
            await _send(stream, {"addrs": []})
            return
        await _send(stream, {"addrs": _pack(mine)})
        sync = await _receive(stream, 10.0)
        if sync.get("sync") is not True:
            raise RemoteProtocolError(f"{PROTOCOL}: expected SYNC")
        self.tried += 1
        try:
            sock, where = await punch_and_accept(
                peer.punch_port, theirs, time.monotonic() + PUNCH_SECONDS
            )
            channel = await channel_over_socket(sock, peer.options, is_client=False, remote=where)
            await peer.adopt_direct(channel, is_dialer=False, expected_peer=remote, timeout=10.0)
        except (PeerError, KitTimeout, OSError) as e:
            self.failed += 1
            logger.debug("no hole punched with %s: %s", remote.short(), e)
            return
        self.punched += 1
        logger.info("direct connection to %s (hole punched at %s:%d)", remote.short(), *where)

    async def _dial_back(self, remote: PeerID, listen: list[str]) -> bool:
        for text in listen:
            with contextlib.suppress(ValueError):
                address = parse_address(text)
                if address.relay is not None or address.peer_id not in (None, remote):
                    continue  # only the requester's own direct addresses
                try:
                    await self.peer.dial_direct(address.with_peer_id(remote), timeout=10.0)
                except (PeerError, KitTimeout) as e:
                    logger.debug("dialing %s back at %s failed: %s", remote.short(), text, e)
                    continue
                self.reversed += 1
                return True
        return False


def _direct(addresses: Sequence[str]) -> list[str]:
    """Listening addresses others can dial directly (not relayed ones)."""
    return [a for a in addresses if "/p2p-circuit" not in a][:MAX_ADDRESSES]


def _pack(endpoints: Sequence[Endpoint]) -> list[list[Any]]:
    return [[host, port] for host, port in endpoints[:MAX_ADDRESSES]]


def _unpack(value: object) -> list[Endpoint]:
    """The endpoints of a CONNECT, checked (a malformed one is skipped, not trusted)."""
    endpoints: list[Endpoint] = []
    for item in value if isinstance(value, list) else []:
        if (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and len(item[0]) <= 64
            and isinstance(item[1], int)
            and 0 < item[1] < 65536
        ):
            endpoints.append((item[0], item[1]))
    return endpoints[:MAX_ADDRESSES]


async def _send(stream: Stream, body: dict[str, Any]) -> None:
    await stream.send_message(wire.packb(body), timeout=10.0)


async def _receive(stream: Stream, timeout: float) -> dict[str, Any]:
    data = await stream.receive_message(max_size=MESSAGE_MAX, timeout=timeout)
    if data is None:
        raise RemoteProtocolError(f"{PROTOCOL}: closed before answering")
    body = wire.unpackb(data, PROTOCOL)
    if not isinstance(body, dict):
        raise RemoteProtocolError(f"{PROTOCOL}: expected a map")
    return body

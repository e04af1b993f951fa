"""Reachability: ask a public peer to dial us back, to decide between public and client mode.

A peer started with ``client_mode=None`` listens, connects to an initial peer and asks it to dial
the listening port back. The helper dials only the IP address it sees the request coming from
(never an address the requester names), so the protocol cannot be used to make a peer connect
to third parties. The probe runs a real handshake that must be answered with the requester's
own key, then hangs up (the requester does not keep the probe connection).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from kit.address import Address, AddressError, parse_address
from kit.errors import BootstrapFailed, HandshakeRefused, KitTimeout, PeerError
from kit.p2p import wire
from kit.p2p.api import UnaryHandler
from kit.p2p.connection import Connection
from kit.p2p.identity import PeerID
from kit.p2p.options import PeerOptions

logger = logging.getLogger(__name__)

DIALBACK = "kit/dialback/1"
PROBE_TIMEOUT = 5.0


class DialBackHost(Protocol):
    """What the dial-back needs of the peer it runs on (``kit.p2p.peer.Peer`` has it)."""

    options: PeerOptions

    @property
    def listen_port(self) -> int | None: ...

    def connection(self, peer_id: PeerID) -> Connection | None: ...

    def add_unary_handler(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = ...
    ) -> None: ...

    async def connect(self, address: str | Address, *, timeout: float) -> PeerID: ...

    async def call(
        self, peer_id: PeerID, protocol: str, request: bytes, *, timeout: float
    ) -> bytes: ...

    async def probe(self, address: Address, timeout: float) -> None:
        """Dial ``address``, run the handshake as a probe, hang up (raises when it fails)."""
        ...


def serve_dialback(peer: DialBackHost) -> None:
    async def handle(caller: PeerID, request: bytes) -> bytes:
        body = wire.decode_map(request, "dial-back request", {"port": int})
        connection = peer.connection(caller)
        host = getattr(connection.channel, "remote_host", None) if connection is not None else None
        if host is None or not 0 < body["port"] < 65536:
            return wire.packb({"reachable": False, "observed": None})
        reachable = await _probe(peer, Address(host, body["port"], False, "/", caller))
        return wire.packb({"reachable": reachable, "observed": host})

    peer.add_unary_handler(DIALBACK, handle, max_request=1024)


async def _probe(peer: DialBackHost, address: Address) -> bool:
    try:
        await peer.probe(address, PROBE_TIMEOUT)
    except (PeerError, KitTimeout, OSError) as e:
        logger.debug("dial-back to %s failed: %s", address, e)
        return False
    return True


async def check_reachable(peer: DialBackHost, initial_peers: Sequence[str]) -> bool:
    """True if some initial peer could dial this peer's listening port back.

    Raises:
        BootstrapFailed: no initial peer answered at all (so neither mode can work); a
            ``PeerUnavailable``, and what ``kit.dht.DHT`` raises when none answers.
    """
    port = peer.listen_port
    if port is None:
        return False
    answered = False
    for text in initial_peers:
        try:
            helper = await peer.connect(parse_address(text), timeout=peer.options.dial_timeout)
            response = await peer.call(
                helper, DIALBACK, wire.packb({"port": port}), timeout=2 * PROBE_TIMEOUT
            )
            body = wire.decode_map(response, "dial-back response", {"reachable": bool})
        except (PeerError, KitTimeout, AddressError, asyncio.TimeoutError) as e:
            if isinstance(e, HandshakeRefused):
                raise
            logger.debug("dial-back via %s failed: %s", text, e)
            continue
        answered = True
        if body["reachable"]:
            return True
    if not answered:
        raise BootstrapFailed(
            "failed to connect to bootstrap peers: none of the initial peers answered "
            f"({', '.join(initial_peers)}) - help: check the "
            "addresses the organizer published and your network connection"
        )
    return False

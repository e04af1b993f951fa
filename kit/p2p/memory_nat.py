"""Where an in-process peer is reached: ``memory://`` addresses, NAT kinds, and routes.

A memory peer (``kit.p2p.memory``) is public (it listens: ``memory://<peer id>``), or in client
mode behind a NAT (no listening socket), either *punchable* (endpoint-independent mapping:
``can_accept``) or *symmetric* (no punch lands). A client-mode peer registers with the first
public peer it dials directly: its relay, which it names in its address
``memory://<relay id>/p2p-circuit/p2p/<peer id>`` (``kit.p2p.relay``'s shape); before that
nobody can dial it. A dial to a punchable peer is coordinated through its relay (DCUtR: one and
a half relayed round trips), then the connection is direct; a dial to a symmetric peer stays
relayed: its bytes cross the relay's downlink and uplink, both directions, and the links charge
the relay for them (``kit.testing.links``). A connection either side opened can be used by
both, over the same route. Simplifications: the target's NAT alone decides (a punch from
behind a symmetric NAT to a punchable peer succeeds; a public peer's dial to a symmetric peer
is relayed, though reversing the connection would work); punches never fail; a relay that
shuts down breaks the streams it carried, and its clients register again at their next
direct dial to a public peer.
"""

from __future__ import annotations

import enum

from kit.errors import ConfigError, PeerUnavailable
from kit.p2p.identity import PeerID

MEMORY_SCHEME = "memory://"
CIRCUIT = "/p2p-circuit/p2p/"  # memory://<relay>/p2p-circuit/p2p/<peer>: reached through a relay


class NAT(enum.Enum):
    """How a memory peer can be reached.

    A punchable NAT maps a peer's outgoing connections to one public endpoint whoever it talks
    to (endpoint-independent): a hole punch coordinated through its relay (DCUtR) reaches it
    directly. A symmetric NAT maps each destination to another endpoint: no punch lands, and
    every byte goes through the relay.
    """

    PUBLIC = "public"  # listens: anyone dials it directly
    PUNCHABLE = "punchable"  # client mode, endpoint-independent NAT: direct after a punch
    SYMMETRIC = "symmetric"  # client mode, symmetric NAT: reached through its relay only


def nat_kind(nat: NAT | str | None, client_mode: bool | None) -> NAT:
    """The kind of a new peer from ``create_peer``'s ``nat`` and ``client_mode`` (None: public,
    or symmetric with ``client_mode=True``: a client that aggregates nothing, as before peers
    could be punched).

    Raises:
        ConfigError: ``nat`` is no kind of :class:`NAT`, or contradicts ``client_mode``.
    """
    if nat is None:
        return NAT.SYMMETRIC if client_mode else NAT.PUBLIC
    try:
        kind = NAT(nat)
    except ValueError:
        raise ConfigError(f"nat={nat!r} - help: use one of {[k.value for k in NAT]}") from None
    if client_mode is not None and client_mode != (kind is not NAT.PUBLIC):
        raise ConfigError(
            f"nat={kind.value!r} with client_mode={client_mode} - help: a NAT'd peer is in client "
            "mode (no listening socket), a public one is not; or leave client_mode=None"
        )
    return kind


def memory_address(peer_id: PeerID) -> str:
    """The address of a memory peer: ``memory://<peer id in base58>``."""
    return MEMORY_SCHEME + peer_id.to_base58()


def relayed_memory_address(relay: PeerID, peer_id: PeerID) -> str:
    """The address of a client-mode memory peer registered with ``relay``."""
    return memory_address(relay) + CIRCUIT + peer_id.to_base58()


def parse_memory_address(address: str) -> PeerID:
    """The PeerID named by a ``memory://`` address (direct or relayed: the peer reached).

    Raises:
        ConfigError: ``address`` is not a memory address.
    """
    return parse_memory_route(address)[0]


def parse_memory_route(address: str) -> tuple[PeerID, PeerID | None]:
    """(the peer an address reaches, the relay it goes through or None).

    Raises:
        ConfigError: ``address`` is not a memory address.
    """
    if not isinstance(address, str) or not address.startswith(MEMORY_SCHEME):
        raise ConfigError(
            f"{address!r} is not an in-memory peer address - help: addresses of MemoryPeer look "
            "like memory://<peer id>, take them from peer.get_visible_addresses()"
        )
    body = address[len(MEMORY_SCHEME) :]
    relay, _, target = body.partition(CIRCUIT)
    try:
        if target:
            return PeerID.from_base58(target), PeerID.from_base58(relay)
        return PeerID.from_base58(body), None
    except ValueError as e:
        raise ConfigError(f"{e} - help: copy the address from get_visible_addresses()") from None


def known_routes(peer_id: PeerID, addresses: list[str]) -> list[tuple[PeerID, PeerID | None]]:
    """The routes (reached peer, relay or None) that the ``addresses`` a dialer knows give.

    Raises:
        PeerUnavailable: none reaches ``peer_id``.
    """
    routes = []
    for address in addresses:
        try:
            routes.append(parse_memory_route(address))
        except ConfigError:
            continue
    if not any(reached == peer_id for reached, _ in routes):
        raise PeerUnavailable(
            f"no known address of {peer_id.short()} - help: add_address() or connect() first"
        )
    return routes


def route(
    peer_id: PeerID, routes: list[tuple[PeerID, PeerID | None]], nat: NAT, relay: PeerID | None
) -> tuple[PeerID | None, bool]:
    """How a new connection to ``peer_id`` (behind ``nat``, registered with ``relay``) goes over
    the ``routes`` its dialer knows: (the relay it goes through or None, whether that relay
    only coordinates a hole punch).

    Raises:
        PeerUnavailable: a NAT'd peer, and no known route goes through its relay.
    """
    if nat is NAT.PUBLIC:
        return None, False
    if relay is None or (peer_id, relay) not in routes:
        raise PeerUnavailable(
            f"peer {peer_id.short()} is in client mode (not dialable) and no known relayed "
            "address of it holds - help: take its addresses from get_visible_addresses()"
        )
    return relay, nat is NAT.PUNCHABLE

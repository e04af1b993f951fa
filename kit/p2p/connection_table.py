"""What a peer knows of the others: the connection in use to each, and the addresses to dial.

``ConnectionTable``: one connection per remote peer in use, and which one stays when there are
two. That happens in two ways. Both sides dial each other at once (a DHT lookup and a
matchmaking call cross): each side keeps the one dialed by the smaller PeerID, so both decide
alike without talking. Or a direct connection arrives where a relayed one exists
(hole punching, connection reversal: ``kit.p2p.hole_punch``): the direct one wins, whoever
dialed. The loser is not cut: it drains (its open streams finish, it takes no new ones) and
closes when idle, so nothing in flight breaks.

``AddressBook``: the addresses a peer learnt for others (newest first, direct ones dialed
before relayed ones: a relayed path costs the relay's bandwidth), bounded.

Pure bookkeeping: it opens no socket and spawns no task (``kit.p2p.peer`` dials, accepts and
runs the idle pruning with it).
"""

from __future__ import annotations

from kit.address import Address
from kit.p2p.connection import Connection
from kit.p2p.identity import PeerID
from kit.p2p.wire import Refusal

MAX_ADDRESSES_PER_PEER = 8
MAX_ADDRESS_BOOK = 10_000  # peers; the oldest entry goes first


def new_connection_loses(
    me: PeerID,
    remote: PeerID,
    *,
    new_dialed_by_me: bool,
    new_relayed: bool,
    existing_dialed_by_me: bool,
    existing_relayed: bool,
) -> bool:
    """Whether a new connection to ``remote`` gives way to the open one (see the module)."""
    if new_relayed != existing_relayed:
        return new_relayed  # direct beats relayed
    smaller = min(me, remote)
    dialer_of_new = me if new_dialed_by_me else remote
    return dialer_of_new != smaller and existing_dialed_by_me == (me == smaller)


class ConnectionTable:
    """Every open connection of one peer, and the one in use for each remote peer."""

    def __init__(self, me: PeerID) -> None:
        self.me = me
        self._in_use: dict[PeerID, Connection] = {}
        self._open: set[Connection] = set()  # in use or draining, until they report closed

    def __len__(self) -> int:
        """Connections held until they report closed (a leak shows here, closed or not)."""
        return len(self._open)

    def add(self, connection: Connection, *, closing: bool) -> None:
        """Take a connection whose handshake is done; the older of two to the same peer drains
        (or the new one does: :func:`new_connection_loses`). ``closing``: our peer is shutting
        down, so the connection is closed at once."""
        self._open.add(connection)
        if closing:
            connection.close(Refusal.SHUTDOWN, "peer shutting down")
            return
        remote = connection.remote_peer
        existing = self.get(remote)
        if existing is not None:
            if new_connection_loses(
                self.me,
                remote,
                new_dialed_by_me=connection.is_dialer,
                new_relayed=connection.relayed,
                existing_dialed_by_me=existing.is_dialer,
                existing_relayed=existing.relayed,
            ):
                connection.close_when_idle()
                return
            existing.close_when_idle()
        self._in_use[remote] = connection

    def forget(self, connection: Connection) -> None:
        """``connection`` closed."""
        self._open.discard(connection)
        if self._in_use.get(connection.remote_peer) is connection:
            del self._in_use[connection.remote_peer]

    def get(self, peer_id: PeerID) -> Connection | None:
        """The open connection in use for ``peer_id`` (perhaps draining), if any."""
        connection = self._in_use.get(peer_id)
        return connection if connection is not None and not connection.closed else None

    def peers(self) -> list[PeerID]:
        return [peer for peer, c in self._in_use.items() if not c.closed]

    def every_open(self) -> list[Connection]:
        """Every open connection, including ones draining after a duplicate replaced them."""
        return [connection for connection in self._open if not connection.closed]

    def close_idle(self, now: float, timeout: float) -> None:
        """Close the connections in use that carried no stream for ``timeout`` seconds."""
        for connection in list(self._in_use.values()):
            if connection.idle and now - connection.last_activity > timeout:
                connection.close(Refusal.IDLE, f"no streams for {timeout:.0f} s")


class AddressBook:
    """Where other peers were reached or announced, per peer (not our own addresses)."""

    def __init__(self, me: PeerID) -> None:
        self.me = me
        self._addresses: dict[PeerID, list[Address]] = {}

    def add(self, peer_id: PeerID, address: Address) -> None:
        """Remember ``address`` for ``peer_id`` first; one naming another peer is ignored."""
        if address.peer_id is not None and address.peer_id != peer_id:
            return
        if peer_id == self.me:
            return
        known = self._addresses.setdefault(peer_id, [])
        address = address.with_peer_id(peer_id) if address.relay is None else address
        if address in known:
            known.remove(address)
        known.insert(0, address)
        del known[MAX_ADDRESSES_PER_PEER:]
        if len(self._addresses) > MAX_ADDRESS_BOOK:
            self._addresses.pop(next(iter(self._addresses)))

    def to_dial(self, peer_id: PeerID) -> list[Address]:
        """The addresses to try for ``peer_id``, in order: direct ones first, newest first."""
        return sorted(self._addresses.get(peer_id, []), key=lambda a: a.relay is not None)

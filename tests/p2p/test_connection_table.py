"""The connection table's choices (which of two connections stays) and the address book."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import pytest

from kit.address import Address, parse_address
from kit.p2p.connection import Connection
from kit.p2p.connection_table import (
    MAX_ADDRESS_BOOK,
    MAX_ADDRESSES_PER_PEER,
    AddressBook,
    ConnectionTable,
    new_connection_loses,
)
from kit.p2p.identity import PeerID
from kit.p2p.wire import Refusal

SMALL, LARGE = PeerID(b"\x01" * 32), PeerID(b"\xfe" * 32)


@dataclasses.dataclass(eq=False)
class FakeConnection:
    """The attributes and calls the table uses, recorded."""

    remote_peer: PeerID
    is_dialer: bool
    relayed: bool = False
    closed: bool = False
    idle: bool = True
    last_activity: float = 0.0
    draining: bool = False
    refusal: Refusal | None = None

    def close(self, refusal: Refusal, reason: str) -> None:
        self.closed, self.refusal = True, refusal

    def close_when_idle(self) -> None:
        self.draining = True


def table_with(me: PeerID, *connections: FakeConnection) -> ConnectionTable:
    table = ConnectionTable(me)
    for connection in connections:
        table.add(cast(Connection, connection), closing=False)
    return table


@pytest.mark.parametrize("me, remote", [(SMALL, LARGE), (LARGE, SMALL)])
def test_crossed_dials_keep_the_one_dialed_by_the_smaller_id_on_both_sides(
    me: PeerID, remote: PeerID
) -> None:
    # The same two connections, seen from each end in both arrival orders: one survives.
    by_me, by_remote = FakeConnection(remote, True), FakeConnection(remote, False)
    for first, second in [(by_me, by_remote), (by_remote, by_me)]:
        first.draining = second.draining = False
        table = table_with(me, first, second)
        kept = table.get(remote)
        dialed_by_small = by_me if me == SMALL else by_remote
        assert kept is dialed_by_small
        assert not cast(Any, kept).draining
        other = by_remote if kept is by_me else by_me
        assert other.draining and not other.closed  # it drains: nothing in flight breaks


@pytest.mark.parametrize("dialed_by_me", [True, False])
@pytest.mark.parametrize("me", [SMALL, LARGE])
def test_a_direct_connection_replaces_a_relayed_one_whoever_dialed(
    me: PeerID, dialed_by_me: bool
) -> None:
    remote = LARGE if me == SMALL else SMALL
    relayed = FakeConnection(remote, not dialed_by_me, relayed=True)
    direct = FakeConnection(remote, dialed_by_me)
    table = table_with(me, relayed, direct)
    assert table.get(remote) is direct and relayed.draining
    # and a relayed one arriving after a direct one gives way
    late = FakeConnection(remote, dialed_by_me, relayed=True)
    table.add(cast(Connection, late), closing=False)
    assert table.get(remote) is direct and late.draining


def test_the_rule_is_the_same_on_both_ends() -> None:
    for new_dialed_by_small in (True, False):
        for existing_dialed_by_small in (True, False):
            for new_relayed in (True, False):
                for existing_relayed in (True, False):
                    verdicts = {
                        new_connection_loses(
                            me,
                            remote,
                            new_dialed_by_me=new_dialed_by_small == (me == SMALL),
                            new_relayed=new_relayed,
                            existing_dialed_by_me=existing_dialed_by_small == (me == SMALL),
                            existing_relayed=existing_relayed,
                        )
                        for me, remote in [(SMALL, LARGE), (LARGE, SMALL)]
                    }
                    assert len(verdicts) == 1


def test_forget_closed_and_idle() -> None:
    old = FakeConnection(LARGE, True, last_activity=0.0)
    busy = FakeConnection(PeerID(os.urandom(32)), True, idle=False, last_activity=0.0)
    table = table_with(SMALL, old, busy)
    assert len(table) == 2 and set(table.peers()) == {LARGE, busy.remote_peer}
    table.close_idle(now=100.0, timeout=60.0)
    assert old.closed and old.refusal is Refusal.IDLE and not busy.closed
    assert table.get(LARGE) is None and LARGE not in table.peers()
    assert len(table) == 2  # held until it reports closed
    table.forget(cast(Connection, old))
    assert len(table) == 1 and table.every_open() == [busy]
    # forgetting a draining duplicate leaves the one in use alone
    duplicate = FakeConnection(busy.remote_peer, False, relayed=True)
    table.add(cast(Connection, duplicate), closing=False)
    table.forget(cast(Connection, duplicate))
    assert table.get(busy.remote_peer) is busy


def test_a_connection_taken_while_shutting_down_is_closed() -> None:
    table = ConnectionTable(SMALL)
    connection = FakeConnection(LARGE, False)
    table.add(cast(Connection, connection), closing=True)
    assert connection.closed and connection.refusal is Refusal.SHUTDOWN
    assert table.get(LARGE) is None


def address(port: int, peer: PeerID | None = None) -> Address:
    return Address("10.0.0.1", port, peer_id=peer)


def test_address_book_order_bounds_and_refusals() -> None:
    book = AddressBook(SMALL)
    relay = address(9000, PeerID(os.urandom(32)))
    book.add(LARGE, relay.relayed_to(LARGE))
    for port in range(1, MAX_ADDRESSES_PER_PEER + 3):
        book.add(LARGE, address(port))
    book.add(LARGE, address(5))  # seen again: newest again
    dial = book.to_dial(LARGE)
    assert len(dial) == MAX_ADDRESSES_PER_PEER
    assert dial[0] == address(5, LARGE) and all(a.peer_id == LARGE for a in dial)
    assert [a.relay for a in dial].count(None) == len(dial)  # the oldest, the relayed one, went
    book.add(LARGE, relay.relayed_to(LARGE))
    assert book.to_dial(LARGE)[-1].relay == relay  # relayed: tried after the direct ones
    before = book.to_dial(LARGE)
    book.add(LARGE, address(99, PeerID(os.urandom(32))))  # names another peer: ignored
    book.add(SMALL, address(99))  # ourselves: ignored
    assert book.to_dial(LARGE) == before and book.to_dial(SMALL) == []
    assert parse_address(str(book.to_dial(LARGE)[0])) == book.to_dial(LARGE)[0]


def test_address_book_forgets_the_oldest_peer_beyond_its_bound() -> None:
    book = AddressBook(SMALL)
    peers = [PeerID(i.to_bytes(32, "big")) for i in range(2, MAX_ADDRESS_BOOK + 3)]
    for peer in peers:
        book.add(peer, address(1))
    assert book.to_dial(peers[0]) == [] and book.to_dial(peers[1]) == [address(1, peers[1])]
    assert book.to_dial(peers[-1]) == [address(1, peers[-1])]

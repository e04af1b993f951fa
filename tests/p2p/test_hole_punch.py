"""Relayed connections upgraded to direct ones (kit.p2p.hole_punch), on loopback.

On loopback there is no NAT: a client-mode peer's punch port is its public side too, so both
paths run for real (TCP simultaneous open from two punch ports; a connection reversal), and what
NATs add is in ``tests/netsim/test_hole_punch.py``. Failures (a wrong observed address, garbage
in the coordination, an upgrade asked too often) leave the relayed connection working.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest

from kit.errors import RemoteError
from kit.p2p import hole_punch, wire
from kit.p2p.identity import PeerID
from kit.p2p.options import PeerOptions
from kit.p2p.peer import Peer, create_peer
from kit.p2p.websocket import FastWebSocketChannel

pytestmark = [
    pytest.mark.sockets,
    pytest.mark.skipif(not hole_punch.supported(), reason="needs SO_REUSEPORT (not Windows)"),
]


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout} s")
        await asyncio.sleep(0.05)


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request[::-1]


def direct(peer: Peer, remote: PeerID) -> bool:
    connection = peer.connection(remote)
    return connection is not None and not connection.relayed


async def relay_and_client() -> tuple[Peer, Peer]:
    relay = await create_peer(run_id="test", relay_service=True)
    client = await create_peer(relay.get_visible_addresses(), run_id="test", client_mode=True)
    client.add_unary_handler("echo", echo)
    return relay, client


async def test_two_client_mode_peers_punch_a_direct_connection() -> None:
    relay, alice = await relay_and_client()
    bob = await create_peer(relay.get_visible_addresses(), run_id="test", client_mode=True)
    try:
        assert alice.punch_port is not None and alice.observed_endpoints() == [
            ("127.0.0.1", alice.punch_port)
        ]  # what the relay saw: the connection came from the punch port
        assert alice.can_accept and bob.can_accept
        (address,) = alice.get_visible_addresses()
        await bob.connect(address, timeout=5)
        await wait_until(lambda: direct(bob, alice.peer_id), "bob's direct connection")
        await wait_until(lambda: direct(alice, bob.peer_id), "alice's direct connection")
        assert bob.puncher is not None and alice.puncher is not None
        assert bob.puncher.statistics() == {"tried": 1, "reversed": 0, "punched": 1, "failed": 0}
        assert alice.puncher.statistics()["punched"] == 1
        assert relay.relay_service is not None
        before = relay.relay_service.relayed_bytes
        payload = bytes(range(256)) * 4096  # 1 MiB
        assert await bob.call(alice.peer_id, "echo", payload, timeout=10) == payload[::-1]
        assert relay.relay_service.relayed_bytes == before  # nothing more through the relay
    finally:
        for peer in (bob, alice, relay):
            await peer.shutdown()


async def test_a_public_peer_has_a_client_mode_peer_dial_it_back() -> None:
    relay, alice = await relay_and_client()
    server = await create_peer(run_id="test")
    try:
        (address,) = alice.get_visible_addresses()
        await server.connect(address, timeout=5)
        await wait_until(lambda: direct(server, alice.peer_id), "the reversed connection")
        assert server.puncher is not None and alice.puncher is not None
        assert server.puncher.statistics()["reversed"] == 1
        assert alice.puncher.statistics()["reversed"] == 1
        assert await server.call(alice.peer_id, "echo", b"abc", timeout=5) == b"cba"
    finally:
        for peer in (server, alice, relay):
            await peer.shutdown()


async def test_a_failed_punch_leaves_the_relayed_connection_and_gives_up_after_three() -> None:
    relay, alice = await relay_and_client()
    try:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        nowhere = ("127.0.0.1", closed.getsockname()[1])  # bound, not listening: refuses
        closed.close()
        alice.observed_endpoints = lambda: [nowhere]  # type: ignore[method-assign]
        monkeypatched = hole_punch.PUNCH_SECONDS
        hole_punch.PUNCH_SECONDS = 0.5
        try:
            for attempt in range(3):
                bob = await create_peer(
                    relay.get_visible_addresses(), run_id="test", client_mode=True
                )
                try:
                    (address,) = alice.get_visible_addresses()
                    await bob.connect(address, timeout=5)
                    puncher = bob.puncher
                    assert puncher is not None
                    await wait_until(lambda p=puncher: p.failed == 1, "the punch to fail")  # type: ignore[misc]
                    assert not direct(bob, alice.peer_id)
                    assert await bob.call(alice.peer_id, "echo", b"still", timeout=5) == b"llits"
                    # Alice's side of the punch ends on her own clock, maybe after bob's (a
                    # loaded machine): bob stays until she counted it, as his leaving would
                    # cancel her attempt (which then counts as nothing, rightly).
                    assert alice.puncher is not None
                    await wait_until(
                        lambda p=alice.puncher, n=attempt + 1: p.failed == n,  # type: ignore[misc]
                        "alice to count it",
                    )
                finally:
                    await bob.shutdown()
        finally:
            hole_punch.PUNCH_SECONDS = monkeypatched
        assert alice.puncher.hopeless and not alice.can_accept  # a symmetric NAT, as far as
        # alice can tell: others should not count on reaching her directly
    finally:
        for peer in (alice, relay):
            await peer.shutdown()


async def test_crossed_requests_still_punch_when_the_busy_answer_comes_first() -> None:
    """Both sides ask at once; the larger side's request reaches the smaller one first and is
    declined as busy, which ends the larger side's attempt before the smaller side's request
    reaches it (a loaded machine). That request is served all the same: the pair punches, it is
    not left on the relay for RETRY_AFTER with no verdict on either side."""
    relay, first = await relay_and_client()
    second = await create_peer(relay.get_visible_addresses(), run_id="test", client_mode=True)
    small, large = sorted((first, second), key=lambda p: p.peer_id)
    try:
        assert small.puncher is not None and large.puncher is not None
        # No automatic upgrade when large dials small through the relay: the test drives it.
        large.puncher._last[small.peer_id] = time.monotonic()
        (address,) = small.get_visible_addresses()
        await large.connect(address, timeout=5)
        # small is in its own attempt: large's request is declined as busy.
        small.puncher._last[large.peer_id] = time.monotonic()
        small.puncher._initiating.add(large.peer_id)
        large.puncher._last.pop(small.peer_id)
        assert await large.puncher.upgrade(small.peer_id) is False
        assert large.puncher.tried == 0 and not direct(large, small.peer_id)
        # small's request now arrives, after large's attempt ended: served, and it punches.
        small.puncher._initiating.discard(large.peer_id)
        small.puncher._last.pop(large.peer_id)
        assert await small.puncher.upgrade(large.peer_id) is True
        await wait_until(lambda: direct(large, small.peer_id), "the direct connection")
        assert large.puncher.tried == 1 and small.puncher.punched == 1
        # Served once: another request from small within RETRY_AFTER is declined again.
        small.puncher._last.pop(large.peer_id)
        assert await small.puncher.upgrade(large.peer_id) is False
    finally:
        for peer in (second, first, relay):
            await peer.shutdown()


async def test_an_upgrade_waits_for_the_relays_answer_of_where_our_nat_shows_us() -> None:
    """A peer that dials through the relay before its relay told it where its NAT shows it
    (just started): the upgrade waits for that answer instead of ending with no verdict and
    leaving the pair on the relay for RETRY_AFTER."""
    relay, alice = await relay_and_client()
    bob = await create_peer(relay.get_visible_addresses(), run_id="test", client_mode=True)
    try:
        assert bob.relay_client is not None and bob.puncher is not None
        observed, bob.relay_client.observed = bob.relay_client.observed, []
        assert observed and bob.observed_endpoints() == []

        async def the_answer_arrives() -> None:
            await asyncio.sleep(0.5)
            bob.relay_client.observed = observed  # type: ignore[union-attr]

        arrives = asyncio.create_task(the_answer_arrives())
        (address,) = alice.get_visible_addresses()
        await bob.connect(address, timeout=5)
        await wait_until(lambda: direct(bob, alice.peer_id), "bob's direct connection")
        await arrives
        assert bob.puncher.statistics() == {"tried": 1, "reversed": 0, "punched": 1, "failed": 0}
    finally:
        for peer in (bob, alice, relay):
            await peer.shutdown()


async def test_garbage_and_repeated_requests_are_refused_without_harm() -> None:
    relay, alice = await relay_and_client()
    bob = await create_peer(relay.get_visible_addresses(), run_id="test", client_mode=True)
    try:
        (address,) = alice.get_visible_addresses()
        await bob.connect(address, timeout=5)
        await wait_until(lambda: direct(bob, alice.peer_id), "the first upgrade")
        assert bob.puncher is not None
        assert await bob.puncher.upgrade(alice.peer_id) is False  # asked again too soon
        assert bob.puncher.tried == 1
        for garbage in (b"\xc1", wire.packb([1, 2])):  # not msgpack; not a map
            stream = await bob.open_stream(alice.peer_id, hole_punch.PROTOCOL, timeout=5)
            await stream.send_message(garbage, timeout=5)
            with pytest.raises(RemoteError, match="dcutr"):  # a typed refusal, no hang
                await stream.receive_message(max_size=4096, timeout=5)
        # Asked again within RETRY_AFTER (and with addresses nobody could use): an empty answer.
        stream = await bob.open_stream(alice.peer_id, hole_punch.PROTOCOL, timeout=5)
        await stream.send_message(wire.packb({"addrs": [["x" * 999, 1]]}), timeout=5)
        answer = await stream.receive_message(max_size=4096, timeout=5)
        assert answer is not None and wire.unpackb(answer, "test")["addrs"] == []
        assert await bob.call(alice.peer_id, "echo", b"ok", timeout=5) == b"ko"
    finally:
        for peer in (bob, alice, relay):
            await peer.shutdown()


async def test_a_punched_socket_keeps_the_bytes_it_received_before_the_takeover() -> None:
    left, right = socket.socketpair()
    options = PeerOptions()
    try:
        left.setblocking(False)
        right.setblocking(False)
        client = await hole_punch.channel_over_socket(
            left, options, is_client=True, remote=("127.0.0.1", 1)
        )
        await client.send(b"first")
        await client.send(b"second")
        await asyncio.sleep(0.05)  # both frames are in the other socket's buffer already
        server = await hole_punch.channel_over_socket(
            right, options, is_client=False, remote=("127.0.0.1", 2)
        )
        assert isinstance(server, FastWebSocketChannel)
        assert bytes(await server.recv()) == b"first"
        assert bytes(await server.recv()) == b"second"
        await server.send(b"back")
        assert bytes(await client.recv()) == b"back"
        await client.close()
        await server.close()
    finally:
        left.close()
        right.close()


def test_coordination_addresses_are_checked() -> None:
    assert hole_punch._unpack([["1.2.3.4", 80], ["::1", 65535]]) == [
        ("1.2.3.4", 80),
        ("::1", 65535),
    ]
    bad = [["1.2.3.4", 0], ["1.2.3.4", 70000], [1, 2], ["a" * 65, 1], "x", ["1.2.3.4"], None]
    assert hole_punch._unpack(bad) == [] and hole_punch._unpack("nope") == []
    assert (
        len(hole_punch._unpack([["1.2.3.4", p] for p in range(1, 50)])) == hole_punch.MAX_ADDRESSES
    )

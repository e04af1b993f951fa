"""Client-mode peers (no listening socket) reached through relays; failover; relay limits.

Hole punching is off here: these tests are about what the relay carries, and a punched
connection would take the bytes off it (that is ``tests/p2p/test_hole_punch.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kit.address import parse_address
from kit.errors import ConnectionLost, PeerUnavailable, StreamReset
from kit.p2p.identity import PeerID
from kit.p2p.peer import Peer, create_peer
from kit.p2p.relay import RelayLimits, TokenBucket
from tests.p2p.test_peer import start_peer_process

pytestmark = pytest.mark.sockets


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request[::-1]


async def wait_until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_client_mode_peer_is_reachable_through_a_relay() -> None:
    relay = await create_peer(run_id="test", hole_punching=False, relay_service=True)
    client = await create_peer(
        relay.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
    )
    outsider = await create_peer(run_id="test", hole_punching=False)
    try:
        assert client.client_mode and client.listen_port is None and client._listener.server is None
        (address,) = client.get_visible_addresses()
        assert "/p2p-circuit/p2p/" in address and parse_address(address).peer_id == client.peer_id
        client.add_unary_handler("echo", echo)
        assert await outsider.connect(address, timeout=5) == client.peer_id
        assert await outsider.call(client.peer_id, "echo", b"abc", timeout=5) == b"cba"
        # ...and the client can call the outsider back over the same relayed connection
        outsider.add_unary_handler("echo", echo)
        assert await client.call(outsider.peer_id, "echo", b"xyz", timeout=5) == b"zyx"
        assert relay.relay_service is not None and relay.relay_service.relayed_bytes > 0
    finally:
        for peer in (outsider, client, relay):
            await peer.shutdown()


async def test_two_client_mode_peers_talk_through_the_relay() -> None:
    relay = await create_peer(run_id="test", hole_punching=False, relay_service=True)
    first = await create_peer(
        relay.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
    )
    second = await create_peer(
        relay.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
    )
    try:
        first.add_unary_handler("echo", echo, max_request=2**23)
        second.add_address(first.peer_id, first.get_visible_addresses()[0])
        payload = bytes(range(256)) * 20_000  # 5 MB: several frames, flow control through the relay
        assert (
            await second.call(first.peer_id, "echo", payload, timeout=10, max_response=2**23)
            == payload[::-1]
        )
    finally:
        for peer in (second, first, relay):
            await peer.shutdown()


@pytest.mark.processes
async def test_failover_when_a_relay_process_dies() -> None:
    process, dying_address = start_peer_process("--relay")
    spare = await create_peer(run_id="test", hole_punching=False, relay_service=True)
    third = await create_peer(run_id="test", hole_punching=False, relay_service=True)
    client: Peer | None = None
    outsider = await create_peer(run_id="test", hole_punching=False)
    try:
        relays = [dying_address, spare.get_visible_addresses()[0], third.get_visible_addresses()[0]]
        client = await create_peer(relays, run_id="test", hole_punching=False, client_mode=True)
        client.add_unary_handler("echo", echo)
        assert client.relay_client is not None
        client.relay_client.retry_interval = 0.2
        dying = parse_address(dying_address).peer_id
        assert any(
            a.relay is not None and a.relay.peer_id == dying
            for a in map(parse_address, client.get_visible_addresses())
        )
        process.kill()
        await wait_until(lambda: third.relay_service.is_registered(client.peer_id))  # type: ignore[union-attr]
        addresses = client.get_visible_addresses()
        assert not any(str(dying) in a for a in addresses) and len(addresses) == 2
        via_third = next(a for a in addresses if str(third.peer_id) in a)
        await outsider.connect(via_third, timeout=5)
        assert await outsider.call(client.peer_id, "echo", b"up", timeout=5) == b"pu"
    finally:
        process.kill()
        process.wait(10)
        for peer in (outsider, client, third, spare):
            if peer is not None:
                await peer.shutdown()


async def test_relay_limits_circuits_and_bytes() -> None:
    limits = RelayLimits(max_circuits_per_peer=1, max_bytes_per_circuit=2 * 1024**2)
    relay = await create_peer(
        run_id="test", hole_punching=False, relay_service=True, relay_limits=limits
    )
    client = await create_peer(
        relay.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
    )
    first, second = (
        await create_peer(run_id="test", hole_punching=False),
        await create_peer(run_id="test", hole_punching=False),
    )
    try:
        client.add_unary_handler("echo", echo)
        address = client.get_visible_addresses()[0]
        await first.connect(address, timeout=5)
        with pytest.raises(PeerUnavailable, match="circuit limit"):
            await second.connect(address, timeout=5)
        with pytest.raises((ConnectionLost, StreamReset)):  # the circuit is cut at 2 MiB
            for _ in range(10):
                await first.call(
                    client.peer_id, "echo", b"x" * 1024**2, timeout=5, max_response=2**21
                )
        await wait_until(lambda: not relay.relay_service._circuits)  # type: ignore[union-attr]
        assert await second.connect(address, timeout=5) == client.peer_id  # the slot is free again
    finally:
        for peer in (second, first, client, relay):
            await peer.shutdown()


async def test_client_mode_without_relays_explains_itself() -> None:
    with pytest.raises(PeerUnavailable, match="help:"):
        await create_peer(run_id="test", hole_punching=False, client_mode=True)
    public = await create_peer(run_id="test", hole_punching=False)  # listens, but relays for nobody
    try:
        with pytest.raises(PeerUnavailable, match="relay_service=True"):
            await create_peer(
                public.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
            )
    finally:
        await public.shutdown()


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=100.0, burst=50, now=0.0)
    assert bucket.delay(50, now=0.0) == 0.0
    assert bucket.delay(100, now=0.0) == pytest.approx(1.0)
    assert bucket.delay(0, now=2.0) == 0.0

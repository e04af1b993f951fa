"""MemoryNetwork / MemoryPeer: the in-process PeerAPI that DHT and averaging tests run on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from kit.errors import (
    ConfigError,
    ConnectionLost,
    FrameTooLarge,
    IdentityInUse,
    KitTimeout,
    KitUsageError,
    LocalProtocolError,
    PeerUnavailable,
    RemoteError,
    StreamReset,
    UnknownProtocol,
)
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.memory import MemoryNetwork, MemoryPeer
from kit.p2p.memory_nat import (
    NAT,
    memory_address,
    parse_memory_address,
    parse_memory_route,
    relayed_memory_address,
)
from tests.conftest import MS

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, 10_000 * MS)

    return asyncio.run(bounded())


async def echo(caller: PeerID, request: bytes) -> bytes:
    return caller.to_bytes() + request


async def pair(network: MemoryNetwork, **b_options: Any) -> tuple[MemoryPeer, MemoryPeer]:
    a = await network.create_peer()
    b = await network.create_peer(**b_options)
    b.add_unary_handler("echo", echo)
    return a, b


def test_memory_peer_is_a_peer_api() -> None:
    async def scenario() -> None:
        peer: PeerAPI = await MemoryNetwork().create_peer()  # mypy checks the protocol here
        assert peer.get_visible_addresses() == [memory_address(peer.peer_id)]

    run(scenario())


def test_call_after_connect_reaches_the_handler_with_the_callers_id() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        a, b = await pair(network)
        assert await a.connect(b.get_visible_addresses()[0], timeout=1.0) == b.peer_id
        response = await a.call(b.peer_id, "echo", b"hi", timeout=1.0)
        assert response == a.peer_id.to_bytes() + b"hi"
        assert b.stats["echo"] == 1
        # the connection works both ways: b may call a back without knowing a's address
        a.add_unary_handler("echo", echo)
        assert await b.call(a.peer_id, "echo", b"", timeout=1.0) == b.peer_id.to_bytes()

    run(scenario())


def test_dialing_needs_a_known_address_and_a_running_peer() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        a, b = await pair(network)
        with pytest.raises(PeerUnavailable, match="no known address"):
            await a.call(b.peer_id, "echo", b"", timeout=1.0)
        a.add_address(b.peer_id, memory_address(b.peer_id))
        assert await a.call(b.peer_id, "echo", b"x", timeout=1.0)
        await b.shutdown()
        with pytest.raises(PeerUnavailable):
            await a.call(b.peer_id, "echo", b"", timeout=1.0)
        with pytest.raises(ConfigError, match="memory://"):
            await a.connect("ws://127.0.0.1:1", timeout=1.0)
        with pytest.raises(KitUsageError):
            await a.call(a.peer_id, "echo", b"", timeout=1.0)

    run(scenario())


def test_addresses_parse_back_to_peer_ids() -> None:
    peer_id = PeerID(bytes(range(32)))
    assert parse_memory_address(memory_address(peer_id)) == peer_id
    with pytest.raises(ConfigError):
        parse_memory_address("memory://not-base58-0OIl")


def test_handler_errors_unknown_protocols_and_sizes_are_typed() -> None:
    async def failing(caller: PeerID, request: bytes) -> bytes:
        raise ValueError("bad request")

    async def huge(caller: PeerID, request: bytes) -> bytes:
        return b"x" * 1000

    async def scenario() -> None:
        network = MemoryNetwork()
        a, b = await pair(network)
        b.add_unary_handler("fail", failing)
        b.add_unary_handler("huge", huge)
        b.add_unary_handler("small", echo, max_request=10)
        await a.connect(memory_address(b.peer_id), timeout=1.0)
        with pytest.raises(RemoteError) as error:
            await a.call(b.peer_id, "fail", b"", timeout=1.0)
        assert error.value.code == "handler_error"
        assert "ValueError: bad request" in error.value.message
        with pytest.raises(UnknownProtocol):
            await a.call(b.peer_id, "nothing", b"", timeout=1.0)
        with pytest.raises(RemoteError, match="FrameTooLarge"):
            await a.call(b.peer_id, "small", b"x" * 11, timeout=1.0)
        with pytest.raises(FrameTooLarge):
            await a.call(b.peer_id, "huge", b"", timeout=1.0, max_response=999)
        assert await a.call(b.peer_id, "echo", b"still serving", timeout=1.0)

    run(scenario())


def test_timeouts_cancel_the_handler_and_shutdown_breaks_calls_in_flight() -> None:
    cancelled = []

    async def slow(caller: PeerID, request: bytes) -> bytes:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(caller)
            raise
        return b""

    async def scenario() -> None:
        network = MemoryNetwork()
        a, b = await pair(network)
        b.add_unary_handler("slow", slow)
        await a.connect(memory_address(b.peer_id), timeout=1.0)
        started = time.monotonic()
        with pytest.raises(KitTimeout):
            await a.call(b.peer_id, "slow", b"", timeout=50 * MS)
        assert time.monotonic() - started < 1.0
        await asyncio.sleep(0)
        assert cancelled == [a.peer_id]
        call = asyncio.ensure_future(a.call(b.peer_id, "slow", b"", timeout=5.0))
        await asyncio.sleep(10 * MS)
        await b.shutdown()
        with pytest.raises(ConnectionLost):
            await call

    run(scenario())


def test_client_mode_peer_is_reachable_only_at_its_relay_after_it_dialed_out() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        a, client = await pair(network, client_mode=True)
        third = await network.create_peer()
        assert client.client_mode and not client.can_accept and client.nat is NAT.SYMMETRIC
        assert a.can_accept and a.nat is NAT.PUBLIC
        assert client.get_visible_addresses() == [] and client.relay is None
        a.add_address(client.peer_id, memory_address(client.peer_id))
        with pytest.raises(PeerUnavailable, match="client mode"):
            await a.call(client.peer_id, "echo", b"", timeout=1.0)
        await client.connect(memory_address(third.peer_id), timeout=1.0)  # registers there
        relayed = relayed_memory_address(third.peer_id, client.peer_id)
        assert client.relay == third.peer_id and client.get_visible_addresses() == [relayed]
        assert parse_memory_route(relayed) == (client.peer_id, third.peer_id)
        assert parse_memory_address(relayed) == client.peer_id
        with pytest.raises(PeerUnavailable, match="client mode"):  # not a direct address
            await a.call(client.peer_id, "echo", b"", timeout=1.0)
        a.add_address(client.peer_id, relayed)
        assert await a.call(client.peer_id, "echo", b"", timeout=1.0) == a.peer_id.to_bytes()

    run(scenario())


def test_a_relays_shutdown_breaks_what_it_relayed_and_its_clients_register_again() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        a, client = await pair(network, client_mode=True)
        relay, spare = await network.create_peer(), await network.create_peer()

        async def hold(stream: StreamAPI) -> None:
            await stream.receive_message(timeout=5.0)

        client.add_stream_handler("hold", hold)
        await client.connect(memory_address(relay.peer_id), timeout=1.0)
        await client.connect(memory_address(spare.peer_id), timeout=1.0)
        assert client.relay == relay.peer_id  # the first public peer it dialed
        a.add_address(client.peer_id, client.get_visible_addresses()[0])
        stream = await a.open_stream(client.peer_id, "hold", timeout=1.0)
        await relay.shutdown()
        with pytest.raises(ConnectionLost, match="relay"):
            await stream.receive_message(timeout=1.0)
        assert client.relay == spare.peer_id  # registered with its other public connection
        with pytest.raises(PeerUnavailable):  # the old relayed address is gone with its relay
            await a.call(client.peer_id, "echo", b"", timeout=1.0)
        a.add_address(client.peer_id, client.get_visible_addresses()[0])
        assert await a.call(client.peer_id, "echo", b"", timeout=1.0)

    run(scenario())


def test_no_nat_kind_listens_a_punch_goes_direct_and_a_symmetric_nat_stays_relayed() -> None:
    """Neither kind of NAT'd peer can be dialed at its own address, nor before it registered
    with a relay. Through its relayed address, a dial to a punchable peer ends in a direct
    connection (the relay going away leaves its streams alone), one to a symmetric peer stays
    relayed (its streams break with the relay)."""

    async def echo_all(stream: StreamAPI) -> None:
        while (message := await stream.receive_message(timeout=5.0)) is not None:
            await stream.send_message(message, timeout=5.0)

    async def scenario() -> None:
        network = MemoryNetwork()
        dialer, relay = await network.create_peer(), await network.create_peer()
        streams: dict[NAT, StreamAPI] = {}
        for kind in (NAT.PUNCHABLE, NAT.SYMMETRIC):
            target = await network.create_peer(nat=kind)
            target.add_stream_handler("echo", echo_all)
            dialer.add_address(target.peer_id, memory_address(target.peer_id))
            with pytest.raises(PeerUnavailable, match="client mode"):  # no listening socket
                await dialer.open_stream(target.peer_id, "echo", timeout=1.0)
            assert target.get_visible_addresses() == []  # not registered anywhere yet
            await target.connect(memory_address(relay.peer_id), timeout=1.0)
            [relayed] = target.get_visible_addresses()
            assert relayed == relayed_memory_address(relay.peer_id, target.peer_id)
            dialer.add_address(target.peer_id, relayed)
            streams[kind] = await dialer.open_stream(target.peer_id, "echo", timeout=1.0)
            await streams[kind].send_message(b"before", timeout=1.0)
            assert await streams[kind].receive_message(timeout=1.0) == b"before"
        await relay.shutdown()
        await streams[NAT.PUNCHABLE].send_message(b"after", timeout=1.0)
        assert await streams[NAT.PUNCHABLE].receive_message(timeout=1.0) == b"after"
        with pytest.raises(ConnectionLost, match="relay"):
            await streams[NAT.SYMMETRIC].receive_message(timeout=1.0)

    run(scenario())


def test_nat_kinds_and_client_mode_must_agree() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        punchable = await network.create_peer(nat="punchable")
        assert punchable.client_mode and punchable.can_accept
        assert (await network.create_peer(client_mode=True, nat=NAT.SYMMETRIC)).nat is NAT.SYMMETRIC
        with pytest.raises(ConfigError, match="help:"):
            await network.create_peer(client_mode=False, nat="punchable")
        with pytest.raises(ConfigError, match="help:"):
            await network.create_peer(client_mode=True, nat="public")
        with pytest.raises(ConfigError, match="help:"):
            await network.create_peer(nat="full-cone")

    run(scenario())


def test_faulty_link_drops_refuses_and_delays() -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        a, b = await pair(network)
        await a.connect(memory_address(b.peer_id), timeout=1.0)
        link = network.link(b.peer_id)
        with link.drop():
            started = time.monotonic()
            with pytest.raises(KitTimeout):
                await a.call(b.peer_id, "echo", b"", timeout=50 * MS)
            assert time.monotonic() - started >= 45 * MS
        with link.refuse(), pytest.raises(PeerUnavailable):
            await a.call(b.peer_id, "echo", b"", timeout=1.0)
        with link.delay(30 * MS):
            started = time.monotonic()
            await a.call(b.peer_id, "echo", b"", timeout=1.0)
            assert time.monotonic() - started >= 25 * MS
            with pytest.raises(KitTimeout):
                await a.call(b.peer_id, "echo", b"", timeout=10 * MS)
        assert b.stats["echo"] == 1  # only the delayed call that was not too late got through
        assert await a.call(b.peer_id, "echo", b"", timeout=1.0)

    run(scenario())


def test_identity_file_is_locked_while_the_peer_runs(tmp_path: Any) -> None:
    async def scenario() -> None:
        network = MemoryNetwork()
        path = tmp_path / "peer.key"
        first = await network.create_peer(identity_path=path)
        with pytest.raises(IdentityInUse):
            await network.create_peer(identity_path=path)
        await first.shutdown()
        again = await network.create_peer(identity_path=path)
        assert again.peer_id == first.peer_id

    run(scenario())


async def open_echo_stream(network: MemoryNetwork, handler: Any) -> tuple[StreamAPI, MemoryPeer]:
    a = await network.create_peer()
    b = await network.create_peer()
    b.add_stream_handler("stream", handler)
    await a.connect(memory_address(b.peer_id), timeout=1.0)
    return await a.open_stream(b.peer_id, "stream", timeout=1.0), b


def test_streams_deliver_messages_in_order_and_half_close() -> None:
    async def doubler(stream: StreamAPI) -> None:
        while (message := await stream.receive_message(timeout=1.0)) is not None:
            await stream.send_message(message * 2, timeout=1.0)

    async def scenario() -> None:
        stream, b = await open_echo_stream(MemoryNetwork(), doubler)
        for i in range(20):
            await stream.send_message(bytes([i]), timeout=1.0)
            assert await stream.receive_message(timeout=1.0) == bytes([i, i])
        await stream.close()
        assert await stream.receive_message(timeout=1.0) is None
        with pytest.raises(LocalProtocolError):
            await stream.send_message(b"after close", timeout=1.0)

    run(scenario())


def test_stream_flow_control_blocks_a_sender_until_the_receiver_reads() -> None:
    release = asyncio.Event()
    received: list[bytes] = []

    async def lazy(stream: StreamAPI) -> None:
        await release.wait()
        while (message := await stream.receive_message(timeout=1.0)) is not None:
            received.append(message)

    async def scenario() -> None:
        network = MemoryNetwork(stream_window=4)
        stream, _ = await open_echo_stream(network, lazy)
        for i in range(4):
            await stream.send_message(bytes([i]), timeout=1.0)
        with pytest.raises(KitTimeout):
            await stream.send_message(b"window full", timeout=30 * MS)
        release.set()
        await stream.send_message(bytes([4]), timeout=1.0)
        await stream.close()
        await asyncio.sleep(10 * MS)
        assert received == [bytes([i]) for i in range(5)]

    run(scenario())


def test_stream_errors_reset_size_limit_and_handler_failure() -> None:
    async def fail_after_one(stream: StreamAPI) -> None:
        await stream.receive_message(timeout=1.0)
        raise RuntimeError("handler broke")

    async def hold(stream: StreamAPI) -> None:
        await stream.receive_message(timeout=1.0)

    async def scenario() -> None:
        network = MemoryNetwork()
        stream, _ = await open_echo_stream(network, fail_after_one)
        await stream.send_message(b"x", timeout=1.0)
        with pytest.raises(RemoteError, match="RuntimeError: handler broke"):
            await stream.receive_message(timeout=1.0)

        stream, _ = await open_echo_stream(network, hold)
        stream.reset("cancelled", "changed my mind")
        with pytest.raises(StreamReset):
            await stream.send_message(b"x", timeout=1.0)

        async def big(stream: StreamAPI) -> None:
            await stream.send_message(b"x" * 100, timeout=1.0)

        stream, _ = await open_echo_stream(network, big)
        with pytest.raises(FrameTooLarge):
            await stream.receive_message(max_size=99, timeout=1.0)

        stream, server = await open_echo_stream(network, hold)
        await server.shutdown()
        with pytest.raises(ConnectionLost):
            await stream.receive_message(timeout=1.0)

    run(scenario())

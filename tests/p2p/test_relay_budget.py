"""What circuits make a relay hold: charged to RelayLimits budgets, not to the connection's.

Destinations that read their connection to the relay slowly (or never) are simulated by pausing
the reading of that connection's socket: the relay's writer then waits for their credit, and what
the source keeps sending piles up unread at the relay, as behind a slow Colab downlink. Hole punching is off: it would take the circuits off the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable

import pytest

from kit.errors import PeerError
from kit.p2p.identity import PeerID
from kit.p2p.options import RelayLimits
from kit.p2p.peer import Peer, create_peer
from kit.p2p.stream import Stream
from kit.p2p.websocket import FastWebSocketChannel
from tests.p2p.test_peer import in_use

pytestmark = pytest.mark.sockets

MiB = 2**20


def gate_reads_from(peer: Peer, relay_id: PeerID, gate: asyncio.Event) -> asyncio.Task[None]:
    """``peer`` stops reading its connection to the relay (its socket) until ``gate`` is set."""
    channel = in_use(peer, relay_id).channel
    assert isinstance(channel, FastWebSocketChannel)
    transport = channel._transport
    transport.pause_reading()

    async def reopen() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(gate.wait(), 30)
        if not transport.is_closing():
            transport.resume_reading()

    return asyncio.ensure_future(reopen())


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout} s")
        await asyncio.sleep(0.02)


def sink(received: list[str]) -> Callable[[Stream], object]:
    """A handler that reads whole streams and appends their sha256 to ``received``."""

    async def handler(stream: Stream) -> None:
        digest = hashlib.sha256()
        while (data := await stream.receive_message(max_size=2 * MiB, timeout=30)) is not None:
            digest.update(data)
        received.append(digest.hexdigest())

    return handler


async def push(peer: Peer, target: PeerID, size: int, seed: int) -> str:
    """Send ``size`` bytes on a new "sink" stream in 1 MiB messages; their sha256."""
    digest = hashlib.sha256()
    stream = await peer.open_stream(target, "sink", timeout=10)
    for index in range(size // MiB):
        message = bytes([(seed + index) % 256]) * MiB
        digest.update(message)
        await stream.send_message(message, timeout=30)
    await stream.close()
    return digest.hexdigest()


def holding(relay: Peer, peer_id: PeerID) -> int:
    """Unread bytes the relay holds on its connection to ``peer_id``, circuits or not."""
    mux = in_use(relay, peer_id).mux
    return mux.buffers.buffered + mux.buffers.circuit_buffered


def resets_for_memory(peers: list[Peer]) -> int:
    return sum(c.mux.shed_count for peer in peers for c in peer.all_connections())


async def test_many_slow_circuits_of_one_client_are_not_reset_at_default_limits() -> None:
    relay = await create_peer(run_id="test", hole_punching=False, relay_service=True)
    client = await create_peer(
        relay.get_visible_addresses(), run_id="test", hole_punching=False, client_mode=True
    )
    destinations = [await create_peer(run_id="test", hole_punching=False) for _ in range(16)]
    peers = [*destinations, client, relay]
    received: dict[PeerID, list[str]] = {d.peer_id: [] for d in destinations}
    gate = asyncio.Event()
    gates: list[asyncio.Task[None]] = []
    try:
        (address,) = client.get_visible_addresses()
        for destination in destinations:
            handler = sink(received[destination.peer_id])
            destination.add_stream_handler("sink", handler)  # type: ignore[arg-type]
            assert await destination.connect(address, timeout=10) == client.peer_id
            gates.append(gate_reads_from(destination, relay.peer_id, gate))
        window = client.options.limits.receive_window
        # Two streams of one window each per circuit: the relay's hop to the destination takes
        # one window of credit, what is left piles up at the relay, unread, on the client's
        # connection: 16 circuits x ~7 MiB, more than its connection_buffer (64 MiB).
        pushes = [
            asyncio.ensure_future(push(client, d.peer_id, window, seed))
            for seed, d in enumerate(destinations * 2)
        ]
        over = client.options.limits.connection_buffer + 8 * MiB
        await wait_until(
            lambda: holding(relay, client.peer_id) > over or resets_for_memory(peers) > 0,
            "the relay holding more than the client's connection_buffer",
        )
        gate.set()
        sent = await asyncio.wait_for(asyncio.gather(*pushes), 60)
        await wait_until(lambda: sum(map(len, received.values())) == len(sent), "all received")
        count = len(destinations)
        assert {d.peer_id: sorted(received[d.peer_id]) for d in destinations} == {
            d.peer_id: sorted(sent[i::count]) for i, d in enumerate(destinations)
        }
        # Nothing was reset for memory anywhere: not at the relay, not at the endpoints (whose
        # circuit streams are read by their relayed connections' readers as frames come).
        assert resets_for_memory(peers) == 0
        peak = in_use(relay, client.peer_id).mux.buffers.circuit_peak
        assert over < peak <= relay.options.relay_limits.peer_buffer
    finally:
        gate.set()
        await asyncio.gather(*gates, return_exceptions=True)
        for peer in peers:
            await peer.shutdown()


async def test_a_client_flooding_circuits_to_destinations_that_never_read_is_bounded() -> None:
    limits = RelayLimits(peer_buffer=12 * MiB, buffer_budget=20 * MiB)
    relay = await create_peer(
        run_id="test", hole_punching=False, relay_service=True, relay_limits=limits
    )
    relays = relay.get_visible_addresses()
    attackers = [
        await create_peer(relays, run_id="test", hole_punching=False, client_mode=True)
        for _ in range(2)
    ]
    stalled = [
        await create_peer(relays, run_id="test", hole_punching=False, client_mode=True)
        for _ in range(4)
    ]
    honest = await create_peer(relays, run_id="test", hole_punching=False, client_mode=True)
    outsider = await create_peer(run_id="test", hole_punching=False)
    peers = [outsider, honest, *stalled, *attackers, relay]
    never = asyncio.Event()
    floods: list[asyncio.Future[str]] = []
    gates: list[asyncio.Task[None]] = []
    try:
        window = relay.options.limits.receive_window
        for target in stalled:
            target.add_stream_handler("sink", sink([]))  # type: ignore[arg-type]
            for attacker in attackers:
                await attacker.connect(target.get_visible_addresses()[0], timeout=10)
            gates.append(gate_reads_from(target, relay.peer_id, never))
        # Each attacker: 4 circuits (its own CONNECT streams at the relay), 2 windows each.
        floods = [
            asyncio.ensure_future(push(attacker, target.peer_id, window, seed))
            for attacker in attackers
            for seed, target in enumerate(stalled * 2)
        ]
        await wait_until(lambda: resets_for_memory([relay]) >= 2, "circuits reset for memory")
        service = relay.relay_service
        assert service is not None
        for attacker in attackers:
            assert in_use(relay, attacker.peer_id).mux.buffers.circuit_peak <= limits.peer_buffer
        assert 0 < service.buffer_ledger.peak <= limits.buffer_budget
        # Circuits are not the relay's own streams: its own budgets hold nothing of them.
        assert relay.buffer_ledger.peak < relay.options.limits.connection_buffer
        # ...and it keeps serving others: more than a window through a circuit, intact.
        received: list[str] = []
        honest.add_stream_handler("sink", sink(received))  # type: ignore[arg-type]
        await outsider.connect(honest.get_visible_addresses()[0], timeout=10)
        sent = await asyncio.wait_for(push(outsider, honest.peer_id, 2 * window, 7), 30)
        await wait_until(lambda: received == [sent], "the honest transfer")
        assert service.buffer_ledger.total <= limits.buffer_budget
    finally:
        for flood in floods:
            flood.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
        never.set()
        await asyncio.gather(*gates, return_exceptions=True)
        for peer in peers:
            with contextlib.suppress(PeerError):
                await peer.shutdown()

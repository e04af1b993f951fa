"""Simulated links through NATs: relayed bytes are charged to the relay, punches cost their
coordination and then go direct (``kit.testing.links`` with ``kit.p2p.memory_nat``'s NAT
kinds)."""

from __future__ import annotations

import asyncio

import pytest

from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.memory import MemoryNetwork, MemoryPeer
from kit.p2p.memory_nat import NAT, memory_address
from kit.testing.links import (
    HEADER_BYTES,
    MBIT,
    PUNCH_MESSAGE_BYTES,
    PUNCH_MESSAGES,
    LinkProfile,
    SimulatedLinks,
)
from kit.testing.virtual_time import run_virtual

MB = 10**6 - HEADER_BYTES  # a payload of 1 MB on the wire: 1 s at 8 Mbit/s
LATENCY = 0.0125  # one way to the core: 50 ms round trips between two peers


def test_a_relayed_message_crosses_the_relays_downlink_and_uplink() -> None:
    links = SimulatedLinks(LinkProfile(upload=8 * MBIT, download=8 * MBIT, latency=LATENCY))
    a, relay, b = (PeerID(bytes([i + 1]) * 32) for i in range(3))
    sent, arrived = links.transmit(a, b, MB, now=0.0, via=relay)
    # Store and forward: 1 s out of a, then 1 s out of the relay, plus both hops' latency.
    assert sent == pytest.approx(1.0) and arrived == pytest.approx(2.0 + 4 * LATENCY)
    assert links.bytes_sent[a] == links.bytes_received[b] == 10**6
    assert links.bytes_received[relay] == links.bytes_sent[relay] == 10**6
    assert links.bytes_relayed[relay] == 10**6 and links.total_bytes(relay) == 2 * 10**6
    # The relay's uplink is shared with its own flows: its own 1 MB to b starts alongside.
    own_sent, _ = links.transmit(relay, b, MB, now=1.0)
    assert own_sent == pytest.approx(3.0)  # half the uplink for 2 s (the relayed message too)


async def _peers(nat: NAT) -> tuple[SimulatedLinks, MemoryPeer, MemoryPeer, MemoryPeer]:
    """A public dialer, a public relay and a NAT'd target registered with the relay."""
    links = SimulatedLinks(LinkProfile(upload=8 * MBIT, download=8 * MBIT, latency=LATENCY))
    network = MemoryNetwork(links=links, stream_window=4)
    dialer, relay = await network.create_peer(), await network.create_peer()
    target = await network.create_peer(nat=nat)
    await target.connect(memory_address(relay.peer_id), timeout=10)
    dialer.add_address(target.peer_id, target.get_visible_addresses()[0])
    links.reset_counters()
    return links, dialer, relay, target


async def _echo_one_megabyte(dialer: MemoryPeer, target: MemoryPeer) -> tuple[float, float]:
    """Seconds to open a stream to ``target``, and until 1 MB went there and back."""

    async def echo(stream: StreamAPI) -> None:
        message = await stream.receive_message(max_size=2 * 10**6, timeout=60)
        assert message is not None
        await stream.send_message(message, timeout=60)

    target.add_stream_handler("echo", echo)
    loop = asyncio.get_running_loop()
    began = loop.time()
    stream = await dialer.open_stream(target.peer_id, "echo", timeout=10)
    connected = loop.time() - began
    await stream.send_message(b"x" * MB, timeout=60)
    assert await stream.receive_message(max_size=2 * 10**6, timeout=60) == b"x" * MB
    return connected, loop.time() - began


def test_bytes_to_a_symmetric_nat_peer_are_relayed_and_charged_to_its_relay() -> None:
    async def scenario() -> tuple[float, float, SimulatedLinks, list[PeerID]]:
        links, dialer, relay, target = await _peers(NAT.SYMMETRIC)
        assert not target.can_accept
        connected, elapsed = await _echo_one_megabyte(dialer, target)
        return connected, elapsed, links, [dialer.peer_id, relay.peer_id, target.peer_id]

    connected, elapsed, links, (dialer, relay, target) = run_virtual(scenario())
    relayed_round_trip = 4 * 2 * LATENCY  # dialer -> relay -> target and back: 0.1 s
    assert connected == pytest.approx(2 * relayed_round_trip)  # CONNECT, then the handshake
    # 1 MB each way, each crossing two 8 Mbit/s hops: about 4 s.
    assert elapsed == pytest.approx(connected + 4.0 + 2 * relayed_round_trip / 2, abs=0.01)
    assert links.bytes_relayed[relay] == 2 * 10**6  # both directions
    assert links.total_bytes(relay) == 4 * 10**6  # each relayed byte in and out
    assert links.total_bytes(dialer) == links.total_bytes(target) == 2 * 10**6


def test_a_punchable_peer_is_reached_directly_after_the_punch() -> None:
    async def scenario() -> tuple[float, float, SimulatedLinks, list[PeerID]]:
        links, dialer, relay, target = await _peers(NAT.PUNCHABLE)
        assert target.client_mode and target.can_accept
        connected, elapsed = await _echo_one_megabyte(dialer, target)
        return connected, elapsed, links, [dialer.peer_id, relay.peer_id, target.peer_id]

    connected, elapsed, links, (dialer, relay, target) = run_virtual(scenario())
    relayed_round_trip, round_trip = 4 * 2 * LATENCY, 2 * 2 * LATENCY
    # One and a half relayed round trips of coordination, then a direct connection.
    assert connected == pytest.approx(1.5 * relayed_round_trip + 2 * round_trip)
    assert elapsed == pytest.approx(connected + 2.0 + round_trip, abs=0.01)  # direct: 2 hops
    assert links.bytes_relayed[relay] == PUNCH_MESSAGES * PUNCH_MESSAGE_BYTES  # only the punch
    assert links.total_bytes(dialer) == 2 * 10**6 + PUNCH_MESSAGES * PUNCH_MESSAGE_BYTES

"""The swarm simulator: virtual time, simulated links, a Moshpit average, and "auto" deadlines.

Virtual time first (sleeps and timeouts cost nothing, the DHT's clock follows), then the link
model against arithmetic (a message takes its bytes over the slower link plus the latency, queued
behind the sender's other messages), then whole simulated swarms.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kit.averaging.averager import AsyncAverager
from kit.averaging.deadlines import Deadlines
from kit.averaging.settings import AveragerSettings
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import KitTimeout, KitUsageError
from kit.p2p.identity import PeerID
from kit.p2p.memory import MemoryNetwork
from kit.testing.links import HEADER_BYTES, MBIT, LinkProfile, SimulatedLinks
from kit.testing.swarm import SIMULATED_DHT, SwarmSpec, simulate_grid_average
from kit.testing.virtual_time import run_virtual


def test_virtual_time_skips_idle_waits_and_the_dht_clock_follows() -> None:
    async def scenario() -> tuple[float, float, int]:
        loop = asyncio.get_running_loop()
        start, dht_start = loop.time(), get_dht_time()
        await asyncio.sleep(3600)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30)
        total = await asyncio.to_thread(sum, [1, 2, 3])  # inline: no thread races the clock
        return loop.time() - start, get_dht_time() - dht_start, total

    began = time.monotonic()
    elapsed, dht_elapsed, total = run_virtual(scenario())
    assert elapsed == pytest.approx(3630) and dht_elapsed == pytest.approx(3630) and total == 6
    assert time.monotonic() - began < 5  # an hour and a half-minute, simulated


def test_a_wait_without_timeout_on_virtual_time_is_reported() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()  # nothing scheduled, nothing ready: a deadlock

    with pytest.raises(KitUsageError, match="help:"):
        run_virtual(stuck(), idle_wall_timeout=0.1)


def peer_id(i: int) -> PeerID:
    return PeerID(bytes([i + 1]) * 32)


def test_links_share_the_uplink_between_flows_and_add_the_latency() -> None:
    links = SimulatedLinks(LinkProfile(upload=8 * MBIT, download=100 * MBIT, latency=0.01))
    a, b, c = (peer_id(i) for i in range(3))
    size = 10**6 - HEADER_BYTES  # 1 MB on the wire: 1 s at 8 Mbit/s
    sent, arrived = links.transmit(a, b, size, now=0.0)
    assert sent == pytest.approx(1.0) and arrived == pytest.approx(1.02)  # + 2 x 10 ms
    # A second flow from a shares its uplink: half the rate while the first is still going.
    sent, arrived = links.transmit(a, c, size, now=0.5)
    assert sent == pytest.approx(2.5) and arrived == pytest.approx(2.52)
    # A small message on a third flow is not stuck behind them (TCP flows share the link).
    sent, _ = links.transmit(a, peer_id(9), 1000 - HEADER_BYTES, now=0.6)
    assert sent == pytest.approx(0.6 + 3 * 1000 / 10**6)
    # The same flow stays in order: behind its own first message (shared with the a-c flow).
    sent, _ = links.transmit(a, b, size, now=0.7)
    assert sent == pytest.approx(1.0 + 2.0)
    links.set_profile(c, LinkProfile(upload=100 * MBIT, download=1 * MBIT, latency=0.0))
    _, arrived = links.transmit(b, c, size, now=10.0)  # c's downlink is the slower end
    assert arrived == pytest.approx(18.01)
    assert links.messages_sent[a] == 4 and links.bytes_sent[a] == 3 * 10**6 + 1000
    assert links.round_trip(a, b) == pytest.approx(0.04)


def test_messages_over_simulated_links_take_the_links_time() -> None:
    async def scenario() -> tuple[float, float, list[bytes]]:
        links = SimulatedLinks(LinkProfile(upload=8 * MBIT, download=8 * MBIT, latency=0.025))
        network = MemoryNetwork(links=links, stream_window=4)
        server, client = await network.create_peer(), await network.create_peer()
        received: list[bytes] = []

        async def serve(stream: object) -> None:
            while (message := await stream.receive_message(timeout=60)) is not None:  # type: ignore[attr-defined]
                received.append(message)

        server.add_stream_handler("p", serve)
        client.add_address(server.peer_id, server.get_visible_addresses()[0])
        loop = asyncio.get_running_loop()
        began = loop.time()
        stream = await client.open_stream(server.peer_id, "p", timeout=10)
        connected = loop.time() - began  # two round trips of 0.1 s
        for i in range(4):
            await stream.send_message(bytes([i]) * (250_000 - HEADER_BYTES), timeout=60)
        await stream.close()
        while len(received) < 4:
            await asyncio.sleep(0.01)
        return connected, loop.time() - began, received

    connected, elapsed, received = run_virtual(scenario())
    assert connected == pytest.approx(0.2)
    assert elapsed == pytest.approx(0.2 + 1.0 + 0.05, abs=0.02)  # 1 MB at 8 Mbit/s + latency
    assert [m[0] for m in received] == [0, 1, 2, 3]  # in order, and the end came after them


def test_a_simulated_swarm_reaches_the_global_mean_on_a_full_grid() -> None:
    """16 peers in groups of 4 over 100 Mbit/s, 50 ms links: two rounds, the exact mean
    (benchmarks/swarm.py runs the same up to thousands of peers)."""
    report = run_virtual(simulate_grid_average(SwarmSpec(peers=16, group_size=4, size=4096)))
    assert report.rounds == 2 and report.failed == (0, 0)
    assert report.group_sizes == ((4,) * 4, (4,) * 4)
    assert report.max_abs_error[0] > 0.1 and report.max_abs_error[1] <= 1e-6
    assert report.rounds_to_global_mean(1e-5) == 2
    # Simulated seconds: what 100 Mbit/s links and 50 ms round trips give (DHT lookups, the
    # matchmaking's polls and joins, the all-reduce), not what this CPU took.
    assert all(0.2 < seconds < 10 for seconds in report.round_seconds)
    assert report.messages_per_peer > 0 and report.dht_finds_per_peer > 0


def test_sharded_first_round_keeps_every_group_full() -> None:
    """Round 1 over shard keys (as for thousands of peers, here from 16 peers per key up):
    each shard's remainder meets the others' in the pool, so 64 peers still form 8 full
    groups of 8, and round 2 (8 keys of 8: not sharded) gives the exact global mean."""
    spec = SwarmSpec(peers=64, group_size=8, size=1024, shard_above=16, seed=1)
    report = run_virtual(simulate_grid_average(spec))
    assert report.failed == (0, 0) and report.group_sizes == ((8,) * 8, (8,) * 8)
    assert report.rounds_to_global_mean(1e-6) == 2


def test_an_incomplete_grid_has_no_useless_last_round() -> None:
    """105 peers in groups of 10: 10^2 < 105, but a third round would find one peer per key
    (nobody to average with). Two rounds: 10 groups of 10 and a remainder of 5, then groups of
    10 or 11 (those without a member of the remainder miss its 5 peers: the measured error)."""
    spec = SwarmSpec(peers=105, group_size=10, size=1024, seed=2)
    report = run_virtual(simulate_grid_average(spec))
    assert report.rounds == 2 and report.failed == (0, 0)
    assert report.group_sizes[0] == (10,) * 10 + (5,)
    assert sorted(set(report.group_sizes[1])) == [10, 11] and sum(report.group_sizes[1]) == 105
    assert report.max_abs_error[1] < 0.5 * report.max_abs_error[0]


def test_an_incomplete_grid_with_churn_keeps_a_measured_error() -> None:
    """32 peers (not a power of 4) and 10% crashing mid-way: nobody hangs, the error is what
    the README reports for incomplete grids (a mean over part of the swarm), and bounded."""
    spec = SwarmSpec(peers=32, group_size=4, size=1024, churn=0.1, round_timeout=20.0, seed=3)
    report = run_virtual(simulate_grid_average(spec))
    assert report.crashed == 3 and report.rounds == 3
    assert report.max_abs_error[-1] < report.max_abs_error[0]  # the grid still mixed
    assert all(size <= 4 for sizes in report.group_sizes for size in sizes)
    assert sum(report.failed) < 32  # most survivors found a group in every round


def test_auto_deadlines_succeed_where_the_fixed_constants_fail() -> None:
    """8 peers averaging 4 MB over 4 Mbit/s links: a round moves 3.5 MB out of and into each
    peer, about 7 s. Constants that look generous on a LAN (matchmaking 5 s, round timeout 5 s)
    abort every round; "auto" derives both from the vector and the swarm: every round exact."""
    size, peers = 2**20, 8  # floats: 4 MB

    async def rounds(settings: AveragerSettings) -> list[bool]:
        rate = 4 * MBIT
        network = MemoryNetwork(links=SimulatedLinks(LinkProfile(rate, rate, 0.0125)))
        averagers: list[AsyncAverager] = []
        for i in range(peers):
            initial = averagers[0].peer.get_visible_addresses() if averagers else []
            peer = await network.create_peer(initial)
            node = await DHTNode.create(peer, initial, config=SIMULATED_DHT)
            tensor = torch.full((size,), float(i))
            averagers.append(await AsyncAverager.create([tensor], node, settings))
        try:
            results = await asyncio.gather(*(a.step(timeout=60.0) for a in averagers))
            return [
                r is not None and r.is_full and bool(torch.all(a.tensors[0] == 3.5))
                for a, r in zip(averagers, results, strict=True)
            ]
        finally:
            for averager in averagers:
                await averager.shutdown()
                await averager.node.shutdown()
                await averager.peer.shutdown()  # type: ignore[attr-defined]

    base = dict(prefix="auto", target_group_size=peers, part_size_bytes=2**18)
    fixed = AveragerSettings(**base, min_matchmaking_time=5.0, allreduce_timeout=5.0)
    deadlines = Deadlines.create("auto", "auto", 4 * size)
    auto = AveragerSettings(
        **base,
        min_matchmaking_time=deadlines.matchmaking_time(peers),
        allreduce_timeout=deadlines.averaging_timeout(peers),
    )
    assert not any(run_virtual(rounds(fixed)))
    assert all(run_virtual(rounds(auto)))


def test_memory_calls_time_out_on_slow_simulated_links() -> None:
    async def scenario() -> None:
        links = SimulatedLinks(LinkProfile(upload=1 * MBIT, download=1 * MBIT, latency=0.5))
        network = MemoryNetwork(links=links)
        server, client = await network.create_peer(), await network.create_peer()

        async def echo(caller: object, request: bytes) -> bytes:
            return request

        server.add_unary_handler("echo", echo)
        client.add_address(server.peer_id, server.get_visible_addresses()[0])
        await client.connect(server.get_visible_addresses()[0], timeout=10)
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert (
            await client.call(server.peer_id, "echo", b"x" * 125_000, timeout=10) == b"x" * 125_000
        )
        assert loop.time() - began == pytest.approx(2 * (1.0 + 1.0), rel=0.01)  # 1 s + 1 s each way
        with pytest.raises(KitTimeout):
            await client.call(server.peer_id, "echo", b"x" * 125_000, timeout=1.5)

    run_virtual(scenario())

"""A swarm simulator: hundreds to thousands of averaging peers in one process, on virtual time.

Holds :class:`SwarmSpec` (how many peers, their links, churn, the averaging settings),
:class:`SimulatedSwarm` (``MemoryNetwork`` peers with simulated links, each with its own DHT node
and averager) and :func:`simulate_grid_average` (one Moshpit average over the whole swarm,
measured). Run it under :func:`kit.testing.virtual_time.run_virtual`: then every time a peer
reads is what its links would give (``kit.testing.links``), not what one CPU can compute, and
an hour of simulated matchmaking costs only the CPU of the messages. It also runs on a real
loop (slower, and limited by the CPU).

Example::

    spec = SwarmSpec(peers=256, group_size=16, size=10_000)
    report = run_virtual(simulate_grid_average(spec))
    print(report.max_abs_error, report.round_seconds)

What is real: every peer runs kit's DHT node, matchmaking and all-reduce, exchanging the same
bytes as over websockets. What is not: the handshake's CPU, TCP dynamics beyond the link model,
NAT (every peer is public), and compute (free: the loop runs executor work inline).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from kit.averaging.averager import AsyncAverager
from kit.averaging.grid import SHARD_ABOVE, rounds_for
from kit.averaging.moshpit import grid_average
from kit.averaging.settings import AveragerSettings
from kit.dht.node import DHTConfig, DHTNode
from kit.errors import ConfigError
from kit.p2p.memory import MemoryNetwork, MemoryPeer
from kit.testing.links import MBIT, LinkProfile, SimulatedLinks

logger = logging.getLogger(__name__)

DHT_FIND = "kit/dht/1/find"  # the protocol of one lookup step (a FIND request)
SIMULATED_DHT = DHTConfig(  # the defaults, but no maintenance while the simulation runs
    refresh_period=3600.0, republish_period=3600.0, rejoin_period=0.0
)


@dataclasses.dataclass(frozen=True)
class SwarmSpec:
    """One simulated swarm."""

    peers: int = 1024  # averaging peers
    group_size: int = 32  # G: target group size (a Moshpit grid of side G)
    size: int = 262_144  # floats averaged (1 MiB)
    bandwidth_mbit: float = 100.0  # every peer's upload and download, Mbit/s
    rtt: float = 0.05  # seconds of round trip between any two peers
    churn: float = 0.0  # fraction of peers that crash at a random time during the average
    rounds: int | None = None  # Moshpit rounds (None: ceil(log_G(peers)))
    min_matchmaking_time: float = 5.0  # seconds a leader waits for its group at most
    request_timeout: float = 3.0  # join requests and stream opens
    round_timeout: float = 60.0  # seconds each round may search for its group
    shard_above: int = SHARD_ABOVE  # a round's key expected to hold more peers is sharded
    seed: int = 0

    def __post_init__(self) -> None:
        if self.peers < 2 or self.group_size < 2 or self.size < 1:
            raise ConfigError(
                f"{self} - help: at least 2 peers, group_size >= 2 and size >= 1 float"
            )
        if not 0 <= self.churn < 1:
            raise ConfigError(f"churn={self.churn} must be in [0, 1) - help: e.g. 0.05")

    @property
    def grid_rounds(self) -> int:
        return self.rounds or rounds_for(self.peers, self.group_size)

    def averager_settings(self) -> AveragerSettings:
        return AveragerSettings(
            prefix="swarm",
            target_group_size=self.group_size,
            min_matchmaking_time=self.min_matchmaking_time,
            request_timeout=self.request_timeout,
            allreduce_timeout=max(60.0, 20 * self.size * 4 / (self.bandwidth_mbit * MBIT)),
        )


@dataclasses.dataclass(frozen=True)
class SwarmReport:
    """What one simulated grid average measured (times in simulated seconds)."""

    peers: int
    group_size: int
    rounds: int
    group_sizes: tuple[tuple[int, ...], ...]  # per round: the sizes of the groups that formed
    max_abs_error: tuple[float, ...]  # per round: the largest |value - global mean| of any peer
    failed: tuple[int, ...]  # per round: peers without a group
    round_seconds: tuple[float, ...]  # per round: until the last peer finished it
    messages_per_peer: float  # sent, all protocols, averaged over peers
    bytes_per_peer: float  # sent, all protocols
    dht_finds_per_peer: float  # FIND requests (lookup steps) served, averaged over peers
    crashed: int  # peers that crashed (churn)

    def rounds_to_global_mean(self, tolerance: float) -> int | None:
        """The first round after which every surviving peer holds the global mean."""
        for index, error in enumerate(self.max_abs_error):
            if error <= tolerance:
                return index + 1
        return None


class SimulatedSwarm:
    """Averaging peers on one ``MemoryNetwork`` with simulated links (see the module)."""

    def __init__(self, spec: SwarmSpec) -> None:
        self.spec = spec
        rate = spec.bandwidth_mbit * MBIT
        self.links = SimulatedLinks(LinkProfile(rate, rate, spec.rtt / 4))
        self.network = MemoryNetwork(links=self.links)
        self.rng = random.Random(spec.seed)
        self.averagers: list[AsyncAverager] = []
        self.values: list[torch.Tensor] = []  # each peer's initial vector
        self.weights: list[float] = []  # each peer's weight (its samples)

    async def start(self) -> SimulatedSwarm:
        """Create the peers, each joining the DHT through a few of the earlier ones."""
        spec, settings = self.spec, self.spec.averager_settings()
        generator = torch.Generator().manual_seed(spec.seed)
        for _i in range(spec.peers):
            known = [a.peer for a in self.averagers]
            entry = self.rng.sample(known, min(3, len(known)))
            initial = [p.get_visible_addresses()[0] for p in entry]
            peer = await self.network.create_peer(initial)
            node = await DHTNode.create(peer, initial, config=SIMULATED_DHT)
            value = torch.randn(spec.size, generator=generator)
            averager = await AsyncAverager.create([value.clone()], node, settings)
            self.averagers.append(averager)
            self.values.append(value)
            self.weights.append(float(self.rng.randint(1, 64)))
        return self

    def global_mean(self, members: Sequence[int]) -> torch.Tensor:
        total = sum(self.weights[i] for i in members)
        mean = torch.zeros(self.spec.size, dtype=torch.float64)
        for i in members:
            mean += self.weights[i] * self.values[i].double()
        return mean / total

    async def close(self) -> None:
        for averager in self.averagers:
            await averager.shutdown()
            await averager.node.shutdown()
            peer = averager.peer
            if isinstance(peer, MemoryPeer):
                await peer.shutdown()


async def simulate_grid_average(spec: SwarmSpec) -> SwarmReport:
    """Start a swarm, let every peer run one grid average at once, and measure it."""
    swarm = await SimulatedSwarm(spec).start()
    loop = asyncio.get_running_loop()
    try:
        swarm.links.reset_counters()
        finds_before = sum(a.peer.stats[DHT_FIND] for a in swarm.averagers)  # type: ignore[attr-defined]
        rounds, n = spec.grid_rounds, spec.peers
        snapshots: list[list[torch.Tensor | None]] = [[None] * n for _ in range(rounds)]
        finished: list[list[float]] = [[] for _ in range(rounds)]
        groups: list[dict[bytes, int]] = [{} for _ in range(rounds)]
        joined: list[set[int]] = [set() for _ in range(rounds)]
        started = loop.time()

        async def run(i: int) -> None:
            averager = swarm.averagers[i]

            def on_round(index: int, result: Any) -> None:
                snapshots[index][i] = averager.tensors[0].clone()
                finished[index].append(loop.time() - started)
                if result is not None:
                    groups[index][result.group_id] = len(result)
                    joined[index].add(i)

            await grid_average(
                averager,
                swarm.weights[i],
                peers=n,
                group_size=spec.group_size,
                rounds=rounds,
                timeout=spec.round_timeout,
                shard_above=spec.shard_above,
                on_round=on_round,
            )

        crashed = set(swarm.rng.sample(range(n), int(spec.churn * n)))
        tasks = [asyncio.ensure_future(run(i)) for i in range(n)]
        crashes = [
            asyncio.ensure_future(_crash(swarm, i, swarm.rng.uniform(0, spec.min_matchmaking_time)))
            for i in crashed
        ]
        await asyncio.gather(*tasks, *crashes, return_exceptions=True)
        # The global mean is over every peer: a crashed peer's values may be in the others'
        # averages already (it crashed mid-way), or missing; with churn the error says how far.
        mean = swarm.global_mean(range(n))
        survivors = [i for i in range(n) if i not in crashed]
        errors, failed, seconds, previous_end = [], [], [], 0.0
        for index in range(rounds):
            values = [v for v in (snapshots[index][i] for i in survivors) if v is not None]
            errors.append(max((float((v.double() - mean).abs().max()) for v in values), default=0))
            failed.append(sum(i not in joined[index] for i in survivors))
            end = max(finished[index], default=previous_end)
            seconds.append(end - previous_end)
            previous_end = end
        finds = sum(a.peer.stats[DHT_FIND] for a in swarm.averagers) - finds_before  # type: ignore[attr-defined]
        return SwarmReport(
            peers=n,
            group_size=spec.group_size,
            rounds=rounds,
            group_sizes=tuple(tuple(sorted(g.values(), reverse=True)) for g in groups),
            max_abs_error=tuple(errors),
            failed=tuple(failed),
            round_seconds=tuple(seconds),
            messages_per_peer=sum(swarm.links.messages_sent.values()) / n,
            bytes_per_peer=sum(swarm.links.bytes_sent.values()) / n,
            dht_finds_per_peer=finds / n,
            crashed=len(crashed),
        )
    finally:
        await swarm.close()


async def _crash(swarm: SimulatedSwarm, index: int, delay: float) -> None:
    """A peer dies after ``delay``: its connections break, it answers nothing (no goodbye)."""
    await asyncio.sleep(delay)
    peer = swarm.averagers[index].peer
    if isinstance(peer, MemoryPeer):
        await peer.shutdown()
    logger.debug("peer %d crashed", index)

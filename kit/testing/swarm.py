"""A swarm simulator: hundreds to thousands of averaging peers in one process, on virtual time.

Holds :class:`SwarmSpec` (how many peers, their links, churn, the averaging settings),
:class:`SimulatedSwarm` (``MemoryNetwork`` peers with simulated links, each with its own DHT node
and averager) and :func:`simulate_grid_average` (one Moshpit average over the whole swarm,
measured). Run it under :func:`kit.testing.virtual_time.run_virtual`: then every time a peer
reads is what its links would give (``kit.testing.links``), not what one CPU can compute, and
an hour of simulated matchmaking costs only the CPU of the messages. It also runs on a real
loop (slower, and limited by the CPU).

Example::

    spec = SwarmSpec(peers=256, group_size=16, size=10_000, nat_fraction=0.9)
    report = run_virtual(simulate_grid_average(spec))
    print(report.max_abs_error, report.round_seconds, report.busiest_vs_median)

NAT: ``nat_fraction`` of the peers have no listening socket (``kit.p2p.memory_nat.NAT``); of
those, ``punchable`` can be reached directly after a hole punch (``can_accept``: they lead and
aggregate like public peers), the others only through their relay (they aggregate nothing).
The first peer and every peer's entry points are public (a DHT's bootstrap peers); a NAT'd
peer's relay is the public peer it dialed first. The report says how many bytes each peer's
links carried per round (sent and received, all protocols, a relay's forwarding included) and
the busiest peer against the median one.

What is real: every peer runs kit's DHT node, matchmaking and all-reduce, exchanging the same
bytes as over websockets. What is not: the handshake's CPU, TCP dynamics beyond the link model,
failed punches and NAT mapping timeouts (``kit.p2p.memory``), and compute (free: the loop runs
executor work inline).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import statistics
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
from kit.p2p.memory_nat import NAT
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
    nat_fraction: float = 0.0  # share of peers with no listening socket (behind a NAT)
    # Share of those behind a NAT that can be punched through (endpoint-independent mapping):
    # libp2p's DCUtR measurement campaign saw ~70% of hole punches succeed across real NATs
    # (home routers, cloud and university networks); the rest (symmetric NATs, carrier-grade
    # NATs) stay relayed. Pessimistic runs use 0.3; 0 is "no hole punching".
    punchable: float = 0.7
    # False: peers behind a NAT aggregate nothing even if punchable (an explicit
    # client_mode=True, as before kit.p2p hole punching): only public peers aggregate.
    natted_aggregate: bool = True

    def __post_init__(self) -> None:
        if self.peers < 2 or self.group_size < 2 or self.size < 1:
            raise ConfigError(
                f"{self} - help: at least 2 peers, group_size >= 2 and size >= 1 float"
            )
        if not 0 <= self.churn < 1:
            raise ConfigError(f"churn={self.churn} must be in [0, 1) - help: e.g. 0.05")
        if not (0 <= self.nat_fraction < 1 and 0 <= self.punchable <= 1):
            raise ConfigError(
                f"nat_fraction={self.nat_fraction}, punchable={self.punchable} - help: "
                "nat_fraction in [0, 1) (someone must be public: the relays), punchable in [0, 1]"
            )

    def nat_kinds(self, rng: random.Random) -> list[NAT]:
        """Each peer's NAT: ``nat_fraction`` of them (never the first) behind one, and
        ``punchable`` of those punchable (counts rounded; who, drawn by ``rng``)."""
        natted = min(round(self.nat_fraction * self.peers), self.peers - 1)
        punchable = round(self.punchable * natted)
        chosen = rng.sample(range(1, self.peers), natted)
        kinds = [NAT.PUBLIC] * self.peers
        for rank, i in enumerate(chosen):
            kinds[i] = NAT.PUNCHABLE if rank < punchable else NAT.SYMMETRIC
        return kinds

    @property
    def grid_rounds(self) -> int:
        return self.rounds or rounds_for(self.peers, self.group_size)

    def averager_settings(self, nat: NAT = NAT.PUBLIC) -> AveragerSettings:
        """One peer's averager settings (``nat``: its NAT)."""
        return AveragerSettings(
            prefix="swarm",
            client_mode=None if self.natted_aggregate or nat is NAT.PUBLIC else True,
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
    # Per surviving peer: bytes its links carried (sent + received, all protocols, relayed
    # ones included) over the whole average, divided by the rounds.
    busiest_bytes_per_round: float = 0.0
    median_bytes_per_round: float = 0.0
    busiest_kind: str = ""  # the busiest peer's NAT ("public", "punchable", "symmetric")
    busiest_relayed_bytes_per_round: float = 0.0  # of its bytes, those it relayed for others
    nat_counts: tuple[tuple[str, int], ...] = ()  # peers of each NAT kind
    aggregators_per_group: float = 0.0  # members with a part to aggregate, mean over groups

    @property
    def busiest_vs_median(self) -> float:
        """Bytes per round of the busiest peer over the median peer's."""
        if self.median_bytes_per_round <= 0:
            return 0.0
        return self.busiest_bytes_per_round / self.median_bytes_per_round

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
        self.nat = spec.nat_kinds(random.Random(spec.seed + 1))  # each peer's NAT

    async def start(self) -> SimulatedSwarm:
        """Create the peers, each joining the DHT through a few of the earlier public ones."""
        spec = self.spec
        generator = torch.Generator().manual_seed(spec.seed)
        public: list[MemoryPeer] = []  # DHT servers and relays: the entry points
        for i in range(spec.peers):
            entry = self.rng.sample(public, min(3, len(public)))
            initial = [p.get_visible_addresses()[0] for p in entry]
            peer = await self.network.create_peer(initial, nat=self.nat[i])
            if self.nat[i] is NAT.PUBLIC:
                public.append(peer)
            node = await DHTNode.create(peer, initial, config=SIMULATED_DHT)
            value = torch.randn(spec.size, generator=generator)
            settings = spec.averager_settings(self.nat[i])
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
        aggregating: dict[bytes, int] = {}  # per group: members with a part to aggregate
        started = loop.time()

        async def run(i: int) -> None:
            averager = swarm.averagers[i]

            def on_round(index: int, result: Any) -> None:
                snapshots[index][i] = averager.tensors[0].clone()
                finished[index].append(loop.time() - started)
                if result is not None:
                    groups[index][result.group_id] = len(result)
                    joined[index].add(i)
                    aggregating[result.group_id] = sum(s > 0 for s in result.plan.part_sizes)

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
        load = _load(swarm, survivors, rounds)
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
            busiest_bytes_per_round=load.busiest,
            median_bytes_per_round=load.median,
            busiest_kind=load.kind,
            busiest_relayed_bytes_per_round=load.relayed,
            nat_counts=tuple((k.value, swarm.nat.count(k)) for k in NAT),
            aggregators_per_group=statistics.fmean(aggregating.values()) if aggregating else 0.0,
        )
    finally:
        await swarm.close()


@dataclasses.dataclass(frozen=True)
class _Load:
    busiest: float
    median: float
    kind: str
    relayed: float


def _load(swarm: SimulatedSwarm, survivors: Sequence[int], rounds: int) -> _Load:
    """Bytes per round of the surviving peers' links: the busiest one's and the median."""
    links = swarm.links
    ids = [swarm.averagers[i].peer.peer_id for i in survivors]
    if not ids:
        return _Load(0.0, 0.0, "", 0.0)
    per_round = [links.total_bytes(peer_id) / rounds for peer_id in ids]
    busiest = max(range(len(ids)), key=per_round.__getitem__)
    return _Load(
        per_round[busiest],
        statistics.median(per_round),
        swarm.nat[survivors[busiest]].value,
        links.bytes_relayed[ids[busiest]] / rounds,
    )


async def _crash(swarm: SimulatedSwarm, index: int, delay: float) -> None:
    """A peer dies after ``delay``: its connections break, it answers nothing (no goodbye)."""
    await asyncio.sleep(delay)
    peer = swarm.averagers[index].peer
    if isinstance(peer, MemoryPeer):
        await peer.shutdown()
    logger.debug("peer %d crashed", index)

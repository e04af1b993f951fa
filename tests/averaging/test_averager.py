"""The averager end to end: DHT, matchmaking and all-reduce, on MemoryNetwork and real sockets.

Exact weighted means with client-mode and auxiliary peers; late peers and failed leaders; the
blocking facade; a client-mode peer behind a relay on real sockets; and a peer process killed
in the middle of a round, 20 times.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kit.averaging.averager import AsyncAverager, DecentralizedAverager, RoundResult
from kit.averaging.settings import AveragerSettings
from kit.dht import DHT
from kit.dht.node import DHTConfig, DHTNode
from kit.errors import ConfigError
from kit.p2p.memory import MemoryNetwork
from kit.p2p.memory_nat import NAT
from kit.p2p.peer import create_peer
from kit.runtime import Runtime
from tests.conftest import MS
from tests.dht.swarm import FAST

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def settings(**changes: Any) -> AveragerSettings:
    base = {
        "prefix": "test",
        "min_matchmaking_time": 1.0,
        "request_timeout": 500 * MS,
        "next_chunk_timeout": 1000 * MS,
        "part_size_bytes": 1024,
        "allreduce_timeout": 10.0,
    }
    return AveragerSettings(**{**base, **changes})


def tensors_of(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3001, generator=generator), torch.randn(17, 5, generator=generator)]


async def start(
    peer_factory: Any,
    n: int,
    *,
    clients: Sequence[int] = (),
    aux: Sequence[int] = (),
    config: DHTConfig = FAST,
    values: Any = None,
    **changes: Any,
) -> list[AsyncAverager]:
    """``n`` averagers, each with its own peer and DHT node (node 0 is everyone's entry point)."""
    averagers: list[AsyncAverager] = []
    for i in range(n):
        initial = averagers[0].peer.get_visible_addresses() if averagers else []
        peer = await peer_factory(initial, client_mode=i in clients)
        node = await DHTNode.create(peer, initial, config=config)
        s = settings(auxiliary=i in aux, **changes)
        tensors = tensors_of(i) if values is None else values(i)
        averagers.append(await AsyncAverager.create(tensors, node, s))
    return averagers


async def stop(averagers: Sequence[AsyncAverager]) -> None:
    for averager in reversed(averagers):
        await averager.shutdown()
        await averager.node.shutdown()
        await averager.peer.shutdown()  # type: ignore[attr-defined]


def mean_of(members: Sequence[int], weights: Sequence[float]) -> list[torch.Tensor]:
    total = sum(weights[i] for i in members)
    return [sum(weights[i] * tensors_of(i)[t].double() for i in members) / total for t in range(2)]


def assert_mean(tensors: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    for got, want in zip(tensors, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("n", "clients", "aux"),
    [(2, (), ()), (3, (2,), ()), (5, (1, 4), (3,)), (8, (2, 6), (5,))],
)
async def test_step_gives_the_exact_weighted_mean(
    n: int, clients: tuple[int, ...], aux: tuple[int, ...]
) -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, n, clients=clients, aux=aux, target_group_size=n)
    try:
        weights = [1.0 + 3.0 * i for i in range(n)]
        results = await asyncio.gather(
            *(a.step(weight=weights[i]) for i, a in enumerate(averagers))
        )
        senders = [i for i in range(n) if i not in aux]
        expected = mean_of(senders, weights)
        index = {a.peer.peer_id: i for i, a in enumerate(averagers)}
        for i, result in enumerate(results):
            assert isinstance(result, RoundResult) and result.is_full and len(result) == n
            assert set(result.peers) == {a.peer.peer_id for a in averagers}
            assert result.weights == tuple(  # as the group agreed (kit.metrics attests them)
                0.0 if index[p] in aux else weights[index[p]] for p in result.peers
            )
            if i not in aux:
                assert_mean(averagers[i].tensors, expected)
            else:
                assert all(
                    torch.equal(x, y)
                    for x, y in zip(averagers[i].tensors, tensors_of(i), strict=True)
                )
        assert len({r.group_id for r in results}) == 1
        stats = averagers[0].statistics()
        assert stats["full_rounds"] == 1 and stats["last_round"]["group_size"] == n
    finally:
        await stop(averagers)


async def test_peers_behind_punchable_nats_lead_and_aggregate_symmetric_ones_never() -> None:
    """The averaging role follows ``can_accept``, not ``client_mode``: a client-mode peer that
    others reach after a hole punch leads and aggregates like a public one (it declares its
    relayed address); one behind a symmetric NAT (relayed only) aggregates nothing; an explicit
    client_mode=True (hivemind's meaning) still aggregates nothing."""
    network = MemoryNetwork()
    kinds = [NAT.PUBLIC, NAT.PUNCHABLE, NAT.PUNCHABLE, NAT.SYMMETRIC, NAT.SYMMETRIC, NAT.PUNCHABLE]
    created = iter(kinds)

    async def factory(initial: Sequence[str], client_mode: bool) -> Any:
        return await network.create_peer(initial, nat=next(created))

    averagers = await start(factory, 5, target_group_size=6)
    initial = averagers[0].peer.get_visible_addresses()
    node = await DHTNode.create(await factory(initial, True), initial, config=FAST)
    told = settings(client_mode=True, target_group_size=6)  # punchable, but asked not to
    averagers.append(await AsyncAverager.create(tensors_of(5), node, told))
    try:
        assert [a.client_mode for a in averagers] == [False, False, False, True, True, True]
        assert [a.peer.client_mode for a in averagers] == [False] + [True] * 5
        assert (
            averagers[1]
            .peer.get_visible_addresses()[0]
            .startswith(averagers[0].peer.get_visible_addresses()[0] + "/p2p-circuit/")
        )
        results = await asyncio.gather(*(a.step(weight=1.0 + i) for i, a in enumerate(averagers)))
        index = {a.peer.peer_id: i for i, a in enumerate(averagers)}
        expected = mean_of(range(6), [1.0 + i for i in range(6)])
        for averager, result in zip(averagers, results, strict=True):
            assert isinstance(result, RoundResult) and result.is_full and len(result) == 6
            assert index[result.peers[0]] in (0, 1, 2)  # the leader can accept connections
            aggregating = {
                index[p] for p, n in zip(result.peers, result.plan.part_sizes, strict=True) if n
            }
            assert aggregating == {0, 1, 2}
            assert_mean(averager.tensors, expected)
        with pytest.raises(ConfigError, match="help:"):  # relayed only: cannot aggregate
            await AsyncAverager.create(
                tensors_of(9), averagers[3].node, settings(prefix="other", client_mode=False)
            )
    finally:
        await stop(averagers)


async def test_consecutive_rounds_never_mix_data() -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, 3, target_group_size=3)
    try:
        group_ids = set()
        for round_number in range(4):
            for i, averager in enumerate(averagers):  # new values every round
                for tensor, value in zip(
                    averager.tensors, tensors_of(10 * round_number + i), strict=True
                ):
                    tensor.copy_(value)
            results = await asyncio.gather(*(a.step() for a in averagers))
            assert all(r is not None and r.is_full for r in results)
            group_ids.add(results[0].group_id)
            total = [
                sum(tensors_of(10 * round_number + i)[t] for i in range(3)) / 3 for t in (0, 1)
            ]
            for averager in averagers:
                for got, want in zip(averager.tensors, total, strict=True):
                    torch.testing.assert_close(got, want)
        assert len(group_ids) == 4  # every round has its own number
    finally:
        await stop(averagers)


async def test_a_late_peer_averages_in_the_next_round() -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, 3, min_matchmaking_time=0.3)
    try:
        early = [asyncio.ensure_future(a.step(timeout=1.0)) for a in averagers[:2]]
        await asyncio.sleep(0.6)  # the first two have begun: the third is too late for them
        late = await averagers[2].step(timeout=0.5)
        first = await asyncio.gather(*early)
        assert late is None
        assert all(r is not None and len(r) == 2 and r.is_full for r in first)
        assert_mean(averagers[0].tensors, mean_of([0, 1], [1.0, 1.0, 1.0]))
        again = await asyncio.gather(*(a.step(timeout=2.0) for a in averagers))
        assert all(r is not None and len(r) == 3 for r in again)
        assert averagers[2].statistics()["no_group"] == 1
    finally:
        await stop(averagers)


async def test_followers_regroup_when_their_leader_fails() -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, 3, min_matchmaking_time=1.0)
    try:
        leader = averagers[0]
        steps = [asyncio.ensure_future(leader.step(timeout=3.0))]
        await asyncio.sleep(0.1)  # the first to declare leads (its expiration is the earliest)
        steps += [asyncio.ensure_future(a.step(timeout=3.0)) for a in averagers[1:]]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(leader.matchmaking.followers) == 2:
                break
        assert len(leader.matchmaking.followers) == 2, "both followers should have joined"
        await leader.peer.shutdown()  # type: ignore[attr-defined]
        steps[0].cancel()
        results = await asyncio.gather(*steps[1:])
        assert all(r is not None and r.is_full and len(r) == 2 for r in results)
        assert leader.peer.peer_id not in results[0].peers
        assert_mean(averagers[1].tensors, mean_of([1, 2], [1.0, 1.0, 1.0]))
    finally:
        for averager in averagers:
            await averager.shutdown()
            await averager.node.shutdown()
            await averager.peer.shutdown()  # type: ignore[attr-defined]


async def test_only_averagers_with_the_same_group_bits_average_together() -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, 4, min_matchmaking_time=0.3)
    try:
        for averager, bits in zip(averagers, ["01", "01", "10", "10"], strict=True):
            averager.matchmaking.group_bits = bits  # what DecentralizedAverager.set_group_bits sets
        results = await asyncio.gather(*(a.step(timeout=1.0) for a in averagers))
        assert all(r is not None and len(r) == 2 for r in results)
        assert set(results[0].peers) == {averagers[0].peer.peer_id, averagers[1].peer.peer_id}
        assert set(results[2].peers) == {averagers[2].peer.peer_id, averagers[3].peer.peer_id}
        # Moshpit, as hivemind: each member's place in its group is the key's newest bit now.
        assert {averagers[2].matchmaking.group_bits, averagers[3].matchmaking.group_bits} == {
            "00",
            "01",
        }
    finally:
        await stop(averagers)


async def test_no_group_below_min_group_size_and_the_step_ends_in_time() -> None:
    network = MemoryNetwork()
    averagers = await start(network.create_peer, 2, min_group_size=3, min_matchmaking_time=0.2)
    try:
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(a.step(timeout=0.5) for a in averagers))
        assert results == [None, None]
        assert asyncio.get_running_loop().time() - started < 1.0
        assert all(
            torch.equal(x, y) for x, y in zip(averagers[0].tensors, tensors_of(0), strict=True)
        )
    finally:
        await stop(averagers)


def test_the_blocking_facade_on_its_own_runtime() -> None:
    network, runtime = MemoryNetwork(), Runtime("averager-test")
    first = DHT(peer_factory=network.create_peer, config=FAST, runtime=runtime)
    second = DHT(
        first.get_visible_addresses(),
        peer_factory=network.create_peer,
        config=FAST,
        runtime=runtime,
    )
    options = dataclasses.asdict(settings(target_group_size=2))
    options.pop("compression")
    averagers = [
        DecentralizedAverager(tensors_of(i), dht, **options)
        for i, dht in enumerate((first, second))
    ]
    try:
        futures = [a.step(weight=1.0 + i, wait=False) for i, a in enumerate(averagers)]
        results = [f.result(10) for f in futures]  # type: ignore[union-attr]
        assert all(r is not None and r.is_full for r in results)
        with averagers[1].get_tensors() as tensors:
            assert_mean(tensors, mean_of([0, 1], [1.0, 2.0]))
        averagers[0].set_group_bits("1")
        assert averagers[0].get_group_bits() == "1"
        with pytest.raises(ConfigError):
            averagers[0].set_group_bits("2")
        # While user code holds the tensors, a round cannot touch them.
        entered = threading.Event()
        with averagers[0].get_tensors():
            entered.set()
        assert entered.is_set() and averagers[0].statistics()["full_rounds"] == 1
        assert averagers[0].bandwidth is None  # rounds this small measure nothing
    finally:
        for averager in averagers:
            averager.shutdown()
            averager.shutdown()  # twice is fine
        second.shutdown()
        first.shutdown()
        runtime.shutdown()


@pytest.mark.sockets
async def test_real_sockets_with_a_client_mode_peer_behind_a_relay() -> None:
    averagers = await start(real_peer, 3, clients=(2,), target_group_size=3)
    try:
        client = averagers[2].peer
        assert client.client_mode and client.get_visible_addresses()
        assert all("/p2p-circuit/" in a for a in client.get_visible_addresses())
        weights = [1.0, 2.0, 5.0]
        results = await asyncio.gather(
            *(a.step(weight=weights[i]) for i, a in enumerate(averagers))
        )
        assert all(r is not None and r.is_full for r in results)
        for averager in averagers:
            assert_mean(averager.tensors, mean_of([0, 1, 2], weights))
    finally:
        await stop(averagers)


# --- a peer process killed in the middle of a round ------------------------------------------

NUMEL = 20_000


@contextlib.contextmanager
def victims() -> Any:
    """The process that forks victims (it imports torch once)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.averaging.averager_process"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def original(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def check_round(
    result: RoundResult,
    tensor: torch.Tensor,
    seed_of: dict[Any, int],
    weight_of: dict[Any, float],
    own_seed: int,
) -> None:
    """Every chunk holds the weighted mean of exactly the peers its report names, or its own
    values if it names nobody."""
    for part, specs in zip(result.report.parts, result.plan.parts, strict=True):
        assert len(part.chunk_peers) == len(specs) or not part.chunk_peers
        for peers, spec in zip(part.chunk_peers, specs, strict=False):
            where = slice(spec.tensor_offset, spec.tensor_offset + spec.size)
            if peers:
                total = sum(weight_of[p] for p in peers)
                want = (
                    sum(weight_of[p] * original(seed_of[p])[where].double() for p in peers) / total
                )
            else:
                want = original(own_seed)[where].double()
            torch.testing.assert_close(tensor[where].double(), want, rtol=1e-5, atol=1e-6)


async def real_peer(initial_peers: Sequence[str], *, client_mode: bool = False) -> Any:
    return await create_peer(
        initial_peers,
        host="127.0.0.1",
        run_id="test",
        client_mode=client_mode,
        relay_service=not client_mode,
    )


@pytest.mark.sockets
@pytest.mark.processes
@pytest.mark.async_timeout(150)
async def test_a_peer_process_killed_mid_round_leaves_the_others_agreeing() -> None:
    """20 times: a 4th peer, in its own process, dies after sending k tensor payloads."""
    # A leader imports scipy on its first LP (kit.averaging.balancing): here, where requests time
    # out after 0.5 s, that import must not fall inside a round.
    import scipy.optimize  # noqa: F401

    config = DHTConfig(rpc_timeout=1.0, lookup_timeout=3.0, blacklist_time=0.05)
    changes = {
        "prefix": "kill",
        "target_group_size": 4,
        "min_matchmaking_time": 2.0,
        "request_timeout": 0.5,
        "next_chunk_timeout": 1.0,
        "part_size_bytes": 4096,
        "allreduce_timeout": 5.0,
    }
    survivors = await start(real_peer, 3, config=config, values=lambda i: [original(i)], **changes)
    weights = {a.peer.peer_id: 1.0 + i for i, a in enumerate(survivors)}
    seeds = {a.peer.peer_id: i for i, a in enumerate(survivors)}
    loop = asyncio.get_running_loop()
    partial = 0
    try:
        with victims() as zygote:
            assert zygote.stdin is not None and zygote.stdout is not None
            for rep in range(20):
                for i, averager in enumerate(survivors):
                    averager.tensors[0].copy_(original(i))
                request = {
                    "initial_peers": survivors[0].peer.get_visible_addresses(),
                    "seed": 100 + rep,
                    "weight": 2.5,
                    "numel": NUMEL,
                    "kill_after": rep % 12,
                    "settings": changes,
                }
                zygote.stdin.write(json.dumps(request) + "\n")
                zygote.stdin.flush()
                line = await asyncio.wait_for(
                    loop.run_in_executor(None, zygote.stdout.readline), 20
                )
                pid, victim = line.split()
                started = loop.time()
                results = await asyncio.gather(
                    *(a.step(weight=weights[a.peer.peer_id], timeout=5.0) for a in survivors)
                )
                assert loop.time() - started < 8.0, f"round {rep} took too long"
                victim_id = next(p for p in results[0].peers if p.to_base58() == victim)
                for i, result in enumerate(results):
                    assert result is not None and victim_id in result.peers
                    check_round(
                        result,
                        survivors[i].tensors[0],
                        {**seeds, victim_id: 100 + rep},
                        {**weights, victim_id: 2.5},
                        i,
                    )
                for a, b in [(0, 1), (0, 2), (1, 2)]:  # where both averaged, they agree
                    for part_a, part_b in zip(
                        results[a].report.parts, results[b].report.parts, strict=True
                    ):
                        if any(part_a.chunk_peers) and any(part_b.chunk_peers):
                            assert part_a == part_b
                partial += not results[0].is_full
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)  # killed itself already, unless it missed
    finally:
        await stop(survivors)
    assert partial >= 15, f"only {partial} of 20 rounds lost data: the kill came too late"

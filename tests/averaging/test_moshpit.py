"""Groups at any size and Moshpit averaging, with real averagers in one process (real time).

Hundreds of peers on ``MemoryNetwork`` step at once: groups are full (but one remainder) and
each group's mean is exact; a grid of groups reaches the exact global mean in d rounds; the
group bits of ``initial_group_bits`` rotate as hivemind's do, so its grid reaches the mean too.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

import pytest
import torch

from kit.averaging.averager import RoundResult
from kit.averaging.moshpit import grid_average
from kit.p2p.memory import MemoryNetwork
from tests.averaging.test_averager import start, stop


def values_of(i: int, size: int = 1000) -> list[torch.Tensor]:
    return [torch.randn(size, generator=torch.Generator().manual_seed(1000 + i))]


def weighted_mean(members: Sequence[int], weights: Sequence[float]) -> torch.Tensor:
    total = sum(weights[i] for i in members)
    return sum(weights[i] * values_of(i)[0].double() for i in members) / total


@pytest.mark.parametrize(
    ("n", "target", "timeouts"),
    [
        (64, 16, dict(min_matchmaking_time=5.0, request_timeout=3.0)),
        (128, 128, dict(min_matchmaking_time=10.0, request_timeout=5.0)),
        (256, 32, dict(min_matchmaking_time=60.0, request_timeout=30.0)),
    ],
)
@pytest.mark.async_timeout(300)
async def test_hundreds_of_peers_stepping_at_once_form_full_groups(
    n: int, target: int, timeouts: dict[str, float]
) -> None:
    """The issue's table (groups of 2 and 254 failures at 256 peers before), now: every group
    has G members but one remainder, nobody fails, and every group's mean is exact. The
    matchmaking times are generous because these peers share one CPU (a poll of 256
    declarations by 256 peers is 16x the work of 64): on the Internet each has its own. At 256
    that CPU is saturated (the event loop lags 3-4 s behind on a slower CI machine: views settle
    late and one chunk split, 31 + 19 + 14, with 15 s / 8 s; 29 + 29 + ... with 30 s / 15 s while
    the other pytest-xdist worker ran its own tests); full groups begin at once, so the slack
    costs nothing when all goes well (60 s / 30 s: passes here with two busy loops beside it)."""
    import scipy.optimize  # noqa: F401 (the leaders' LP: imported once, not inside a round)

    network = MemoryNetwork()
    averagers = await start(
        network.create_peer,
        n,
        values=values_of,
        target_group_size=target,
        part_size_bytes=2**16,
        allreduce_timeout=120.0,
        next_chunk_timeout=30.0,
        **timeouts,
    )
    weights = [1.0 + (i % 7) for i in range(n)]
    try:
        results = await asyncio.gather(
            *(a.step(weight=weights[i], timeout=120.0) for i, a in enumerate(averagers))
        )
        assert all(r is not None for r in results), f"{sum(r is None for r in results)} failed"
        groups: dict[bytes, RoundResult] = {r.group_id: r for r in results if r is not None}
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        assert sizes == [target] * (n // target) + ([n % target] if n % target else []), sizes
        index = {a.peer.peer_id: i for i, a in enumerate(averagers)}
        for averager, result in zip(averagers, results, strict=True):
            assert result is not None and result.is_full
            members = [index[p] for p in result.peers]
            expected = weighted_mean(members, weights)
            torch.testing.assert_close(averager.tensors[0].double(), expected, rtol=0, atol=1e-5)
    finally:
        await stop(averagers)


@pytest.mark.parametrize(("n", "group_size", "rounds"), [(16, 4, 2), (8, 2, 3)])
@pytest.mark.async_timeout(120)
async def test_a_full_grid_reaches_the_exact_global_mean_in_d_rounds(
    n: int, group_size: int, rounds: int
) -> None:
    network = MemoryNetwork()
    averagers = await start(
        network.create_peer,
        n,
        values=values_of,
        # (generous: a group that fills begins at once; the other pytest worker shares the CPU,
        # and with 2 s / 1 s a group of 16-4-2 once did not form in time there)
        min_matchmaking_time=5.0,
        request_timeout=2.0,
        part_size_bytes=2**16,
    )
    weights = [float(1 + (7 * i) % 11) for i in range(n)]  # samples, unequal
    errors: dict[int, list[float]] = collections.defaultdict(list)
    global_mean = weighted_mean(range(n), weights)
    try:

        async def run(i: int) -> None:
            def on_round(index: int, result: RoundResult | None) -> None:
                error = (averagers[i].tensors[0].double() - global_mean).abs().max()
                errors[index].append(float(error))

            outcome = await grid_average(
                averagers[i],
                weights[i],
                peers=n,
                group_size=group_size,
                rounds=rounds,
                base_bits="0110",
                timeout=20.0,
                on_round=on_round,
            )
            assert outcome.grid.exact and outcome.grid.completed == rounds
            assert outcome.grid.weight == pytest.approx(sum(weights))  # it stands for everyone
            assert all(r is not None and len(r) == group_size for r in outcome.results)

        await asyncio.gather(*(run(i) for i in range(n)))
        assert max(errors[rounds - 1]) <= 1e-6  # the exact global mean after d rounds...
        assert all(max(errors[r]) > 1e-3 for r in range(rounds - 1))  # ...and not before
        assert all(a.matchmaking.group_bits == "" for a in averagers)  # restored
    finally:
        await stop(averagers)


@pytest.mark.async_timeout(120)
async def test_initial_group_bits_rotate_to_the_global_average() -> None:
    """hivemind's test_allreduce_grid, rewritten: 8 peers, groups of 2, two bits of key: the
    spread across peers shrinks every round and is 0 after the third (it stayed 0.4-0.8
    before: group bits never changed)."""
    network = MemoryNetwork()
    averagers = await start(
        network.create_peer,
        8,
        values=lambda i: [torch.randn(3, generator=torch.Generator().manual_seed(i))],
        target_group_size=2,
        min_matchmaking_time=5.0,  # (generous, as above)
        request_timeout=2.0,
    )
    for i, averager in enumerate(averagers):
        averager.matchmaking.group_bits = format(i // 2, "02b")
    try:
        stacked = torch.stack([a.tensors[0] for a in averagers])
        previous_mean, previous_std = stacked.mean(0), stacked.std(0)
        assert not torch.allclose(previous_std, torch.zeros(3))
        for round_index in range(5):
            results = await asyncio.gather(*(a.step(timeout=10.0) for a in averagers))
            assert all(r is not None and len(r) == 2 for r in results)
            stacked = torch.stack([a.tensors[0] for a in averagers])
            mean, std = stacked.mean(0), stacked.std(0)
            torch.testing.assert_close(mean, previous_mean, rtol=0, atol=1e-6)
            if round_index <= 2:
                assert torch.all(std <= previous_std + 1e-7)
            if round_index >= 2:
                torch.testing.assert_close(std, torch.zeros(3), rtol=0, atol=1e-6)
            previous_mean, previous_std = mean, std
            assert len({a.matchmaking.group_bits for a in averagers}) == 4  # 4 keys of 2
    finally:
        await stop(averagers)

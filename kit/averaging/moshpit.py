"""Moshpit averaging on the event loop: the d rounds of one grid average (``kit.averaging.grid``).

Holds :func:`grid_average`, which runs an :class:`~kit.averaging.averager.AsyncAverager` through
the rounds of a :class:`~kit.averaging.grid.GridAverage` (the group bits and target size of each
round, the weight of what the peer's value stands for). The blocking version for
``kit.Optimizer`` is ``kit.optim.rounds``; the swarm simulator (``kit.testing.swarm``) uses this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from kit.averaging.async_averager import AsyncAverager, RoundResult
from kit.averaging.grid import SHARD_ABOVE, GridAverage, begin_after_pool, later_round_delay
from kit.dht.node import get_dht_time

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GridOutcome:
    """What one peer got from a grid average."""

    grid: GridAverage  # coordinates taken, weight of the final value, rounds completed
    results: tuple[RoundResult | None, ...]  # per round (None: no group, or aborted)


async def grid_average(
    averager: AsyncAverager,
    weight: float,
    *,
    peers: int,
    group_size: int,
    rounds: int,
    base_bits: str = "",
    timeout: float | None = None,
    shard_above: int = SHARD_ABOVE,
    on_round: Callable[[int, RoundResult | None], None] | None = None,
) -> GridOutcome:
    """Average over ``peers`` peers in ``rounds`` rounds of groups of ``group_size``.

    The averager's group bits and target size are set before each round (restored after).
    ``weight`` is this peer's own (e.g. its samples); ``timeout`` bounds each round's search;
    a round whose key is expected to hold more than ``shard_above`` peers declares under shard
    keys first (``kit.averaging.grid.shards_for``);
    ``on_round(index, result)`` is called after each round (e.g. to measure the values).
    """
    grid = GridAverage(base_bits, group_size, rounds, float(weight), shard_above=shard_above)
    matchmaking = averager.matchmaking
    saved = matchmaking.group_bits, matchmaking.settings, matchmaking.shards
    me = averager.peer.peer_id
    results: list[RoundResult | None] = []
    loop = asyncio.get_running_loop()
    wait = 0.0  # how long the next round's leader waits for its key (0: min_matchmaking_time)
    try:
        for index in range(rounds):
            matchmaking.group_bits = grid.bits
            matchmaking.settings = dataclasses.replace(
                saved[1], target_group_size=grid.next_target(peers)
            )
            matchmaking.shards = grid.next_shards(peers)
            scheduled = begin_after_pool(wait, get_dht_time(), timeout)
            late = grid.next_has_late_groups(peers)
            started = loop.time()
            result = await averager.step(
                weight=grid.weight, timeout=timeout, scheduled_time=scheduled
            )
            settings = averager.settings
            wait = later_round_delay(
                late,
                loop.time() - started,
                settings.min_matchmaking_time,
                settings.request_timeout,
            )
            results.append(result)
            grid.round_ended(result, me)
            if on_round is not None:
                on_round(index, result)
    finally:
        matchmaking.group_bits, matchmaking.settings, matchmaking.shards = saved
    return GridOutcome(grid, tuple(results))

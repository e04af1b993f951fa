"""The Moshpit grid (pure) and adaptive deadlines (pure)."""

from __future__ import annotations

import os
import random

import pytest

from kit.averaging.deadlines import Deadlines, parse_deadline
from kit.averaging.grid import (
    GridAverage,
    begin_after_pool,
    coordinate,
    coordinate_bits,
    later_round_delay,
    pool_delay,
    rotated_bits,
    rounds_for,
    search_window,
)
from kit.errors import ConfigError
from kit.p2p.identity import PeerID


def peers(n: int, seed: int = 0) -> list[PeerID]:
    rng = random.Random(seed)
    return [PeerID(rng.randbytes(32)) for _ in range(n)]


@pytest.mark.parametrize(("size", "buckets"), [(4, 4), (32, 32), (3, 8), (2, 2), (5, 16)])
def test_coordinates_are_distinct_and_the_same_on_every_member(size: int, buckets: int) -> None:
    for _ in range(20):
        group_id, members = os.urandom(16), peers(size, seed=size * buckets)
        taken = [coordinate(group_id, members, me, buckets) for me in members]
        assert len(set(taken)) == size and all(0 <= c < buckets for c in taken)
        if size == buckets:
            assert sorted(taken) == list(range(buckets))  # a full group is a permutation
        # Members list the group in the same order (the leader's): they all agree.
        assert taken == [coordinate(group_id, list(members), me, buckets) for me in members]
    with pytest.raises(ConfigError, match="help:"):
        coordinate(b"g", members, peers(1, seed=99)[0], buckets)
    with pytest.raises(ConfigError, match="help:"):
        coordinate(b"g", peers(5), peers(5)[0], 4)


def test_coordinates_spread_partial_groups_over_all_values() -> None:
    seen = {coordinate(os.urandom(16), members, members[0], 8) for members in [peers(2)] * 200}
    assert seen == set(range(8))  # not always the first values: no bucket is starved


def test_rotated_bits_and_rounds() -> None:
    assert rotated_bits("0110", "11") == "1011" and rotated_bits("", "1") == ""
    assert coordinate_bits(32) == 5 and coordinate_bits(2) == 1 and coordinate_bits(5) == 3
    assert [rounds_for(n, 32) for n in (2, 32, 64, 1024, 2048, 32**3)] == [1, 1, 2, 2, 3, 3]
    assert rounds_for(12, 4) == 2 and rounds_for(100, 1) == 1
    # A last round whose keys would hold one peer each is left out; the one before takes all.
    assert [rounds_for(n, 32) for n in (33, 63, 1025, 2047)] == [1, 1, 2, 2]
    assert rounds_for(105, 10) == 2 and rounds_for(200, 10) == 3
    assert GridAverage("", 10, 2, 1.0).next_target(105) == 10  # round 1: groups of G
    last = GridAverage("", 10, 2, 1.0, coordinates=[3])
    assert last.next_target(105) == 11  # round 2: every peer of its key (10 or 11)
    assert GridAverage("", 32, 1, 1.0).next_target(33) == 33


def test_a_full_grid_covers_every_peer_once_in_d_rounds() -> None:
    """The bookkeeping alone, on a grid of 4^3 peers: each round's groups (peers with the same
    key) merge disjoint sets; after 3 rounds every peer's set is everyone."""
    g, d = 4, 3
    everyone = peers(g**d, seed=7)
    grids = {p: GridAverage("01", g, d, 1.0) for p in everyone}
    covers = {p: frozenset([p]) for p in everyone}
    for round_index in range(d):
        by_key: dict[str, list[PeerID]] = {}
        for p in everyone:
            by_key.setdefault(grids[p].bits, []).append(p)
        for key, members in by_key.items():
            assert key.startswith("01") and len(key) == 2 + 2 * round_index
            for chunk in [members[i : i + g] for i in range(0, len(members), g)]:
                assert len(chunk) == g
                group_id = os.urandom(16)
                weights = [grids[p].weight for p in chunk]
                union = frozenset().union(*(covers[p] for p in chunk))
                assert sum(len(covers[p]) for p in chunk) == len(union)  # disjoint: none twice
                for p in chunk:
                    grids[p].averaged(group_id, list(chunk), weights, p, full=True)
                    covers[p] = union
    assert all(covers[p] == frozenset(everyone) and grids[p].weight == g**d for p in everyone)
    assert all(grids[p].exact and grids[p].completed == d for p in everyone)


def test_a_peer_without_a_group_keeps_its_weight_and_moves_on() -> None:
    grid = GridAverage("", 4, 2, 5.0)
    me = peers(1)[0]
    grid.failed(me)
    assert grid.weight == 5.0 and not grid.exact and grid.completed == 0
    assert len(grid.bits) == 2 and 0 <= grid.coordinates[0] < 4
    assert grid.next_target(12) == 3  # 12 peers in keys of 4 values: 3 per key
    assert GridAverage("", 32, 2, 1.0).next_target(1024) == 32


def test_a_later_round_waits_a_search_window_and_the_round_before() -> None:
    # A search window (2 x 3 s + 1 s) plus our own round before (0.4 s): a group that formed
    # up to the end of its search, or ended 3.5 s after ours (the case that failed), still
    # finds its keys' leaders waiting.
    assert search_window(3.0) == 7.0
    assert later_round_delay(False, 0.4, 3.0, 5.0) == pytest.approx(7.4)
    # After a round with late groups (a pool): at least the pool's delay.
    assert later_round_delay(True, 0.5, 3.0, 1.0) == search_window(3.0) + 0.5
    assert later_round_delay(True, 0.5, 3.0, 9.0) == pool_delay(True, 3.0, 9.0) == 15.0
    assert later_round_delay(False, 20.0, 3.0, 5.0) == 27.0
    assert later_round_delay(False, -1.0, 3.0, 5.0) == 7.0  # a clock step back: no less
    assert begin_after_pool(7.4, 100.0, None) == pytest.approx(107.4)
    assert begin_after_pool(7.4, 100.0, 10.0) is None  # more than half the search: default
    assert begin_after_pool(0.0, 100.0, None) is None


def test_deadlines_fixed_or_auto() -> None:
    fixed = Deadlines.create(15.0, 60, 10**6)
    assert not fixed.auto and fixed.matchmaking_time(1000) == 15.0
    assert fixed.averaging_timeout(3) == 60.0
    auto = Deadlines.create("auto", "auto", 100 * 2**20)  # 100 MiB of gradients
    # Before any round: the size of the swarm, and the vector at a slow home uplink.
    assert auto.matchmaking_time(16) == pytest.approx(5.0)
    assert auto.matchmaking_time(1024) == pytest.approx(8.0)
    assert auto.averaging_timeout(16) == pytest.approx(3 * 2 * 100 * 2**20 / 1.25e6)
    auto.observe_round(12.0)
    auto.observe_round(20.0)
    assert auto.averaging_timeout(16) == 60.0  # three times the slowest round seen
    auto.observe_round(None)  # it hit the timeout: twice as long next time
    assert auto.averaging_timeout(16) == 120.0
    auto.observe_search(6.0, filled=True)
    assert auto.matchmaking_time(16) == 12.0
    auto.observe_search(14.0, filled=False)  # waited its whole matchmaking time: says nothing
    assert auto.matchmaking_time(16) == 12.0
    auto.observe_search(None, filled=False)  # no group although others were there
    assert auto.matchmaking_time(16) == 18.0
    assert Deadlines.create("auto", "auto", 10**12).averaging_timeout(2) == 1800.0  # bounded


def test_deadline_arguments_are_validated() -> None:
    assert parse_deadline("x", "auto") is None and parse_deadline("x", 3) == 3.0
    for bad in ("fast", -1, 0, float("inf"), True):
        with pytest.raises(ConfigError, match="help:"):
            parse_deadline("matchmaking_time", bad)
    with pytest.raises(ConfigError, match="help:"):
        Deadlines.create(30.0, 20.0, 1)

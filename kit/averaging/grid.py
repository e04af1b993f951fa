"""Moshpit averaging's grid (Ryabinin et al., 2021): group keys as coordinates. Pure.

Holds how a peer's group bits change after a round (:func:`coordinate`, :func:`rotated_bits`)
and the bookkeeping of one Moshpit average (:class:`GridAverage`). It does not hold I/O: the
averager (``kit.averaging.averager``) runs the rounds, ``kit.optim.rounds`` and
``kit.testing.swarm`` drive them.

The idea (Moshpit SGD, §3.1): put N = G^d peers on a d-dimensional grid of side G. A round
averages each line of peers along one dimension (groups of G: a peer's group key is its
coordinates on the other dimensions); after d rounds, one along each dimension, every peer
holds the exact global mean, for G^d peers at the cost of d group rounds of G.

kit builds the grid as it goes, so nobody has to agree on coordinates beforehand:

* round 1 groups everyone under one key (matchmaking cuts the ranked peers into groups of G);
* after each round, the members of a group take distinct new coordinates (their places in a
  permutation of the group that every member computes alike from the group id), appended to
  the key: round 2 groups the peers that took the same coordinate, one from each round-1
  group, and so on. On a full grid (N = G^d, every group full) round k's groups cover
  G^k peers, disjoint, and d rounds give the exact global mean.
* Each peer averages with the weight of everything its value already stands for (its
  samples, then its group's total, ...): every value is at all times the exact weighted mean
  over a set of distinct peers, and its weight says how much of the swarm that set holds.
  So when the grid is incomplete (N not a power of G, peers missing, a round failing for some)
  nothing is counted twice; a peer whose final weight falls short of the swarm's total holds
  the mean of a part of it (measured by ``benchmarks/swarm.py``: README, "Thousands of peers").

hivemind's averager rotates a fixed-length register of bits instead (its ``initial_group_bits``
grid, one new chunk per round, the oldest dropped): :func:`rotated_bits` does the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

from kit.errors import ConfigError
from kit.p2p.identity import PeerID


def coordinate_bits(buckets: int) -> int:
    """Bits of one coordinate with ``buckets`` values (at least 1)."""
    return max(1, math.ceil(math.log2(max(buckets, 2))))


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 2 ** (n - 1).bit_length()


def coordinate(group_id: bytes, peers: Sequence[PeerID], me: PeerID, buckets: int) -> int:
    """This member's new coordinate in ``range(buckets)``, distinct within the group.

    Every member computes the same assignment from the group id: the members, ordered by a
    hash of (group id, peer), take the first values of the buckets ordered by a hash of
    (group id, value). A full group (as many members as buckets) is a permutation.

    Raises:
        ConfigError: ``me`` is not a member, or more members than buckets.
    """
    if me not in peers:
        raise ConfigError("coordinate: this peer is not a member of the group - help: pass its id")
    if len(peers) > buckets:
        raise ConfigError(
            f"coordinate: {len(peers)} members but only {buckets} values - help: buckets must be"
            " at least the group size (the target group size)"
        )
    members = sorted(peers, key=lambda p: hashlib.sha256(group_id + p.to_bytes()).digest())
    values = sorted(
        range(buckets), key=lambda v: hashlib.sha256(group_id + v.to_bytes(4, "big")).digest()
    )
    return values[members.index(me)]


def coordinate_to_bits(value: int, nbits: int) -> str:
    return format(value, "b").rjust(nbits, "0")[-nbits:]


def rotated_bits(bits: str, new: str) -> str:
    """hivemind's group-bit register: append the new coordinate, keep the length."""
    return (bits + new)[-len(bits) :] if bits else ""


#: A key expected to hold more peers than this is split into shards (see :func:`shards_for`).
SHARD_ABOVE = 256


def shards_for(expected: int, group_size: int, shard_above: int = SHARD_ABOVE) -> int:
    """Shard keys for a round whose key is expected to hold ``expected`` peers (1: none).

    Every peer polls the key it declared under, so a key of n declarations costs its few
    replicas about n^2 declarations per round of polls: fine at 256 peers (the benchmark:
    groups full, 2.6 s rounds), not at 1,024 (seconds per poll; chunks split). S shards cost
    (n/S)^2 each, plus the pool where their remainders meet (about S * G/2 peers): both are
    about equal for S = sqrt(2n/G) (8 at 1,024 peers in groups of 32: shards of ~128 and a
    pool of ~128). Each shard keeps at least two groups' worth of peers on average.
    """
    if expected <= shard_above or group_size < 2:
        return 1
    balanced = math.isqrt(2 * expected // group_size)
    return max(1, min(balanced, expected // (2 * group_size)))


def rounds_for(peers: int, group_size: int) -> int:
    """Moshpit rounds for ``peers`` in groups of ``group_size``: ceil(log_G(N)), at least 1;
    one fewer when the last round would be useless.

    Round k's keys hold about N / G^(k-1) peers. When that is below 2 for the last round
    (G^(d-1) < N < 2 G^(d-1): e.g. 105 peers in groups of 10), nearly every key of the last
    round holds one peer, which has nobody to average with: round d-1 takes the surplus
    instead (its groups are then up to 2G - 1: 11 here, see ``GridAverage.next_target``).
    """
    if group_size < 2 or peers <= group_size:
        return 1
    rounds, covered = 0, 1
    while covered < peers:
        covered *= group_size
        rounds += 1
    if rounds > 1 and peers < 2 * group_size ** (rounds - 1):
        rounds -= 1
    return rounds


def pool_delay(late_groups: bool, min_matchmaking_time: float, request_timeout: float) -> float:
    """How much later than the round's full groups its ``late_groups`` may end (0: none): a
    sharded round's pool, or a remainder group that waits out its matchmaking time, forms one
    matchmaking time and a settled view later."""
    return 2 * min_matchmaking_time + request_timeout if late_groups else 0.0


def search_window(matchmaking_time: float) -> float:
    """How long a gradient round looks for its group: two matchmaking times (one to gather, one
    for a leader found late) and a second for the last polls."""
    return 2 * matchmaking_time + 1.0


def later_round_delay(
    late_groups: bool, previous_took: float, min_matchmaking_time: float, request_timeout: float
) -> float:
    """How long after it declares a later round's leader waits for its key to fill (it begins
    at once when it fills): at least ``pool_delay``, and a search window plus as long as this
    peer's own round before took (``previous_took``).

    A later round's key gathers one member of each group of the round before, and those end
    at different times: a group forms anywhere in the search window (a few polls later on a
    loaded machine), and its all-reduce may run over a slower link. Waiting one matchmaking
    time cut such a group's members off every key: a whole group of 4 ending 3.5 s late (CI's
    2-core machine) left its 4 peers with 1 of 2 rounds (29% of the samples) and the other 8
    with 71%. A group that formed as late as the search allows and took up to twice as long
    as ours still makes it. The price: a key whose member is gone waits that long (a missing
    member of a remainder key already cost ``pool_delay``).
    """
    pool = pool_delay(late_groups, min_matchmaking_time, request_timeout)
    return max(pool, search_window(min_matchmaking_time) + max(0.0, previous_took))


def begin_after_pool(after_pool: float, now: float, timeout: float | None) -> float | None:
    """When a later round's leader begins at the latest (DHT time; None: one matchmaking time
    after it declares), ``after_pool`` from now (``later_round_delay``).

    Its key gathers members of groups that ended early (a sharded round's shards) and late
    (its pool, slower groups): a leader that does not fill at once waits for them (full groups
    still begin at once). Not when that would take half the round's search time or more.
    """
    if after_pool <= 0 or (timeout is not None and after_pool >= timeout / 2):
        return None
    return now + after_pool


class GroupResult(Protocol):
    """What a grid needs of a round's result (``kit.averaging.async_averager.RoundResult``)."""

    @property
    def group_id(self) -> bytes: ...
    @property
    def peers(self) -> Sequence[PeerID]: ...
    @property
    def weights(self) -> Sequence[float]: ...
    @property
    def is_full(self) -> bool: ...


@dataclasses.dataclass
class GridAverage:
    """One peer's progress through the rounds of one Moshpit average (mutable, pure).

    ``weight`` is what this peer's current value stands for: its own weight, then the sum of
    the weights of its last group. ``exact`` stays True while every round was full.
    """

    base_bits: str  # the key of the whole average (e.g. the epoch's bits)
    group_size: int  # G: the target group size, and the number of values of a coordinate
    rounds: int  # d
    weight: float  # of this peer's value so far
    coordinates: list[int] = dataclasses.field(default_factory=list)
    completed: int = 0  # rounds this peer averaged in
    exact: bool = True  # every round so far averaged every part over every sender
    shard_above: int = SHARD_ABOVE  # keys expected to hold more peers are sharded

    @property
    def bits(self) -> str:
        """The group bits of the next round."""
        nbits = coordinate_bits(self.group_size)
        return self.base_bits + "".join(coordinate_to_bits(c, nbits) for c in self.coordinates)

    def next_target(self, peers: int) -> int:
        """The group size to wait for in the next round: G, or as many as its key is expected
        to hold if fewer; in the last round all of them (up to 2G - 1: see ``rounds_for``)."""
        expected = math.ceil(peers / self.group_size ** len(self.coordinates))
        if len(self.coordinates) + 1 >= self.rounds:
            return max(2, expected)
        return max(2, min(self.group_size, expected))

    def averaged(
        self,
        group_id: bytes,
        peers: Sequence[PeerID],
        weights: Sequence[float],
        me: PeerID,
        full: bool,
    ) -> None:
        """This peer's round went through with this group."""
        self.coordinates.append(coordinate(group_id, peers, me, max(self.group_size, len(peers))))
        self.weight = float(sum(weights))
        self.completed += 1
        self.exact = self.exact and full

    def next_has_late_groups(self, peers: int) -> bool:
        """The next round has groups that form late: its keys are sharded (the pool), or they
        do not split into full groups (a remainder waits out its matchmaking time). The round
        after it must then wait for their members (``begin_after_pool``)."""
        expected = math.ceil(peers / self.group_size ** len(self.coordinates))
        return self.next_shards(peers) > 1 or expected % self.next_target(peers) != 0

    @property
    def next_round_is_everyones(self) -> bool:
        """The next round's key holds every peer of the average (the first round): once any
        peer stepped past the epoch, all of its groups formed. A later round's key holds one
        peer of each group of the round before, which end at different times (a loaded peer's
        round ends seconds after the others'): other keys' groups finishing, and their members
        stepping, says nothing about whether ours still fills."""
        return not self.coordinates

    def next_shards(self, peers: int) -> int:
        """Shard keys of the next round (``shards_for`` its expected peers per key)."""
        expected = math.ceil(peers / self.group_size ** len(self.coordinates))
        return shards_for(expected, self.group_size, self.shard_above)

    def round_ended(self, result: GroupResult | None, me: PeerID) -> None:
        """After a round: averaged with ``result``'s group, or (None) no group."""
        if result is None:
            self.failed(me)
        else:
            self.averaged(result.group_id, result.peers, result.weights, me, result.is_full)

    def failed(self, me: PeerID) -> None:
        """No group this round: keep the value (and weight); take a coordinate from the id, so
        that the next round still finds others (its value then joins theirs, counted once)."""
        salt = len(self.coordinates).to_bytes(4, "big")
        digest = hashlib.sha256(salt + me.to_bytes()).digest()
        self.coordinates.append(int.from_bytes(digest[:4], "big") % self.group_size)
        self.exact = False

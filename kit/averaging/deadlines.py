"""Adaptive deadlines: ``matchmaking_time`` and ``averaging_timeout`` that need no guessing. Pure.

Holds :class:`Deadlines`: each of the two is a number (fixed, as before) or ``"auto"``, derived
from the swarm's size and from the rounds this peer saw, within bounds. It does not hold I/O:
``kit.Optimizer`` feeds it each round's timings and reads the values before the next round.

Why: users had to guess both (hivemind #515, #676): too short a matchmaking time gives groups
of one peer; too short a timeout aborts every round on slow links, too long a one stalls the
swarm for minutes when a peer vanishes. What sets them:

* matchmaking: finding a group costs DHT stores and polls, whose round trips grow with the
  log of the swarm (Kademlia), plus the join requests; with thousands of peers a poll also
  carries thousands of declarations. ``auto``: MATCHMAKING_BASE + MATCHMAKING_PER_DOUBLING per
  doubling of the peers, at least twice the slowest search that filled its group in the last
  rounds (a search that did not fill waited the matchmaking time itself: it says nothing), and
  1.5 times longer after each round that found no group although others were expected;
* averaging: a round moves about twice the vector through the slowest member's link. ``auto``:
  three times the slowest of the last rounds; before any round, the vector's bytes at
  COLD_START_RATE (a pessimistic 10 Mbit/s), times three; after a round that timed out, twice
  the last value. Never below twice the matchmaking time (a round includes its matchmaking).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from kit.errors import ConfigError

AUTO = "auto"
MATCHMAKING_BASE = 3.0  # seconds: a few DHT round trips and join requests on the Internet
MATCHMAKING_PER_DOUBLING = 0.5  # seconds more per doubling of the swarm (lookup hops, bigger keys)
MATCHMAKING_BOUNDS = (2.0, 60.0)
TIMEOUT_BOUNDS = (10.0, 1800.0)
COLD_START_RATE = 10e6 / 8  # bytes/s assumed before the first round (a slow home uplink)
SAFETY = 3.0  # a round may take this many times the slowest recent one
RECENT = 8  # rounds remembered


def parse_deadline(name: str, value: object) -> float | None:
    """A fixed deadline in seconds, or None for ``"auto"``.

    Raises:
        ConfigError: anything else.
    """
    if value == AUTO or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(
            f"{name}={value!r} must be a positive number of seconds or 'auto'"
            " - help: leave it 'auto' unless rounds keep failing"
        )
    return float(value)


@dataclasses.dataclass
class Deadlines:
    """The matchmaking time and averaging timeout of the next round (mutable, pure)."""

    fixed_matchmaking: float | None  # None: auto
    fixed_timeout: float | None  # None: auto
    vector_bytes: int  # bytes of the averaged vector on the wire
    searches: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT)
    )
    rounds: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT)
    )
    backoff: float = (
        1.0  # doubles after a round that hit the timeout, resets after one that did not
    )
    search_backoff: float = 1.0  # x1.5 after a round without a group, reset by one with a group

    @classmethod
    def create(
        cls, matchmaking_time: object, averaging_timeout: object, vector_bytes: int
    ) -> Deadlines:
        matchmaking = parse_deadline("matchmaking_time", matchmaking_time)
        timeout = parse_deadline("averaging_timeout", averaging_timeout)
        if matchmaking is not None and timeout is not None and matchmaking >= timeout:
            raise ConfigError(
                f"averaging_timeout ({timeout}) must exceed matchmaking_time ({matchmaking})"
                " - help: a round includes its matchmaking: use at least 2x matchmaking_time"
            )
        return cls(matchmaking, timeout, max(0, int(vector_bytes)))

    @property
    def auto(self) -> bool:
        return self.fixed_matchmaking is None or self.fixed_timeout is None

    def matchmaking_time(self, peers: int) -> float:
        if self.fixed_matchmaking is not None:
            return self.fixed_matchmaking
        by_size = MATCHMAKING_BASE + MATCHMAKING_PER_DOUBLING * math.log2(max(peers, 2))
        seen = 2 * max(self.searches, default=0.0)
        wanted = max(by_size, seen) * self.search_backoff
        return min(max(wanted, MATCHMAKING_BOUNDS[0]), MATCHMAKING_BOUNDS[1])

    def averaging_timeout(self, peers: int) -> float:
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        if self.rounds:
            base = SAFETY * max(self.rounds)
        else:
            base = SAFETY * 2 * self.vector_bytes / COLD_START_RATE
        floor = max(TIMEOUT_BOUNDS[0], 2 * self.matchmaking_time(peers))
        return min(max(base * self.backoff, floor), TIMEOUT_BOUNDS[1])

    def observe_search(self, seconds: float | None, *, filled: bool) -> None:
        """A search for a group: how long it took (None: no group although others were
        expected); ``filled``: it ended because the group was complete."""
        if seconds is None:
            self.search_backoff = min(self.search_backoff * 1.5, 16.0)
            return
        self.search_backoff = 1.0
        if filled and seconds >= 0 and math.isfinite(seconds):
            self.searches.append(seconds)

    def observe_round(self, seconds: float | None) -> None:
        """An all-reduce: how long it took (None: it hit the timeout)."""
        if seconds is None:
            self.backoff = min(self.backoff * 2, 64.0)
        elif seconds >= 0 and math.isfinite(seconds):
            self.rounds.append(seconds)
            self.backoff = 1.0

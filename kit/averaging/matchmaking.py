"""Matchmaking as a pure state machine: which peers average together, and in what order.

Holds the ``Matchmaker`` (a sans-I/O core in the style of h11: ``Phase`` enum, transition table,
every method takes ``now`` and returns the actions its driver must carry out) and the data it
decides on: ``Declaration`` (what a looking peer publishes in the DHT), ``MemberInfo`` (what a
follower tells its leader). It does not hold the wire format of the group (``kit.averaging.group``)
or any I/O (the driver in ``kit.averaging.averager``).

How a group forms (after hivemind's ``Matchmaking``, simplified):

* A peer that can accept connections declares itself under ``{prefix}.0b{bits}`` in the DHT with
  its *expiration*: the time it will begin the round at the latest (now + min_matchmaking_time).
  Every peer orders leaders by ``(expiration, peer id)``: whoever became ready first leads.
* A peer that sees a better leader than itself asks to join it; a leader accepts followers until
  the group has ``target_group_size`` members (then it begins at once) or its expiration passes
  with at least ``min_group_size`` members. A peer that already follows (or is joining someone)
  refuses join requests and names its own leader, so chains collapse onto one leader.
* A leader that discovers a better leader disbands its followers (pointing them to it) and joins
  it: views of the DHT differ for a moment, but ``(expiration, peer id)`` is a strict order, so
  peers converge on the best leader they can all see.
* Client-mode peers cannot lead (nobody can dial them): they never declare and only join.
* A follower whose leader disappears looks again; nobody waits past its own deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kit.errors import ConfigError, LocalProtocolError
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

MAX_ADDRESSES = 8  # addresses kept per peer (declarations, join requests, groups)
MAX_ADDRESS_LENGTH = 1024  # characters of one address


class Phase(enum.Enum):
    IDLE = "idle"  # not looking for a group
    LOOKING = "looking"  # declared: waiting for followers, or for a better leader to show up
    JOINING = "joining"  # asked a leader to join; waiting for its answer
    FOLLOWING = "following"  # accepted by a leader; waiting for it to begin the round
    LEADING = "leading"  # has followers; waiting for the group to fill or the expiration
    ASSEMBLED = "assembled"  # the group is known (final)
    FAILED = "failed"  # no group before the deadline, or cancelled (final)


class Trigger(enum.Enum):
    START = "start"
    ASK_LEADER = "ask_leader"
    ACCEPTED = "accepted"
    REFUSED = "refused"
    FOLLOWER_JOINED = "follower_joined"
    LAST_FOLLOWER_LEFT = "last_follower_left"
    DISBAND = "disband"
    BEGIN = "begin"
    GROUP_RECEIVED = "group_received"
    LEADER_LOST = "leader_lost"
    DEADLINE = "deadline"
    CANCEL = "cancel"


_ENDINGS = {Trigger.DEADLINE: Phase.FAILED, Trigger.CANCEL: Phase.FAILED}
TRANSITIONS: dict[Phase, dict[Trigger, Phase]] = {
    Phase.IDLE: {Trigger.START: Phase.LOOKING},
    Phase.LOOKING: {
        Trigger.ASK_LEADER: Phase.JOINING,
        Trigger.FOLLOWER_JOINED: Phase.LEADING,
        **_ENDINGS,
    },
    Phase.JOINING: {Trigger.ACCEPTED: Phase.FOLLOWING, Trigger.REFUSED: Phase.LOOKING, **_ENDINGS},
    Phase.FOLLOWING: {
        Trigger.GROUP_RECEIVED: Phase.ASSEMBLED,
        Trigger.LEADER_LOST: Phase.LOOKING,
        **_ENDINGS,
    },
    Phase.LEADING: {
        Trigger.FOLLOWER_JOINED: Phase.LEADING,
        Trigger.LAST_FOLLOWER_LEFT: Phase.LOOKING,
        Trigger.DISBAND: Phase.JOINING,
        Trigger.BEGIN: Phase.ASSEMBLED,
        **_ENDINGS,
    },
    Phase.ASSEMBLED: {},
    Phase.FAILED: {},
}
FINAL_PHASES = (Phase.ASSEMBLED, Phase.FAILED)


@dataclasses.dataclass(frozen=True)
class MatchmakingSettings:
    """How groups form; every field is an argument of ``DecentralizedAverager``."""

    target_group_size: int | None = None  # begin at once with this many members (None: no cap)
    min_group_size: int = 2  # fewer members than this never begin a round
    min_matchmaking_time: float = 5.0  # a leader waits this long for followers before beginning
    request_timeout: float = 3.0  # a leader must answer a join request within this; retry after it

    def __post_init__(self) -> None:
        if self.min_group_size < 2:
            raise ConfigError(
                f"min_group_size={self.min_group_size} must be >= 2"
                " - help: a round needs at least two peers"
            )
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ConfigError(
                f"target_group_size={self.target_group_size} < min_group_size="
                f"{self.min_group_size} - help: raise target_group_size or leave it None"
            )
        if not (self.min_matchmaking_time >= 0 and self.request_timeout > 0):
            raise ConfigError(
                "min_matchmaking_time must be >= 0 and request_timeout > 0 seconds"
                " - help: e.g. min_matchmaking_time=5 (internet: 10-15), request_timeout=3"
            )


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A looking peer's entry under the group key: it leads if it is the best one around."""

    peer_id: PeerID
    expiration: float  # DHT time by which it begins a round, if it has enough followers
    addresses: tuple[str, ...]  # where to dial it

    @property
    def rank(self) -> tuple[float, bytes]:
        """Leaders are ordered by this: the earliest expiration, then the smallest id."""
        return (self.expiration, self.peer_id.to_bytes())

    def to_value(self) -> dict[str, Any]:
        return {"expiration": self.expiration, "addresses": list(self.addresses)}

    @classmethod
    def parse_entries(cls, entries: Any, now: float) -> list[Declaration]:
        """Declarations from a DHT dictionary value ``{subkey: (value, expiration)}``.

        Entries of other shapes (tombstones, hostile or corrupted values) are skipped.
        """
        declarations: list[Declaration] = []
        if not isinstance(entries, Mapping):
            return declarations
        for subkey, item in entries.items():
            value = getattr(item, "value", None)
            expiration_time = getattr(item, "expiration_time", 0.0)
            if not isinstance(subkey, bytes) or len(subkey) != PeerID.SIZE:
                continue
            if not isinstance(value, Mapping) or not expiration_time >= now:
                continue
            expiration, addresses = value.get("expiration"), value.get("addresses")
            if not (isinstance(expiration, float | int) and math.isfinite(expiration)):
                continue
            parsed = parse_addresses(addresses)
            if parsed is not None:
                declarations.append(cls(PeerID(subkey), float(expiration), parsed))
        return declarations


def parse_addresses(addresses: Any) -> tuple[str, ...] | None:
    """Untrusted addresses as a tuple of at most MAX_ADDRESSES strings, or None if malformed."""
    if not isinstance(addresses, list | tuple) or len(addresses) > MAX_ADDRESSES:
        return None
    if not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_LENGTH for a in addresses):
        return None
    return tuple(addresses)


@dataclasses.dataclass(frozen=True)
class MemberInfo:
    """What a peer brings to a group (a follower sends it in its join request)."""

    peer_id: PeerID
    client_mode: bool  # accepts no connections: aggregates nothing
    auxiliary: bool  # aggregates, but contributes no vector (weight 0)
    weight: float  # this round's weight of its vector (e.g. samples); 0 for auxiliary peers
    bandwidth: float | None  # for load balancing; None = unknown (the group's mean is used)
    addresses: tuple[str, ...]  # where to dial it (empty for client-mode peers)


@dataclasses.dataclass(frozen=True)
class AskLeader:
    """Open a join request to ``leader`` (its addresses are in ``declaration``)."""

    declaration: Declaration


@dataclasses.dataclass(frozen=True)
class Release:
    """Tell these followers the group will not happen here; ``suggested``: who to ask instead."""

    followers: tuple[PeerID, ...]
    suggested: Declaration | None


@dataclasses.dataclass(frozen=True)
class Begin:
    """This peer leads the group ``members`` (itself first, then followers in join order)."""

    members: tuple[MemberInfo, ...]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a join request was refused, and who the asker should try instead."""

    reason: str  # not_looking | following | full | not_a_leader
    suggested: Declaration | None = None


Action = AskLeader | Release | Begin


class Matchmaker:
    """One peer's search for a group, from ``start`` to ASSEMBLED or FAILED. Pure: no I/O.

    Times are DHT times (wall clock shared by peers), passed in as ``now``.
    """

    def __init__(self, me: MemberInfo, settings: MatchmakingSettings) -> None:
        self.me = me
        self.settings = settings
        self.phase = Phase.IDLE
        self.expiration = math.inf  # when this peer begins as a leader at the latest
        self.deadline = math.inf  # when it gives up
        self.followers: dict[PeerID, MemberInfo] = {}  # in join order
        self.leader: Declaration | None = None  # who it joins or follows
        self.refused_at: dict[PeerID, float] = {}  # leaders not to ask again for a while
        self.members: tuple[MemberInfo, ...] | None = None  # set when it begins as leader
        self.failure = ""  # why it failed

    @property
    def can_lead(self) -> bool:
        return not self.me.client_mode

    @property
    def declaration(self) -> Declaration:
        return Declaration(self.me.peer_id, self.expiration, self.me.addresses)

    def _move(self, trigger: Trigger) -> None:
        new_phase = TRANSITIONS[self.phase].get(trigger)
        if new_phase is None:
            raise LocalProtocolError(
                f"matchmaking: no transition {self.phase.value} --{trigger.value}-->"
            )
        self.phase = new_phase

    def start(
        self, now: float, deadline: float, scheduled_time: float | None = None
    ) -> Declaration | None:
        """Begin looking; returns the declaration to publish (None for client-mode peers).

        ``scheduled_time``: when to begin the round as a leader at the latest (hivemind's
        ``step(scheduled_time=...)``); default now + min_matchmaking_time."""
        self._move(Trigger.START)
        self.deadline = deadline
        begin = (
            now + self.settings.min_matchmaking_time if scheduled_time is None else scheduled_time
        )
        self.expiration = min(begin, deadline)
        return self.declaration if self.can_lead else None

    # --- what the driver observes -------------------------------------------------------------

    def observe(self, now: float, declarations: Iterable[Declaration]) -> list[Action]:
        """The DHT shows these declarations: ask a better leader, if one is there."""
        if self.phase not in (Phase.LOOKING, Phase.LEADING):
            return []
        best = self._best_leader(now, declarations)
        if best is None:
            return []
        actions: list[Action] = []
        if self.phase is Phase.LEADING:  # a better leader showed up: bring the followers along
            actions.append(Release(tuple(self.followers), best))
            self.followers.clear()
            self._move(Trigger.DISBAND)
        else:
            self._move(Trigger.ASK_LEADER)
        self.leader = best
        actions.append(AskLeader(best))
        return actions

    def _best_leader(self, now: float, declarations: Iterable[Declaration]) -> Declaration | None:
        retry_after = self.settings.request_timeout
        candidates = [
            d
            for d in declarations
            if d.peer_id != self.me.peer_id
            and now - self.refused_at.get(d.peer_id, -math.inf) >= retry_after
            and (not self.can_lead or d.rank < self.declaration.rank)
        ]
        return min(candidates, key=lambda d: d.rank, default=None)

    def join_request(self, now: float, member: MemberInfo) -> tuple[Refusal | None, list[Action]]:
        """A peer asks to follow this one. Returns (None, actions) if accepted, else a refusal."""
        if self.phase in (Phase.JOINING, Phase.FOLLOWING):
            return Refusal("following", self.leader), []
        if self.phase not in (Phase.LOOKING, Phase.LEADING):
            return Refusal("not_looking"), []
        if not self.can_lead:
            return Refusal("not_a_leader"), []
        target = self.settings.target_group_size
        if member.peer_id in self.followers or member.peer_id == self.me.peer_id:
            return Refusal("not_looking"), []
        if target is not None and 1 + len(self.followers) >= target:
            return Refusal("full"), []
        self.followers[member.peer_id] = member
        self._move(Trigger.FOLLOWER_JOINED)
        return None, self.tick(now)

    def follower_left(self, now: float, peer_id: PeerID) -> list[Action]:
        if self.phase is not Phase.LEADING or self.followers.pop(peer_id, None) is None:
            return []
        if not self.followers:
            self._move(Trigger.LAST_FOLLOWER_LEFT)
        return []

    def join_answered(self, now: float, leader: PeerID, refusal: Refusal | None) -> list[Action]:
        """The leader asked by AskLeader answered (``refusal`` None: accepted)."""
        if self.phase is not Phase.JOINING or self.leader is None or self.leader.peer_id != leader:
            return []
        if refusal is None:
            self._move(Trigger.ACCEPTED)
            return []
        self.refused_at[leader] = now
        self.leader = None
        self._move(Trigger.REFUSED)
        suggested = refusal.suggested
        return self.observe(now, [suggested] if suggested is not None else [])

    def leader_lost(self, now: float, leader: PeerID) -> list[Action]:
        """The leader went away, refused to answer in time, or released this follower."""
        if self.leader is None or self.leader.peer_id != leader:
            return []
        if self.phase is Phase.JOINING:
            return self.join_answered(now, leader, Refusal("not_looking"))
        if self.phase is Phase.FOLLOWING:
            self.refused_at[leader] = now
            self.leader = None
            self._move(Trigger.LEADER_LOST)
        return []

    def group_received(self, now: float, leader: PeerID) -> None:
        """The leader sent the group (the driver checked it): matchmaking is over."""
        if self.phase is not Phase.FOLLOWING or self.leader is None:
            raise LocalProtocolError(f"a group arrived while {self.phase.value}")
        if self.leader.peer_id != leader:
            raise LocalProtocolError("a group arrived from a peer this one does not follow")
        self._move(Trigger.GROUP_RECEIVED)

    def cancel(self, reason: str) -> list[Action]:
        """Stop looking (shutdown, or the driver failed); followers are released."""
        if self.phase in FINAL_PHASES:
            return []
        return self._fail(reason)

    # --- time ------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Begin as leader or give up, if it is time."""
        if self.phase is Phase.LEADING:
            size = 1 + len(self.followers)
            full = self.settings.target_group_size is not None and (
                size >= self.settings.target_group_size
            )
            if full or (now >= self.expiration and size >= self.settings.min_group_size):
                self.members = (self.me, *self.followers.values())
                self._move(Trigger.BEGIN)
                return [Begin(self.members)]
        if now >= self.deadline and self.phase not in FINAL_PHASES:
            reason = f"no group of at least {self.settings.min_group_size} peers in time"
            return self._fail(reason, Trigger.DEADLINE)
        return []

    def _fail(self, reason: str, trigger: Trigger = Trigger.CANCEL) -> list[Action]:
        actions: list[Action] = []
        if self.followers:
            actions.append(Release(tuple(self.followers), None))
            self.followers.clear()
        self.failure = reason
        self._move(trigger)
        return actions

    def next_wakeup(self) -> float:
        """When ``tick`` must run next, if nothing else happens before."""
        if self.phase in FINAL_PHASES:
            return math.inf
        if self.phase is Phase.LEADING:
            return min(self.expiration, self.deadline)
        return self.deadline

"""Matchmaking as a pure state machine: which peers average together, and in what order.

Holds the ``Matchmaker`` (a sans-I/O core in the style of h11: ``Phase`` enum, transition table,
every method takes ``now`` and returns the actions its driver must carry out). The data it
decides on (``Declaration``, ``MemberInfo``, the actions) is in ``kit.averaging.declarations``.
It does not hold the wire format of the group (``kit.averaging.group``) or any I/O (the driver in
``kit.averaging.matchmaking_driver``).

How groups form (hivemind's leader/follower protocol, with deterministic chunks so it scales):

* Every looking peer declares itself under ``{prefix}.0b{bits}`` in the DHT with its
  *expiration*: the time it will begin a round at the latest (now + min_matchmaking_time).
* Each peer ranks the declarations it sees and cuts them into chunks of ``target_group_size``;
  it asks its chunk's leader, or leads (``kit.averaging.chunking``: ranks, chunks, leaders).
* A leader accepts whoever asks until it has ``target_group_size`` members (then it begins at
  once) or its expiration passes with at least ``min_group_size``.
* A leader that discovers a better leader of its own chunk disbands its followers (pointing
  them to it) and joins it.
* A peer whose chunk gathered nobody by its expiration asks any other leader, nearest chunks
  first. Nobody waits past its own deadline.

Sharded keys (a *sharded* search, when thousands of peers step at once): every peer polls the
whole key it declared under, so one key of N declarations costs its replicas N^2 declarations
per round of polls (1,024 peers: ~200 KB to each poller, ~80 MB from each replica over 100
Mbit/s links: polls took seconds and chunks split). Moshpit SGD (Ryabinin et al., 2021, §3.1)
spreads peers over the grid by random initial coordinates instead, which gives uneven groups;
kit keeps whole groups with two steps: each peer declares under one of S shard keys (a hash of
its id), and each shard is chunked as above; a peer whose chunk of its shard cannot fill
(the shard's last chunk, once the shard had its matchmaking time to gather) moves to the
*pool* key (``Pool``), where the remainders of every shard are chunked again, ranked by when
they arrived. Every group but the pool's last is full: with N a multiple of G, all are.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable

from kit.averaging.chunking import (
    chunk_leader,
    chunk_target,
    ranked_chunks,
    standing_refusal,
    unreachable,
)
from kit.averaging.declarations import (
    MAX_GONE,
    Action,
    AskLeader,
    Begin,
    Declaration,
    Invite,
    MatchmakingSettings,
    MemberInfo,
    Pool,
    Refusal,
    Release,
)
from kit.errors import LocalProtocolError
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)


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
    POOL = "pool"  # its shard's chunk cannot fill: look again under the pool key
    DEADLINE = "deadline"
    CANCEL = "cancel"


_ENDINGS = {Trigger.DEADLINE: Phase.FAILED, Trigger.CANCEL: Phase.FAILED}
TRANSITIONS: dict[Phase, dict[Trigger, Phase]] = {
    Phase.IDLE: {Trigger.START: Phase.LOOKING},
    Phase.LOOKING: {
        Trigger.ASK_LEADER: Phase.JOINING,
        Trigger.FOLLOWER_JOINED: Phase.LEADING,
        Trigger.POOL: Phase.LOOKING,
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
        Trigger.POOL: Phase.LOOKING,
        **_ENDINGS,
    },
    Phase.ASSEMBLED: {},
    Phase.FAILED: {},
}
FINAL_PHASES = (Phase.ASSEMBLED, Phase.FAILED)


class Matchmaker:
    """One peer's search for a group, from ``start`` to ASSEMBLED or FAILED. Pure: no I/O.

    Times are DHT times (wall clock shared by peers), passed in as ``now``. ``sharded``: it
    declares under one of several shard keys and moves to the pool key if its chunk there
    cannot fill (see the module; needs a target_group_size).
    """

    def __init__(
        self, me: MemberInfo, settings: MatchmakingSettings, *, sharded: bool = False
    ) -> None:
        self.me = me
        self.settings = settings
        self.sharded = sharded and settings.target_group_size is not None
        self.phase = Phase.IDLE
        self.expiration = math.inf  # when this peer begins as a leader at the latest
        self.deadline = math.inf  # when it gives up
        self.started = math.inf  # when it began looking
        self.last_join = -math.inf  # when its latest follower joined
        self.followers: dict[PeerID, MemberInfo] = {}  # in join order
        self.leader: Declaration | None = None  # who it joins or follows
        self.view: dict[PeerID, Declaration] = {}  # every other peer this search saw declared
        self.first_view = math.inf  # when a poll first showed a settled view (see observe)
        self._ahead: frozenset[PeerID] | None = None  # who ranks before us, as polled
        self._ahead_since = math.inf  # when a poll last showed someone new ahead of us
        self.settle_time = 0.0  # how long that must not happen before we decide (the driver's)
        self.invited: set[PeerID] = set()  # chunk-mates told which peers are gone
        self.refused: dict[PeerID, tuple[float, str]] = {}  # who refused us, when and why
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
    ) -> Declaration:
        """Begin looking; returns the declaration to publish (a client's has no address).

        ``scheduled_time``: when to begin the round as a leader at the latest (hivemind's
        ``step(scheduled_time=...)``); default now + min_matchmaking_time."""
        self._move(Trigger.START)
        self.deadline, self.started = deadline, now
        begin = (
            now + self.settings.min_matchmaking_time if scheduled_time is None else scheduled_time
        )
        self.expiration = min(begin, deadline)
        return self.declaration

    # --- choosing a leader ------------------------------------------------------------------

    def _chunks(self) -> tuple[list[list[Declaration]], int]:
        """This search's view cut into chunks (see ``kit.averaging.chunking``), and our index."""
        gone = unreachable(self.refused)
        size = self.settings.target_group_size
        return ranked_chunks(self.view.values(), self.declaration, gone, size)

    def _refusal(self, now: float, peer_id: PeerID) -> str | None:
        """Why ``peer_id`` refused us, if that still holds (None: ask it)."""
        refused = self.refused.get(peer_id)
        return standing_refusal(refused, now, self.settings.request_timeout)

    def _target(self, now: float, anywhere: bool) -> Declaration | None:
        """Whom to ask (see ``chunking.chunk_target``); None: lead (or wait)."""
        chunks, mine = self._chunks()
        return chunk_target(
            chunks,
            mine,
            self.me.peer_id,
            can_lead=self.can_lead,
            anywhere=anywhere,
            min_group_size=self.settings.min_group_size,
            refusal=lambda peer_id: self._refusal(now, peer_id),
        )

    def _ask(self, target: Declaration) -> list[Action]:
        actions: list[Action] = []
        if self.phase is Phase.LEADING:  # bring the followers along
            actions.append(Release(tuple(self.followers), target))
            self.followers.clear()
            self._move(Trigger.DISBAND)
        else:
            self._move(Trigger.ASK_LEADER)
        self.leader = target
        actions.append(AskLeader(target))
        return actions

    def _settled(self) -> float:
        """When the others had time to find this peer: its expiration, but never less than a
        request_timeout after its first view of the DHT (when stores and polls are slow, e.g.
        hundreds of peers on one CPU, the expiration may pass before anyone saw anyone)."""
        seen = self.first_view + self.settings.request_timeout
        return max(self.expiration, min(seen, self.deadline - self.settings.request_timeout))

    def _begin_at(self) -> float:
        """A leader begins with the followers it has (at least min_group_size) at this time;
        later if peers of its chunk (as it sees it) have not joined yet: they may still be
        deciding (their stores landed late, so their views settled late). It then waits twice
        as long as its own view took to settle (views settle at times spread about that much:
        hundreds of peers sharing one loaded CPU settled from 20 to 90 s, and leaders that
        waited a fixed time split their chunks in two), and a request_timeout after the latest
        follower joined."""
        begin = self._settled()
        if self.first_view < math.inf and 1 + len(self.followers) < self._chunk_size():
            timeout = self.settings.request_timeout
            waited = max(2 * timeout, 2 * (self.first_view - self.started))
            patient = max(self.first_view + waited, self.last_join + timeout)
            begin = max(begin, min(patient, self.deadline - timeout))
        return begin

    def _chunk_size(self) -> int:
        chunks, mine = self._chunks()
        return len(chunks[mine])

    def _given_up_on_chunk(self, now: float) -> bool:
        """Nobody came to this peer although it had time to be found: look anywhere."""
        return now >= self._settled()

    def _reconsider(self, now: float) -> list[Action]:
        """After a poll, a refusal or a lost leader: ask whoever the view says to ask now."""
        if self.phase is Phase.LOOKING and self.sharded:
            return self._reconsider_in_shard(now)
        if self.phase is Phase.LOOKING:
            anywhere = self._given_up_on_chunk(now)
            target = self._target(now, anywhere)
            return self._ask(target) if target is not None else self._invitations()
        if self.phase is Phase.LEADING:
            target = self._target(now, anywhere=False)
            # Only a better leader of this peer's own chunk is worth disbanding for.
            if target is not None and target.rank < self.declaration.rank:
                return self._ask(target)
            return self._invitations()
        return []

    def _reconsider_in_shard(self, now: float) -> list[Action]:
        """A sharded search looks in its own chunk only; what cannot form there goes to the
        pool (not to other chunks of the shard: those fill with their own peers)."""
        chunks, mine = self._chunks()
        chunk, given_up = chunks[mine], self._given_up_on_chunk(now)
        if len(chunk) < self._target_size():
            # The shard's last chunk: more peers may append to it until they all had their
            # matchmaking time; then it goes to the pool as a whole.
            return self._pool(now) if given_up else []
        leader = chunk_leader(
            chunk, self.me.peer_id, self.can_lead, lambda peer_id: self._refusal(now, peer_id)
        )
        if leader is None:  # formed without us (full), or its leader is asking: wait a little
            full = any(self._refusal(now, d.peer_id) == "full" for d in chunk)
            return self._pool(now) if full or given_up else []
        if leader.peer_id != self.me.peer_id:
            return self._ask(leader)
        if given_up and now >= self._begin_at():  # we lead, and nobody came: try the pool
            return self._pool(now)
        return self._invitations()

    def _target_size(self) -> int:
        return self.settings.target_group_size or 0

    def _pool(self, now: float) -> list[Action]:
        """Leave the shard for the pool key: a new search there, ranked by arrival (so that
        the remainders of slow shards append to the pool's chunks, never shift them)."""
        actions: list[Action] = []
        if self.followers:
            actions.append(Release(tuple(self.followers), None))
            self.followers.clear()
        self._move(Trigger.POOL)
        self.sharded = False
        self.view.clear()
        self.refused.clear()
        self.invited.clear()
        self.first_view, self._ahead, self._ahead_since = math.inf, None, math.inf
        self.started, self.last_join = now, -math.inf
        self.expiration = min(now + self.settings.min_matchmaking_time, self.deadline)
        actions.append(Pool(self.declaration))
        return actions

    def _invitations(self) -> list[Action]:
        """This peer leads its chunk, and knows peers ahead that are gone (crashed, their
        declarations not expired yet): its chunk-mates who do not know it count themselves in
        the next chunk. Tell them, once each."""
        gone = unreachable(self.refused)
        if not gone or self.first_view == math.inf:
            return []
        chunks, mine = self._chunks()
        actions: list[Action] = []
        for declaration in chunks[mine]:
            peer_id = declaration.peer_id
            if peer_id == self.me.peer_id or peer_id in self.followers or peer_id in self.invited:
                continue
            self.invited.add(peer_id)
            actions.append(Invite(declaration, gone[:MAX_GONE]))
        return actions

    def invited_by(self, now: float, inviter: Declaration, gone: Iterable[PeerID]) -> list[Action]:
        """A leader says these peers ahead of us are gone: recount, maybe join it."""
        for peer_id in gone:
            if peer_id != self.me.peer_id and peer_id != inviter.peer_id:
                self.refused[peer_id] = (now, "unreachable")
        if inviter.peer_id != self.me.peer_id:
            self.view[inviter.peer_id] = inviter
        return self._reconsider(now) if self.first_view < math.inf else []

    # --- what the driver observes -------------------------------------------------------------

    def observe(
        self, now: float, declarations: Iterable[Declaration], *, confirms: bool = True
    ) -> list[Action]:
        """The DHT shows these declarations (a fresh poll of the group key, maybe partial).

        ``confirms``: the poll may confirm that nobody new is ahead of us (the driver says no
        when the replicas it read lacked even our own declaration: they lag behind).
        """
        # The view is every declaration this search has seen: one poll reads a few replicas
        # and may miss stores that have not reached them yet, and peers whose groups formed
        # withdraw while later chunks still form; neither may shift anyone's place.
        for d in declarations:
            if d.peer_id != self.me.peer_id:
                self.view[d.peer_id] = d
        if self.first_view == math.inf:
            # Decide on a settled view only: peers ranked before us declared before us, but
            # their stores may land after ours (hundreds of peers at once). Wait until polls
            # showed nobody new ahead of us for ``settle_time`` (later peers only append).
            rank = self.declaration.rank
            ahead = frozenset(d.peer_id for d in self.view.values() if d.rank < rank)
            if self._ahead is None or not ahead <= self._ahead:
                self._ahead, self._ahead_since = ahead, now
                if self.phase is Phase.LOOKING:
                    return []
            waiting = not confirms or now - self._ahead_since < self.settle_time
            if waiting and self.phase is Phase.LOOKING:
                return []
            self.first_view = now
        return self._reconsider(now)

    def suggested(self, now: float, declaration: Declaration) -> list[Action]:
        """A disbanding leader pointed us to ``declaration``: ask it (if we may)."""
        if declaration.peer_id == self.me.peer_id or not declaration.can_lead:
            return self._reconsider(now)
        self.view[declaration.peer_id] = declaration
        if self.phase is not Phase.LOOKING or self._refusal(now, declaration.peer_id) is not None:
            return self._reconsider(now)
        return self._ask(declaration)

    def join_request(self, now: float, member: MemberInfo) -> tuple[Refusal | None, list[Action]]:
        """A peer asks to follow this one. Returns (None, actions) if accepted, else a refusal."""
        if self.phase is Phase.JOINING:  # undecided for a moment: ask again soon
            return Refusal("joining", self.leader), []
        if self.phase is Phase.FOLLOWING:
            return Refusal("following", self.leader), []
        if self.phase not in (Phase.LOOKING, Phase.LEADING):
            return Refusal("not_looking"), []
        if not self.can_lead:
            return Refusal("not_a_leader"), []
        target = self.settings.target_group_size
        if member.peer_id in self.followers or member.peer_id == self.me.peer_id:
            return Refusal("duplicate"), []
        if target is not None and 1 + len(self.followers) >= target:
            return Refusal("full"), []
        self.followers[member.peer_id] = member
        self.last_join = now
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
        self.refused[leader] = (now, refusal.reason)
        self.leader = None
        self._move(Trigger.REFUSED)
        if refusal.reason == "following" and refusal.suggested is not None:
            # Its leader leads the group forming there: ask it rather than walk its followers.
            return self.suggested(now, refusal.suggested)
        return self._reconsider(now)

    def leader_lost(
        self, now: float, leader: PeerID, suggested: Declaration | None = None
    ) -> list[Action]:
        """The leader went away, did not answer in time, or released this follower (pointing
        it to ``suggested``)."""
        if self.leader is None or self.leader.peer_id != leader:
            return []
        if self.phase is Phase.JOINING:
            return self.join_answered(now, leader, Refusal("unreachable"))
        if self.phase is not Phase.FOLLOWING:
            return []
        self.refused[leader] = (now, "released")
        self.leader = None
        self._move(Trigger.LEADER_LOST)
        if suggested is not None:
            return self.suggested(now, suggested)
        return self._reconsider(now)

    def group_received(self, now: float, leader: PeerID) -> None:
        """The leader sent the group (the driver checked it): matchmaking is over."""
        if self.phase is not Phase.FOLLOWING or self.leader is None:
            raise LocalProtocolError(f"a group arrived while {self.phase.value}")
        if self.leader.peer_id != leader:
            raise LocalProtocolError("a group arrived from a peer this one does not follow")
        self._move(Trigger.GROUP_RECEIVED)

    def give_up(self, reason: str) -> list[Action] | None:
        """Stop looking if nobody counts on this peer yet (its caller gave up: e.g. the others
        stepped past its epoch): it is looking, or leads a group that has not begun (its
        followers are released). None, and nothing changes, once it asked a leader (which may
        be announcing a group with it right now), follows one, or its search ended: the
        search then ends by its deadline, and a group that forms runs its round."""
        if self.phase not in (Phase.LOOKING, Phase.LEADING):
            return None
        return self._fail(reason)

    def cancel(self, reason: str) -> list[Action]:
        """Stop looking (shutdown, or the driver failed); followers are released."""
        if self.phase in FINAL_PHASES:
            return []
        return self._fail(reason)

    # --- time ------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Begin as leader, look elsewhere, or give up, if it is time."""
        if self.phase is Phase.LEADING:
            size = 1 + len(self.followers)
            full = self.settings.target_group_size is not None and (
                size >= self.settings.target_group_size
            )
            due = now >= self._begin_at()
            if due and not full and self.sharded and self._chunk_size() < self._target_size():
                return self._pool(now)  # the shard's last chunk: its peers meet the others'
            if full or (due and size >= self.settings.min_group_size):
                self.members = (self.me, *self.followers.values())
                self._move(Trigger.BEGIN)
                return [Begin(self.members)]
        if now >= self.deadline and self.phase not in FINAL_PHASES:
            reason = f"no group of at least {self.settings.min_group_size} peers in time"
            return self._fail(reason, Trigger.DEADLINE)
        if self.phase is Phase.LOOKING and self._given_up_on_chunk(now):
            return self._reconsider(now)  # nobody came to us: join anyone with room
        return []

    def _fail(self, reason: str, trigger: Trigger = Trigger.CANCEL) -> list[Action]:
        actions: list[Action] = []
        if self.followers:
            actions.append(Release(tuple(self.followers), None))
            self.followers.clear()
        self.failure = reason
        self._move(trigger)
        return actions

    def next_wakeup(self, now: float) -> float:
        """When ``tick`` must run next, if nothing else happens before."""
        if self.phase in FINAL_PHASES:
            return math.inf
        if self.phase is Phase.LEADING:  # past its begin time it waits for followers (events)
            begin = self._begin_at()
            return min(begin if begin > now else self.deadline, self.deadline)
        if self.phase is Phase.LOOKING and not self._given_up_on_chunk(now):
            return min(self._settled(), self.deadline)
        if self.phase is Phase.LOOKING:  # looking anywhere: retry as refusals wear off
            return min(now + self.settings.request_timeout, self.deadline)
        return self.deadline

"""Matchmaking as a pure state machine: which peers average together, and in what order.

Holds the ``Matchmaker`` (a sans-I/O core in the style of h11: ``Phase`` enum, transition table,
every method takes ``now`` and returns the actions its driver must carry out). The data it
decides on (``Declaration``, ``MemberInfo``, the actions) is in ``kit.averaging.declarations``;
what its search saw and what that says (whom to ask, when to begin) in ``kit.averaging.search``.
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
* Views differ while stores land: a peer decides once polls agree on the peers ranked before
  it (before its chunk's leader, for a peer that cannot lead). A full leader begins only once
  its own view agreed, and points a follower that its view puts in another chunk to that
  chunk's leader (once: one that comes back is taken).
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

from kit.averaging.chunking import chunk_leader, settle_horizon, unreachable
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
from kit.averaging.search import Search
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


class Matchmaker(Search):
    """One peer's search for a group, from ``start`` to ASSEMBLED or FAILED. Pure: no I/O.

    Times are DHT times (wall clock shared by peers), passed in as ``now``. ``sharded``: it
    declares under one of several shard keys and moves to the pool key if its chunk there
    cannot fill (see the module; needs a target_group_size).
    """

    def __init__(
        self, me: MemberInfo, settings: MatchmakingSettings, *, sharded: bool = False
    ) -> None:
        super().__init__(me, settings)
        self.sharded = sharded and settings.target_group_size is not None
        self.phase = Phase.IDLE
        self.leader: Declaration | None = None  # who it joins or follows
        self._ahead: frozenset[PeerID] | None = None  # who ranks before us, as polled
        self._ahead_since = math.inf  # when a poll last showed someone new ahead of us
        self.invited: set[PeerID] = set()  # chunk-mates told which peers are gone
        self.members: tuple[MemberInfo, ...] | None = None  # set when it begins as leader
        self.failure = ""  # why it failed

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

    # --- choosing a leader (whom: ``Search``) --------------------------------------------------

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
            return self._misplaced() + self._invitations()
        return []

    def _reconsider_in_shard(self, now: float) -> list[Action]:
        """A sharded search looks in its own chunk only; what cannot form there goes to the
        pool (not to other chunks of the shard: those fill with their own peers)."""
        cut, mine = self._cut()
        if self._deferred(cut, now):
            return []
        chunk, given_up = cut.chunks[mine], self._given_up_on_chunk(now)
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
        self.grew = self.polled = math.inf
        self.started, self.last_join = now, -math.inf
        self.expiration = min(now + self.settings.min_matchmaking_time, self.deadline)
        actions.append(Pool(self.declaration))
        return actions

    def _misplaced(self) -> list[Action]:
        """Followers that joined before this leader's view settled and belong to another chunk:
        pointed to its leader (``_their_leader``)."""
        actions: list[Action] = []
        for peer_id in list(self.followers):
            elsewhere = self._their_leader(peer_id)
            if elsewhere is not None:
                del self.followers[peer_id]
                actions.append(Release((peer_id,), elsewhere, "misplaced"))
        if actions and not self.followers:
            self._move(Trigger.LAST_FOLLOWER_LEFT)
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
        self.polled = now
        for d in declarations:
            if d.peer_id != self.me.peer_id:
                if d.peer_id not in self.view:
                    self.grew = now
                self.view[d.peer_id] = d
        # Decide on a settled view only: peers ranked before us declared before us, but their
        # stores may land after ours (hundreds of peers at once). Wait until polls showed nobody
        # new up to our horizon (``chunking.settle_horizon``) for ``settle_time``. A leader
        # waits too: disbanding for a "better leader" that a partial view puts in its chunk
        # would hand its followers to another chunk's group. A peer that cannot lead waits like
        # this for every choice of a leader, not only its first: one it has not seen may show.
        settling = not self.can_lead and self.phase is Phase.LOOKING
        if self.first_view == math.inf or settling:
            horizon = self.declaration.rank
            if not self.can_lead:
                cut, mine = self._cut()
                horizon = settle_horizon(cut.chunks[mine], self.declaration, self.can_lead)
            ahead = frozenset(d.peer_id for d in self.view.values() if d.rank <= horizon)
            deciding = self.phase in (Phase.LOOKING, Phase.LEADING)
            if self._ahead is None or not ahead <= self._ahead:
                self._ahead, self._ahead_since = ahead, now
                if deciding:
                    return []
            waiting = not confirms or now - self._ahead_since < self.settle_time
            if waiting and deciding:
                return []
            self.first_view = min(self.first_view, now)
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
        elsewhere = self._their_leader(member.peer_id)
        if elsewhere is not None:
            return Refusal("misplaced", elsewhere), []
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
        if refusal.reason in ("following", "misplaced") and refusal.suggested is not None:
            # Its leader leads the group forming there: ask it rather than walk its followers.
            return self.suggested(now, refusal.suggested)
        return self._reconsider(now)

    def leader_lost(
        self,
        now: float,
        leader: PeerID,
        suggested: Declaration | None = None,
        reason: str = "released",
    ) -> list[Action]:
        """The leader went away, did not answer in time, or released this follower (pointing
        it to ``suggested``; ``reason``: the ``Release``'s)."""
        if self.leader is None or self.leader.peer_id != leader:
            return []
        if self.phase is Phase.JOINING:
            return self.join_answered(now, leader, Refusal("unreachable"))
        if self.phase is not Phase.FOLLOWING:
            return []
        # A leader that put us in another chunk's group may take us back; any other release
        # (whatever the wire says) holds for a request_timeout.
        self.refused[leader] = (now, "misplaced" if reason == "misplaced" else "released")
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
            due = now >= self._begin_at()
            # Full, it begins at once, but not before its view settled: followers that asked
            # on a partial view of their own may belong to another chunk (``_misplaced``).
            full = (
                self.settings.target_group_size is not None
                and size >= self.settings.target_group_size
                and (self.first_view < math.inf or due)
            )
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

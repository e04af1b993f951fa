"""What one peer's search for a group saw of the DHT, and what that says. Pure.

Holds ``Search``, the base of the ``Matchmaker`` (``kit.averaging.matchmaking``): the search's
view of its group key (every declaration it saw, who refused it), when that view settled, and
the queries the state machine decides with: the view cut into chunks (``kit.averaging.chunking``),
whom to ask, which follower belongs to another chunk, when a leader begins. It changes no phase
and takes no action (the ``Matchmaker`` does), and holds no I/O.
"""

from __future__ import annotations

import math

from kit.averaging.chunking import (
    Cut,
    chunk_target,
    ranked_chunks,
    standing_refusal,
    their_leader,
    unreachable,
)
from kit.averaging.declarations import Declaration, MatchmakingSettings, MemberInfo
from kit.p2p.identity import PeerID


class Search:
    """What one search saw and decides with. Times are DHT times, passed in as ``now``."""

    def __init__(self, me: MemberInfo, settings: MatchmakingSettings) -> None:
        self.me = me
        self.settings = settings
        self.expiration = math.inf  # when this peer begins as a leader at the latest
        self.deadline = math.inf  # when it gives up
        self.started = math.inf  # when it began looking
        self.last_join = -math.inf  # when its latest follower joined
        self.followers: dict[PeerID, MemberInfo] = {}  # in join order
        self.view: dict[PeerID, Declaration] = {}  # every other peer this search saw declared
        self.first_view = math.inf  # when a poll first showed a settled view (see observe)
        self.grew = math.inf  # when a poll last showed a peer new to the view
        self.polled = math.inf  # when the latest poll came
        self.settle_time = 0.0  # how long views must not change before we decide (the driver's)
        self.redirected: set[PeerID] = set()  # peers pointed to the leader of their own chunk
        self.refused: dict[PeerID, tuple[float, str]] = {}  # who refused us, when and why

    @property
    def can_lead(self) -> bool:
        return not self.me.client_mode

    @property
    def declaration(self) -> Declaration:
        return Declaration(self.me.peer_id, self.expiration, self.me.addresses)

    def _cut(self) -> tuple[Cut, int]:
        """This search's view cut into chunks (see ``kit.averaging.chunking``), and our index."""
        gone = unreachable(self.refused)
        size = self.settings.target_group_size
        return ranked_chunks(self.view.values(), self.declaration, gone, size)

    def _chunks(self) -> tuple[list[list[Declaration]], int]:
        cut, mine = self._cut()
        return cut.chunks, mine

    def _refusal(self, now: float, peer_id: PeerID) -> str | None:
        """Why ``peer_id`` refused us, if that still holds (None: ask it)."""
        refused = self.refused.get(peer_id)
        return standing_refusal(refused, now, self.settings.request_timeout)

    def _settled(self) -> float:
        """When the others had time to find this peer: its expiration, but never less than a
        request_timeout after its first view of the DHT (when stores and polls are slow, e.g.
        hundreds of peers on one CPU, the expiration may pass before anyone saw anyone)."""
        seen = self.first_view + self.settings.request_timeout
        return max(self.expiration, min(seen, self.deadline - self.settings.request_timeout))

    def _given_up_on_chunk(self, now: float) -> bool:
        """Nobody came to this peer although it had time to be found: look anywhere."""
        return now >= self._settled()

    def _deferred(self, cut: Cut, now: float) -> bool:
        """Whether this peer is a leader that ``cut`` deferred to its end (``Cut.deferred``) and
        must wait for its place: while polls still show new peers, and until it gives up on its
        chunk, more peers may come and need it to begin a chunk of theirs."""
        if self.me.peer_id not in cut.deferred or self._given_up_on_chunk(now):
            return False
        return self.grew == self.polled or self.polled - self.grew < self.settle_time

    def _target(self, now: float, anywhere: bool) -> Declaration | None:
        """Whom to ask (see ``chunking.chunk_target``); None: lead (or wait).

        A leader deferred to the end of the cut waits (``_deferred``), then takes its place
        there; having given up on its chunk, it looks anywhere only a request_timeout later."""
        cut, mine = self._cut()
        if self._deferred(cut, now):
            return None
        if self.me.peer_id in cut.deferred:
            anywhere = now >= self._settled() + self.settings.request_timeout
        return chunk_target(
            cut.chunks,
            mine,
            self.me.peer_id,
            can_lead=self.can_lead,
            anywhere=anywhere,
            min_group_size=self.settings.min_group_size,
            refusal=lambda peer_id: self._refusal(now, peer_id),
        )

    def _their_leader(self, peer_id: PeerID) -> Declaration | None:
        """The leader to point ``peer_id`` to (``chunking.their_leader``), once: a peer pointed
        away and back (that leader was full, or had begun) stays. None: keep it."""
        if self.first_view == math.inf or peer_id in self.redirected or peer_id not in self.view:
            return None
        leader = their_leader(*self._chunks(), peer_id)
        if leader is not None:
            self.redirected.add(peer_id)
        return leader

    def _begin_at(self) -> float:
        """A leader begins with the followers it has (at least min_group_size) at this time;
        later if peers of its chunk (as it sees it) have not joined yet: they may still be
        deciding (their stores landed late, so their views settled late). It then waits twice
        as long as its own view took to settle (views settle at times spread about that much:
        hundreds of peers sharing one loaded CPU settled from 20 to 90 s, and leaders that
        waited a fixed time split their chunks in two), and a request_timeout after the latest
        follower joined."""
        begin = self._settled()
        if self.first_view == math.inf:
            return begin
        timeout = self.settings.request_timeout
        latest = self.deadline - timeout
        cut, mine = self._cut()
        chunk = cut.chunks[mine]
        if 1 + len(self.followers) < len(chunk):
            waited = max(2 * timeout, 2 * (self.first_view - self.started))
            patient = max(self.first_view + waited, self.last_join + timeout)
            begin = max(begin, min(patient, latest))
            # Leaders the cut deferred to this chunk come once they gave up on being needed
            # further up (``_deferred``): at their expiration, or a little later.
            late = [
                d.expiration for d in chunk if d.peer_id in cut.deferred - self.followers.keys()
            ]
            if late and self.me.peer_id not in cut.deferred:
                begin = max(begin, min(max(late) + timeout, latest))
        return begin

    def _chunk_size(self) -> int:
        chunks, mine = self._chunks()
        return len(chunks[mine])

    def _target_size(self) -> int:
        return self.settings.target_group_size or 0

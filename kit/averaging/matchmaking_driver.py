"""The async side of matchmaking: DHT declarations and join streams.

Holds ``MatchmakingDriver``: it runs the pure ``Matchmaker`` of ``kit.averaging.matchmaking``:
publishes and polls declarations in the DHT (``kit.averaging.declaration_board``), asks leaders
on ``kit/averaging/join/1`` streams, answers followers, and, as a leader, solves the
load-balancing LP and announces the group. It does not decide anything itself: every decision is
the state machine's. The streams peers open to it reach it through ``kit.averaging.router`` (one
per peer, several averagers share it).

A follower's join stream stays open until the leader sends the group (or releases it): a follower
that goes away is noticed by the leader at once, and a leader that goes away by its followers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kit.averaging.allreduce import cancel_and_wait
from kit.averaging.balancing import load_balance_peers, preload_solver
from kit.averaging.declaration_board import DeclarationBoard
from kit.averaging.declarations import (
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
from kit.averaging.grid import (
    coordinate,
    coordinate_bits,
    coordinate_to_bits,
    next_power_of_two,
    rotated_bits,
)
from kit.averaging.group import (
    GROUP_ID_BYTES,
    MAX_MESSAGE,
    GroupInfo,
    decode_leader_message,
    encode_answer,
    encode_begin,
    encode_invite,
    encode_join_request,
    encode_release,
)
from kit.averaging.matchmaking import FINAL_PHASES, Matchmaker, Phase
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import KitTimeout, PeerError, RemoteProtocolError
from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

#: (bandwidths of the members, None where not measured; part sizes) -> chunk scale
ChunkScale = Callable[[Sequence[float | None], Sequence[int]], int]

JOIN_PROTOCOL = "kit/averaging/join/1"
INVITE_PROTOCOL = "kit/averaging/invite/1"


class MatchmakingDriver:
    """Finds groups for one averager: one ``find_group`` at a time."""

    def __init__(
        self,
        node: DHTNode,
        prefix: str,
        settings: MatchmakingSettings,
        schema: bytes,
        total_size: int,
        *,
        group_bits: str = "",
        min_vector_size: int = 0,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        chunk_scale: ChunkScale | None = None,
    ) -> None:
        """``chunk_scale(bandwidths, part_sizes)``: how much larger than the schema's the
        chunks of a group this peer leads are (``partition.chunk_scale``); None: never."""
        self.chunk_scale = chunk_scale
        self.node, self.peer = node, node.peer
        self.prefix, self.settings, self.schema = prefix, settings, schema
        self.total_size, self.group_bits, self.min_vector_size = (
            total_size,
            group_bits,
            min_vector_size,
        )
        self._matchmaker: Matchmaker | None = None
        self._outcomes: dict[Any, asyncio.Future[bytes]] = {}  # follower -> begin/release message
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wakeup = asyncio.Event()
        self._group: GroupInfo | None = None
        # Shard keys of the next search (1: the group key alone); see kit.averaging.matchmaking.
        self.shards = 1
        self._searching: list[asyncio.Task[Any]] = []  # the current key's declare and poll
        # Our declaration under the key of the current (or last) search; its tombstones are
        # spawned by the averager's task owner, as they outlive one search.
        self.board = DeclarationBoard(node, prefix, settings, self.group_key, spawn)

    @property
    def group_key(self) -> str:
        """The DHT key of this averager's group (hivemind's ``{prefix}.0b{bits}``)."""
        return f"{self.prefix}.0b{self.group_bits}"

    def shard_key(self, peer_id: PeerID) -> str:
        """Where ``peer_id`` declares first: the group key, or one of its ``shards`` shards
        (by a hash of the id: the same for every peer that computes it)."""
        if self.shards <= 1:
            return self.group_key
        digest = hashlib.sha256(self.group_key.encode() + peer_id.to_bytes()).digest()
        shard = int.from_bytes(digest[:8], "big") % self.shards
        return f"{self.group_key}.shard{shard}of{self.shards}"

    @property
    def followers(self) -> tuple[PeerID, ...]:
        """The peers following this one right now (while it leads a forming group)."""
        matchmaker = self._matchmaker
        return tuple(matchmaker.followers) if matchmaker is not None else ()

    @property
    def phase(self) -> Phase:
        return self._matchmaker.phase if self._matchmaker is not None else Phase.IDLE

    async def find_group(
        self, me: MemberInfo, deadline: float, scheduled_time: float | None = None
    ) -> GroupInfo | None:
        """Look for a group until ``deadline`` (DHT time); None if none formed in time.

        ``scheduled_time`` (DHT time): as a leader, begin then at the latest (see ``Matchmaker``).

        After a group's round, call :meth:`withdraw_after_round` (its declaration stays in the
        DHT till then, so no DHT store competes with the all-reduce for the links)."""
        sharded = self.shards > 1
        matchmaker = self._matchmaker = Matchmaker(me, self.settings, sharded=sharded)
        self._group = None
        self.board.move_to(self.shard_key(me.peer_id))
        declaration = matchmaker.start(get_dht_time(), deadline, scheduled_time)
        if matchmaker.can_lead:
            preload_solver()  # this peer may lead: its LP must not wait for scipy's import
        self._search_under_key(matchmaker, declaration)
        try:
            while True:
                self._execute(matchmaker.tick(get_dht_time()))
                if matchmaker.phase in FINAL_PHASES:
                    break
                self._wakeup.clear()
                now = get_dht_time()
                delay = matchmaker.next_wakeup(now) - now
                try:
                    await asyncio.wait_for(self._wakeup.wait(), max(delay, 0.0) + 1e-3)
                except asyncio.TimeoutError:
                    pass
            if matchmaker.phase is Phase.FAILED:
                logger.info("%s: no group (%s)", self.prefix, matchmaker.failure)
            if matchmaker.phase is Phase.ASSEMBLED and self._group is not None:
                self._move_on_grid(self._group, me.peer_id)
                return self._group
            return None
        finally:
            assembled = matchmaker.phase is Phase.ASSEMBLED and self._group is not None
            self._execute(matchmaker.cancel("the search ended"))
            self._matchmaker = None
            await cancel_and_wait(list(self._tasks), 1.0)
            if assembled:
                # Not now: the all-reduce is about to fill every link to the other members, and
                # a DHT store queued behind its chunks times out (seen on 100 Mbit/s links: 3-6
                # s, every member then marked failed, and the next round's polls saw half the
                # declarations for ~4 s). The averager calls withdraw_after_round(); till then
                # a peer that asks us is refused (not_looking), and most often the
                # declaration has expired by the round's end anyway (DeclarationBoard.declare).
                self.board.hold_for_round()
            else:
                self.board.withdraw_now()

    def give_up_if_unpromised(self, reason: str) -> bool:
        """Stop the current search if nobody counts on this peer yet (``Matchmaker.give_up``).
        On the loop, so that no group begins between the check and the cancellation."""
        matchmaker = self._matchmaker
        actions = matchmaker.give_up(reason) if matchmaker is not None else None
        if actions is None:
            return False
        self._execute(actions)
        return True

    def _search_under_key(self, matchmaker: Matchmaker, declaration: Declaration) -> None:
        """Declare under the board's key and poll it (the first poll waits for our store)."""
        declared = asyncio.Event()
        self._searching = [
            self._spawn(self.board.declare(matchmaker, declaration, declared)),
            self._spawn(self.board.poll(matchmaker, declared, self._execute)),
        ]

    def _to_pool(self, pool: Pool) -> None:
        """The shard's chunk cannot fill: withdraw there, look under the group key."""
        matchmaker = self._matchmaker
        assert matchmaker is not None
        for task in self._searching:
            task.cancel()
        self.board.withdraw_now()
        logger.debug("%s: to the pool from %s", self.prefix, self.board.key)
        self.board.move_to(self.group_key)
        self._search_under_key(matchmaker, pool.declaration)

    def _move_on_grid(self, group: GroupInfo, me: PeerID) -> None:
        """Moshpit (hivemind's ``update_key_on_group_assembled``): with group bits, this peer's
        place in its group becomes the newest coordinate of its key (``kit.averaging.grid``),
        so that the next round averages with other groups, one member of each."""
        if not self.group_bits:
            return
        buckets = self.settings.target_group_size or next_power_of_two(len(group))
        buckets = max(buckets, len(group))
        new = coordinate(group.group_id, group.peers, me, buckets)
        chunk = coordinate_to_bits(new, coordinate_bits(buckets))
        self.group_bits = rotated_bits(self.group_bits, chunk)

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    def _wake(self) -> None:
        self._wakeup.set()

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, AskLeader):
                assert self._matchmaker is not None
                logger.debug(
                    "%s: asking %s to lead us (%d peers in view)",
                    self.prefix,
                    action.declaration.peer_id.short(),
                    len(self._matchmaker.view),
                )
                self._spawn(self._join(self._matchmaker, action.declaration))
            elif isinstance(action, Release):
                message = encode_release(action.suggested, action.reason)
                for follower in action.followers:
                    outcome = self._outcomes.get(follower)
                    if outcome is not None and not outcome.done():
                        outcome.set_result(message)
            elif isinstance(action, Invite):
                self._spawn(self._invite(action))
            elif isinstance(action, Pool):
                self._to_pool(action)
            elif isinstance(action, Begin):
                logger.debug("%s: leading a group of %d", self.prefix, len(action.members))
                self._group = self._assemble(action)
                message = encode_begin(self._group)
                for member in action.members[1:]:
                    outcome = self._outcomes.get(member.peer_id)
                    if outcome is not None and not outcome.done():
                        outcome.set_result(message)
        self._wake()  # every state change may move the next wakeup (e.g. LOOKING -> LEADING)

    def _assemble(self, begin: Begin) -> GroupInfo:
        """The leader's part: split the vector by the LP (DeDLOC) and number the round."""
        members = begin.members
        clients = [m.client_mode for m in members]
        bandwidths = [
            None if m.client_mode or not m.bandwidth else m.bandwidth for m in members
        ]  # 0 from a non-client means "unknown" here, not "client"
        part_sizes = load_balance_peers(
            self.total_size,
            [0.0 if client else b for client, b in zip(clients, bandwidths, strict=True)],
            self.min_vector_size,
            client_mode=clients,
            auxiliary=[m.auxiliary for m in members],
        )
        group_id = os.urandom(GROUP_ID_BYTES)
        measured = [m.bandwidth or None for m in members]  # clients' links count here too
        scale = 1 if self.chunk_scale is None else self.chunk_scale(measured, part_sizes)
        return GroupInfo.assemble(group_id, self.schema, members, part_sizes, scale)

    def withdraw_after_round(self) -> None:
        """The round of the last group found is over: withdraw its declaration if still live."""
        self.board.withdraw_after_round()

    # --- invitations -------------------------------------------------------------------------

    async def _invite(self, invite: Invite) -> None:
        matchmaker = self._matchmaker
        if matchmaker is None:
            return
        peer_id = invite.peer.peer_id
        for address in invite.peer.addresses:
            self.peer.add_address(peer_id, address)
        request = encode_invite(self.prefix, self.board.key, matchmaker.declaration, invite.gone)
        try:
            await self.peer.call(
                peer_id, INVITE_PROTOCOL, request, timeout=self.settings.request_timeout
            )
        except (PeerError, KitTimeout) as e:
            logger.debug("%s: inviting %s failed: %s", self.prefix, peer_id.short(), e)

    def invited(self, group_key: str, inviter: Declaration, gone: list[PeerID]) -> None:
        """A leader of our chunk says these peers ahead of us are gone."""
        matchmaker = self._matchmaker
        if matchmaker is None or group_key != self.board.key:
            return
        self._execute(matchmaker.invited_by(get_dht_time(), inviter, gone))

    # --- join streams ------------------------------------------------------------------------

    async def _join(self, matchmaker: Matchmaker, leader: Declaration) -> None:
        """Follower side: ask ``leader``, then wait on the same stream for the group."""
        leader_id, timeout = leader.peer_id, self.settings.request_timeout
        for address in leader.addresses:
            self.peer.add_address(leader_id, address)
        stream: StreamAPI | None = None
        assembled = False
        try:
            stream = await self.peer.open_stream(leader_id, JOIN_PROTOCOL, timeout=timeout)
            request = encode_join_request(self.prefix, self.board.key, self.schema, matchmaker.me)
            await stream.send_message(request, timeout=timeout)
            code, refusal, _ = await self._leader_message(stream, timeout)
            if code != "accepted":
                self._execute(matchmaker.join_answered(get_dht_time(), leader_id, refusal))
                return
            self._execute(matchmaker.join_answered(get_dht_time(), leader_id, None))
            waiting = max(matchmaker.deadline - get_dht_time(), 0.0) + timeout
            code, refusal, body = await self._leader_message(stream, waiting)
            if code == "begin" and matchmaker.phase is not Phase.FOLLOWING:
                return  # too late: this peer gave up (deadline or shutdown) in the meantime
            if code == "begin":
                self._group = GroupInfo.from_wire(
                    body,
                    leader=leader_id,
                    me=matchmaker.me,
                    schema=self.schema,
                    total_size=self.total_size,
                )
                matchmaker.group_received(get_dht_time(), leader_id)
                assembled = True
                self._wake()
                return
            released = refusal or Refusal("released")
            lost = matchmaker.leader_lost(
                get_dht_time(), leader_id, released.suggested, released.reason
            )
            self._execute(lost)
        except (PeerError, KitTimeout) as e:
            logger.debug("%s: leader %s lost: %s", self.prefix, leader_id.short(), e)
            self._execute(matchmaker.leader_lost(get_dht_time(), leader_id))
        finally:
            if stream is not None and not assembled:
                stream.reset("cancelled", "left the group")
            elif stream is not None:
                await stream.close()
            self._wake()

    @staticmethod
    async def _leader_message(stream: StreamAPI, timeout: float) -> tuple[str, Refusal | None, Any]:
        raw = await stream.receive_message(max_size=MAX_MESSAGE, timeout=timeout)
        if raw is None:
            raise RemoteProtocolError("the leader closed the join stream")
        return decode_leader_message(raw)

    async def serve_join(
        self, stream: StreamAPI, group_key: str, schema: bytes, member: MemberInfo
    ) -> None:
        """Leader side of a join stream: answer, then hold it until the group begins or not."""
        matchmaker, timeout = self._matchmaker, self.settings.request_timeout
        refusal: Refusal | None = Refusal("not_looking")
        actions: list[Action] = []
        if matchmaker is not None and schema != self.schema:
            refusal = Refusal("bad_schema")
        elif matchmaker is not None and group_key != self.board.key:
            refusal = Refusal("bad_group_key")
        elif matchmaker is not None:
            refusal, actions = matchmaker.join_request(get_dht_time(), member)
        if refusal is not None or matchmaker is None:
            await stream.send_message(encode_answer(refusal), timeout=timeout)
            return
        outcome = self._outcomes[member.peer_id] = asyncio.get_running_loop().create_future()
        leaving: asyncio.Future[Any] | None = None
        try:
            self._execute(actions)  # may begin the group at once: then outcome is set already
            await stream.send_message(encode_answer(None), timeout=timeout)
            remaining = max(matchmaker.deadline - get_dht_time(), 0.0) + timeout
            leaving = asyncio.ensure_future(stream.receive_message(max_size=16, timeout=remaining))
            await asyncio.wait({outcome, leaving}, timeout=remaining, return_when="FIRST_COMPLETED")
            if outcome.done():
                await stream.send_message(outcome.result(), timeout=timeout)
        finally:
            if leaving is not None:
                leaving.cancel()
                leaving.add_done_callback(_retrieve)
            if self._outcomes.get(member.peer_id) is outcome:
                del self._outcomes[member.peer_id]
            if not outcome.done():
                outcome.cancel()
                self._execute(matchmaker.follower_left(get_dht_time(), member.peer_id))
                self._wake()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # the follower's stream ending is expected: do not log it


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("matchmaking task failed: %r", task.exception())

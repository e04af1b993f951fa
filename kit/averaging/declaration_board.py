"""One averager's declaration in the DHT while it looks for a group, and the polls that read
everyone else's.

Holds :class:`DeclarationBoard`: the key this averager declares under (its group key, or a
shard of it), the declaration stored there and renewed while the search lasts (short-lived, so
a crashed peer soon drops out of everyone's view), withdrawn as a tombstone when the search ends
(after the round, for a group that formed: no DHT store competes with the all-reduce), and the
polls of the key, paced by their own latency, whose declarations the ``Matchmaker`` observes.

Separate from ``matchmaking_driver`` (the search: the state machine's actions, join streams,
invitations) because it is the DHT's side alone: stores and reads of one key, their timing, and
nothing of groups but what the state machine is told.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from kit.averaging.declarations import Action, Declaration, MatchmakingSettings
from kit.averaging.matchmaking import FINAL_PHASES, Matchmaker, Phase
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import KitError

logger = logging.getLogger(__name__)

POLL_REPLICAS = 2  # DHT nodes a poll reads the declarations from (each returns all of them)
POLL_DELAYS = (
    0.0,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.4,
)  # DHT polls while looking, then the last


class DeclarationBoard:
    """This averager's declaration under ``key`` (``spawn``: the averager's task owner; a
    tombstone outlives one search)."""

    def __init__(
        self,
        node: DHTNode,
        prefix: str,
        settings: MatchmakingSettings,
        key: str,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
    ) -> None:
        self.node, self.peer = node, node.peer
        self.prefix, self.settings = prefix, settings
        self._spawn_owned = spawn
        self.key = key  # the key of the current (or last) search
        self.until = 0.0  # DHT time our declaration under ``key`` lives until
        self._pending_withdrawal = 0.0  # declared until then; withdrawn once the round ends

    def move_to(self, key: str) -> None:
        """Declare under ``key`` from now on (nothing of ours is there yet)."""
        self.key, self.until = key, 0.0

    def withdraw_now(self) -> None:
        """Replace our declaration under ``key`` by a tombstone (in the background)."""
        self._spawn_owned(self._withdraw(self.key, self.until))

    def hold_for_round(self) -> None:
        """A group formed: keep the declaration until :meth:`withdraw_after_round`."""
        self._pending_withdrawal = self.until

    async def declare(
        self, matchmaker: Matchmaker, declaration: Declaration, declared: asyncio.Event
    ) -> None:
        """Keep this peer's declaration in the DHT while it looks (hivemind re-declares too).

        Each store lives ``period`` (at least min_matchmaking_time) and is renewed well before
        it expires: at least two store latencies before (seen at 128 in-process peers: stores of
        2 s, and renewals that landed after the expiry, so polls saw an empty key). Short-lived
        declarations matter: a peer that crashed keeps its place in everyone's ranked list (and
        in a chunk) until its declaration expires.
        """
        loop = asyncio.get_running_loop()
        key, subkey = self.key, self.peer.peer_id.to_bytes()
        base = max(self.settings.min_matchmaking_time, 2 * self.settings.request_timeout)
        latency = 0.0
        while matchmaker.phase not in FINAL_PHASES:
            period = max(base, 4 * latency)
            until = min(get_dht_time() + period, matchmaker.deadline)
            began = loop.time()
            try:
                await self.node.store(key, declaration.to_value(), until, subkey=subkey)
                self.until = max(self.until, until)
            except KitError as e:
                logger.info("%s: declaring in the DHT failed: %s", self.prefix, e)
            latency = loop.time() - began
            if not declared.is_set():  # the others' stores take about as long as ours
                matchmaker.settle_time = min(latency, self.settings.request_timeout) / 2
            declared.set()
            renew_in = until - get_dht_time() - max(period / 2, 2 * latency)
            await asyncio.sleep(max(renew_in, self.settings.request_timeout / 4))

    def withdraw_after_round(self) -> None:
        """The round of the last group found is over: withdraw its declaration if still live."""
        declared_until, self._pending_withdrawal = self._pending_withdrawal, 0.0
        if declared_until > get_dht_time():
            self._spawn_owned(self._withdraw(self.key, declared_until))

    async def _withdraw(self, key: str, declared_until: float) -> None:
        """Replace the declaration by a tombstone, so nobody asks a peer that stopped looking."""
        if declared_until <= get_dht_time():
            return
        subkey = self.peer.peer_id.to_bytes()
        try:
            await self.node.store(key, None, declared_until + 1e-3, subkey=subkey)
        except KitError as e:
            logger.debug("%s: withdrawing from the DHT failed: %s", self.prefix, e)

    async def poll(
        self,
        matchmaker: Matchmaker,
        declared: asyncio.Event,
        execute: Callable[[list[Action]], None],
    ) -> None:
        """Read the key's declarations while ``matchmaker`` looks or leads, and ``execute`` what
        it makes of them (the first read waits for our own store: see :meth:`declare`)."""
        first = asyncio.ensure_future(declared.wait())  # then every peer that declared
        try:  # before us has (most likely) declared too
            await asyncio.wait({first}, timeout=max(0.0, matchmaker.deadline - get_dht_time()))
        finally:
            first.cancel()
        loop, latency = asyncio.get_running_loop(), 0.0
        for attempt in itertools.count():
            # As long as the last poll took, at least: a peer spends at most half its time
            # polling, and when hundreds of peers share a CPU (in-process swarms, tests) their
            # polls slow down together instead of starving everything else of the loop.
            delay = max(POLL_DELAYS[min(attempt, len(POLL_DELAYS) - 1)], latency)
            if matchmaker.first_view < math.inf:  # decided: polls only watch for corrections
                delay = max(delay, self.settings.request_timeout / 2)
            await asyncio.sleep(delay)
            if matchmaker.phase in FINAL_PHASES:
                return
            if matchmaker.phase not in (Phase.LOOKING, Phase.LEADING):
                continue
            try:
                # A slow poll is still worth its answer (the search's own end cancels it).
                patience = max(self.settings.request_timeout, matchmaker.deadline - get_dht_time())
                began = loop.time()
                found = await asyncio.wait_for(
                    self.node.get(self.key, latest=True, replicas=POLL_REPLICAS),
                    patience,
                )
                latency = loop.time() - began
            except (KitError, asyncio.TimeoutError) as e:
                logger.debug("%s: reading the group key failed: %r", self.prefix, e)
                continue
            now = get_dht_time()
            declarations = Declaration.parse_entries(found.value if found else None, now)
            me = self.peer.peer_id
            confirms = any(d.peer_id == me for d in declarations)  # else: lagging replicas
            execute(matchmaker.observe(now, declarations, confirms=confirms))

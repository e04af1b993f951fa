"""Which round an incoming all-reduce stream belongs to: one averager's rounds, as it serves them.

Holds :class:`ServedRounds`: the rounds of one averager that are running (their
``AllReduceRunner``), the groups found that wait for the step's trigger
(``allow_allreduce``), and the round ids finished lately. :meth:`ServedRounds.runner_for` finds
the runner of a stream's round, waiting when the round has not begun here yet: a sender learns
its group a moment before some members do (the leader tells them one by one), so its stream may
arrive first. The wait is bounded: ``request_timeout`` for the round to begin, renewed while the
round is ours and waits for its trigger (the sender goes on without us past its
``sender_timeout`` anyway); at most ``MAX_WAITING_STREAMS`` streams wait at once. A stream of a
round that ended here, or never was ours, is refused at once.

Separate from ``async_averager`` (one averager's steps: search, trigger, all-reduce, retries)
because it is the serving side of the rounds, driven by the remote peers' streams rather than by
this peer's steps; the two meet only where a round begins and ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator

from kit.averaging.allreduce import AllReduceRunner
from kit.averaging.group import MAX_GROUP_SIZE
from kit.errors import RemoteProtocolError

MAX_WAITING_STREAMS = MAX_GROUP_SIZE  # all-reduce streams that came before their round began here
RECENT_ROUNDS = 32  # finished round ids remembered, to refuse their late streams at once


class ServedRounds:
    """One averager's rounds as its all-reduce streams find them (``request_timeout``: how long a
    stream waits for its round to begin here)."""

    def __init__(self, request_timeout: float) -> None:
        self.request_timeout = request_timeout
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._awaiting: set[bytes] = set()  # groups found, waiting for the caller's trigger
        self._finished: collections.deque[bytes] = collections.deque(maxlen=RECENT_ROUNDS)
        self._registered = asyncio.Event()
        self._waiting_streams = 0

    @contextlib.contextmanager
    def awaiting_trigger(self, group_id: bytes) -> Iterator[None]:
        """While inside, round ``group_id`` is ours and waits for its trigger: its streams wait."""
        self._awaiting.add(group_id)
        try:
            yield
        finally:
            self._awaiting.discard(group_id)

    @contextlib.contextmanager
    def running(self, group_id: bytes, runner: AllReduceRunner) -> Iterator[None]:
        """While inside, ``runner`` serves round ``group_id``'s streams; then the round is over."""
        self._runners[group_id] = runner
        registered, self._registered = self._registered, asyncio.Event()
        registered.set()
        try:
            yield
        finally:
            del self._runners[group_id]
            self._finished.append(group_id)

    async def runner_for(self, group_id: bytes) -> AllReduceRunner:
        """The runner of round ``group_id``, once it runs here (bounded wait, see above).

        Raises:
            RemoteProtocolError: the round is over, never was ours, or did not begin in time;
                or too many streams wait for unknown rounds.
        """
        runner = self._runners.get(group_id)
        if runner is None and group_id not in self._finished:
            if self._waiting_streams >= MAX_WAITING_STREAMS:
                raise RemoteProtocolError("too many all-reduce streams for unknown rounds")
            self._waiting_streams += 1  # the sender got the group a moment before we did
            try:
                loop = asyncio.get_running_loop()
                give_up = loop.time() + self.request_timeout
                while runner is None:
                    if group_id in self._awaiting:  # ours, waiting for its trigger (bounded)
                        give_up = loop.time() + self.request_timeout
                    left = give_up - loop.time()
                    if left <= 0:
                        break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._registered.wait(), left)
                    runner = self._runners.get(group_id)
            finally:
                self._waiting_streams -= 1
        if runner is None:
            raise RemoteProtocolError(f"no round {group_id.hex()[:16]} here (over, or never ours)")
        return runner

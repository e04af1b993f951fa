"""The tasks and the clock of one all-reduce round: owned, bounded, stopped together.

Holds ``Timeouts`` (how long each side of a round waits for the other) and ``RoundTasks``: every
task a round starts is spawned here and owned (cancelled, and waited for a bounded second, when
the round ends); every wait of the round is bounded by ``remaining`` (the round's deadline,
``allreduce_timeout``, cuts each side's own timeout short); ``cancel_others`` stops them all at
once when the round is aborted or broken; and the marks of the round's debug timeline (when each
phase of this peer's round ended: where a round's time goes). Why a round stopped early is kept
here too: a member saw another group (``aborted``), or a bug of ours broke it (``bug``).

Separate from ``allreduce`` (what a round does: parts out, a part reduced, averages back) because
it is how a round's concurrency is owned, the same for the aggregator's side and the sender's
(``sender_side``): the house rule "every wait has a timeout; every background task is owned and
cancelled" for one round, in one place. Failures of the tasks are read by the round (its
report), never logged here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from kit.runtime import cancel_and_wait

T = TypeVar("T")

CLOSE_TIMEOUT = 1.0  # seconds the round's end waits for its cancelled tasks to finish


@dataclass(frozen=True)
class Timeouts:
    """How long each side of a round waits (seconds) before it gives up on the other."""

    connect: float  # opening a stream to an aggregator
    sender: float  # an aggregator waits this long for a sender's next chunk, then excludes it
    reducer: float  # a sender waits this long for an aggregator's next average, then drops the part
    deadline: float | None  # loop time at which the whole round stops (allreduce_timeout)


class RoundTasks:
    """The tasks one round spawned, its deadline and its timeline (on the running loop)."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._tasks: set[asyncio.Task[Any]] = set()
        self._marks: dict[str, float] = {}  # event -> loop time, for the round's debug timeline
        self.aborted: str | None = None  # why a member made us abort the round
        self.bug: Exception | None = None  # our own failure mid-round (the round raises it)
        self.closed = False  # the round is over: nothing new may join it

    def spawn(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """Run ``work`` as a task of this round: cancelled by :meth:`cancel_others` and
        :meth:`close`; its failure is kept for whoever awaits it, not logged."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)
        return task

    def remaining(self, timeout: float | None = None) -> float | None:
        """``timeout``, cut short by the round's deadline (None: no bound at all)."""
        deadline = self.timeouts.deadline
        if deadline is None:
            return timeout
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        return left if timeout is None else min(left, timeout)

    def cancel_others(self) -> None:
        """Cancel every task of the round but the one calling (it ends on its own)."""
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()

    def abort(self, reason: str) -> None:
        """A member disagrees about the round: stop every task, keep the reason."""
        self.aborted = reason
        self.cancel_others()

    def fail(self, bug: Exception) -> None:
        """A bug of ours broke the round: stop every task now, keep the first bug."""
        if self.bug is None:
            self.bug = bug
        self.cancel_others()

    async def close(self) -> None:
        """The round is over: cancel what still runs and wait for it (bounded)."""
        self.closed = True
        await cancel_and_wait(list(self._tasks), CLOSE_TIMEOUT)

    def mark(self, event: str) -> None:
        """Note when ``event`` first happened (later marks of the same event are ignored)."""
        self._marks.setdefault(event, asyncio.get_running_loop().time())

    def timeline(self) -> str:
        """``event=+seconds`` of each mark from the "start" mark, in the order they happened."""
        start = self._marks["start"]
        marks = sorted(self._marks.items(), key=lambda mark: mark[1])
        return " ".join(f"{event}=+{t - start:.3f}" for event, t in marks)


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # failures are reported through the round's report, not the log

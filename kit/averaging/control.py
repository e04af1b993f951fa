"""One averaging step under the caller's control: its stage, its trigger, its result (hivemind's names).

Holds ``AveragingStage`` (where a step is: looking for a group, waiting for the caller's trigger,
running the all-reduce, finished), its transition table, and ``StepControl``: the
``concurrent.futures.Future`` that ``DecentralizedAverager.step(wait=False)`` returns. The caller
reads ``stage``, calls ``allow_allreduce()`` (a step made with ``require_trigger=True`` forms its
group, then waits for it) or ``cancel()``, and takes ``result()``: the ``RoundResult``, or the
``AveragingFailed`` that ended the step. It does not run the step (``kit.averaging.averager``).

Threads: the caller's thread uses the public methods; the averager's coroutine (on kit's runtime
loop) calls ``attach``, ``advance``, ``wait_for_trigger`` and ``finish``. One lock orders a
cancellation against the all-reduce's start, so a step is either cancelled before it sends
anything or runs to its end (a running all-reduce is never cancelled: the group counts on it).

Differences from hivemind's ``StepControl`` (an ``MPFuture`` in shared memory): ``weight`` and
``scheduled_time`` are read once, when the group search begins (kit's leader announces every
member's weight with the group), and a later change only logs a warning; ``cancel()`` returns
False once the all-reduce runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import math
import threading
from typing import Any

from kit.dht.node import get_dht_time
from kit.errors import ConfigError, KitUsageError

logger = logging.getLogger(__name__)


class AveragingStage(enum.Enum):
    IDLE = 0  # created, not started yet
    LOOKING_FOR_GROUP = 1  # matchmaking
    AWAITING_TRIGGER = 2  # the group is known; waiting for allow_allreduce()
    RUNNING_ALLREDUCE = 3  # exchanging tensors with the group
    FINISHED = 4  # done: a result, a failure, or cancelled


STAGE_TRANSITIONS: dict[AveragingStage, frozenset[AveragingStage]] = {
    AveragingStage.IDLE: frozenset({AveragingStage.LOOKING_FOR_GROUP, AveragingStage.FINISHED}),
    AveragingStage.LOOKING_FOR_GROUP: frozenset(
        {
            AveragingStage.AWAITING_TRIGGER,
            AveragingStage.RUNNING_ALLREDUCE,
            AveragingStage.FINISHED,
        }
    ),
    AveragingStage.AWAITING_TRIGGER: frozenset(
        {AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED}
    ),
    AveragingStage.RUNNING_ALLREDUCE: frozenset(  # a failed round is retried within the deadline
        {AveragingStage.LOOKING_FOR_GROUP, AveragingStage.FINISHED}
    ),
    AveragingStage.FINISHED: frozenset(),
}


class StepControl(concurrent.futures.Future):  # type: ignore[type-arg]
    """A running averaging step (see the module docstring). Made by ``DecentralizedAverager.step``.

    Args:
        scheduled_time: DHT time at which the round should begin (a leader waits for followers
            until then, or until the group is full).
        deadline: DHT time after which no new group search begins.
        allow_retries: after a failed search or round, try again until the deadline.
        weight: this peer's weight in the average (0 for auxiliary peers).
    """

    def __init__(
        self, scheduled_time: float, deadline: float, allow_retries: bool, weight: float
    ) -> None:
        super().__init__()
        if not scheduled_time < deadline:
            raise ConfigError(
                f"scheduled_time {scheduled_time:.3f} is not before the step's deadline "
                f"{deadline:.3f} - help: pass a longer timeout, or an earlier scheduled_time"
            )
        self._scheduled_time, self._deadline = float(scheduled_time), float(deadline)
        self._allow_retries = allow_retries
        self._weight = float(weight)
        self._stage = AveragingStage.IDLE
        self._lock = threading.Lock()  # orders stage changes against cancel() and the trigger
        self._triggered = False
        self._trigger: asyncio.Event | None = None  # made on the loop by attach()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_cancel: list[Any] = []  # callables run (on any thread) by a successful cancel

    # --- for the caller -------------------------------------------------------------------

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    @property
    def began_allreduce(self) -> bool:
        """The all-reduce has started (or finished): cancel() no longer stops this step."""
        return self._stage is AveragingStage.RUNNING_ALLREDUCE or (
            self._stage is AveragingStage.FINISHED and not self.cancelled()
        )

    @property
    def scheduled_time(self) -> float:
        return self._scheduled_time

    @scheduled_time.setter
    def scheduled_time(self, value: float) -> None:
        if self._stage is not AveragingStage.IDLE:
            logger.warning("scheduled_time changed after the group search began: no effect")
        self._scheduled_time = float(value)

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        if not (isinstance(value, int | float) and 0 <= value < math.inf):
            raise ConfigError(f"weight={value!r} must be >= 0 - help: pass a sample count")
        if self._stage is not AveragingStage.IDLE:
            logger.warning(
                "weight changed after the group search began: no effect (kit's leader announces "
                "every member's weight with the group)"
            )
        self._weight = float(value)

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def allow_retries(self) -> bool:
        return self._allow_retries

    @property
    def triggered(self) -> bool:
        return self._triggered

    def allow_allreduce(self) -> None:
        """Let the step run its all-reduce once its group is found (twice is harmless)."""
        with self._lock:
            if self._triggered:
                logger.debug("allow_allreduce(): already triggered")
                return
            self._triggered = True
            trigger, loop = self._trigger, self._loop
        if trigger is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(trigger.set)

    def cancel(self) -> bool:
        """Stop the step if its all-reduce has not started; False if it has (or is over)."""
        with self._lock:
            if self.began_allreduce or self.done():
                return self.cancelled()
            cancelled = super().cancel()
            self._stage = AveragingStage.FINISHED
            hooks, self._on_cancel = self._on_cancel, []
        for hook in hooks:
            hook()
        return cancelled

    def get_timeout(self) -> float:
        """Seconds left until the deadline (hivemind's name)."""
        return max(0.0, self._deadline - get_dht_time())

    def __repr__(self) -> str:
        return f"StepControl({self._stage.name}, done={self.done()})"

    # --- for the averager (on kit's runtime loop) ---------------------------------------------

    def attach(self, on_cancel: Any = None) -> None:
        """Bind the trigger to the running loop; ``on_cancel`` runs if the caller cancels."""
        event = asyncio.Event()
        with self._lock:
            self._loop, self._trigger = asyncio.get_running_loop(), event
            if self._triggered:
                event.set()
            if on_cancel is not None:
                self._on_cancel.append(on_cancel)

    def advance(self, stage: AveragingStage) -> None:
        """Move to ``stage``.

        Raises:
            asyncio.CancelledError: the caller cancelled the step (before the all-reduce).
            KitUsageError: not a transition of STAGE_TRANSITIONS (a bug in the averager).
        """
        with self._lock:
            if self.cancelled():
                raise asyncio.CancelledError()
            if stage is not self._stage and stage not in STAGE_TRANSITIONS[self._stage]:
                raise KitUsageError(f"step stage {self._stage.name} -> {stage.name} is not allowed")
            self._stage = stage

    async def wait_for_trigger(self, timeout: float) -> bool:
        """Wait until ``allow_allreduce()``; False if ``timeout`` passed first."""
        assert self._trigger is not None, "attach() first"
        try:
            await asyncio.wait_for(self._trigger.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the outcome (unless cancelled already), then move to FINISHED (as hivemind: a
        caller that sees FINISHED finds the step done)."""
        try:
            if error is None:
                self.set_result(result)
            else:
                self.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled meanwhile
        with self._lock:
            self._stage = AveragingStage.FINISHED
            self._on_cancel = []

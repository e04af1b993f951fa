"""An asyncio event loop on virtual time: idle waits take no wall-clock time.

Holds :class:`VirtualTimeLoop` and :func:`run_virtual`. When every task is waiting (for a timer,
a timeout, a simulated link's delivery), the loop jumps its clock to the next timer instead of
sleeping, so a thousand in-process peers that would spend minutes waiting on 100 Mbit/s links run
in the seconds the CPU needs, and what they measure with ``loop.time()`` is what the links would
give. Work the CPU does takes no virtual time at all: the loop models the network, not the
machine (compute stays free; ``run_in_executor`` / ``asyncio.to_thread`` run their function
inline, so no thread can race the clock).

Time reads that follow it: ``loop.time()`` (every timeout and deadline in kit's async code) and
``kit.dht.get_dht_time()``, which asks the running loop's :meth:`VirtualTimeLoop.dht_time`
(the wall clock when the loop started plus the virtual seconds since: DHT expirations move with
the simulated clock). ``time.time()`` / ``time.monotonic()`` called directly do not: keep them
out of code that runs in a simulation.

Why not the ``looptime`` package: it patches a running loop for pytest and knows nothing of the
DHT's wall-clock time or of executors; these 100 lines do what the simulator needs and no more.

Example::

    async def scenario() -> None:
        await asyncio.sleep(3600)           # returns at once; loop.time() moved by an hour

    run_virtual(scenario())
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from kit.errors import KitUsageError

T = TypeVar("T")
#: Wall seconds the loop waits for another thread when nothing is scheduled at all (no timer,
#: no ready callback): past it, the simulation is stuck and says so.
IDLE_WALL_TIMEOUT = 60.0


class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector: polls real file descriptors without waiting, then moves the clock
    to where the loop would have woken up (the next timer)."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # nothing scheduled: only another thread could still wake us
            events = self._real.select(self._loop.idle_wall_timeout)
            if not events:
                raise KitUsageError(
                    "the virtual-time loop has nothing scheduled and nothing ready: every task "
                    "waits without a timeout - help: give that wait a timeout"
                )
            return events
        self._loop._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock only moves when every task waits (see the module)."""

    def __init__(
        self, start_wall_time: float | None = None, idle_wall_timeout: float = IDLE_WALL_TIMEOUT
    ) -> None:
        self.idle_wall_timeout = idle_wall_timeout
        self._virtual_now = 0.0
        self._wall_at_start = time.time() if start_wall_time is None else start_wall_time
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def dht_time(self) -> float:
        """The DHT's wall-clock time in this simulation (``kit.dht.get_dht_time`` reads it)."""
        return self._wall_at_start + self._virtual_now

    def _advance(self, seconds: float) -> None:
        if seconds > 0:
            self._virtual_now += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Runs ``func`` at once, in this thread: compute takes no virtual time."""
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(contextvars.copy_context().run(func, *args))
        except BaseException as e:  # delivered to the awaiting task, as an executor would
            future.set_exception(e)
        return future


def run_virtual(
    coroutine: Coroutine[Any, Any, T],
    *,
    start_wall_time: float | None = None,
    idle_wall_timeout: float = IDLE_WALL_TIMEOUT,
) -> T:
    """Run ``coroutine`` to completion on a fresh :class:`VirtualTimeLoop` (like asyncio.run).

    Raises:
        KitUsageError: every task waits without a timeout for ``idle_wall_timeout`` wall
            seconds (a deadlock: virtual time cannot move).
    """
    loop = VirtualTimeLoop(start_wall_time, idle_wall_timeout)
    try:
        return loop.run_until_complete(coroutine)
    finally:
        try:
            leftover = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in leftover:
                task.cancel()
            if leftover:
                loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

"""The one bridge between user code and kit's asyncio world: one loop in one background thread.

Everything that does I/O in kit (peers, the DHT, averaging) is a coroutine on this loop. User code
(a training script, a notebook cell) calls the thin synchronous facades of ``kit.DHT``,
``kit.Optimizer`` and friends, which submit coroutines here with :func:`Runtime.call`.

Why a thread and not the caller's loop: a Jupyter kernel already runs an event loop in the main
thread, so ``asyncio.run()`` cannot be used there, and patching the loop (``nest_asyncio``) breaks
other libraries. A loop of our own in a daemon thread works the same in a script, in a notebook and
in a test, with no patches. uvloop is used when it is installed (never on Windows).

What this module does not do: it starts no processes (hivemind's DHT is a forked process; ours is
not) and no other threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, Literal, TypeVar, overload

from kit.errors import KitError, KitTimeout, KitUsageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Set KIT_NO_UVLOOP=1 to force the standard asyncio loop even when uvloop is installed.
NO_UVLOOP_ENV = "KIT_NO_UVLOOP"


def _new_event_loop() -> asyncio.AbstractEventLoop:
    if sys.platform != "win32" and os.environ.get(NO_UVLOOP_ENV, "") in ("", "0"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Runtime:
    """One asyncio loop running in one daemon thread, with a blocking ``call`` facade.

    Use :func:`get_runtime` for the process-wide instance; tests may create private ones.
    """

    def __init__(self, name: str = "kit-runtime") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, started on first use."""
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                self._start_locked()
            assert self._loop is not None
            return self._loop

    @property
    def thread_id(self) -> int | None:
        thread = self._thread
        return thread.ident if thread is not None else None

    def in_runtime_thread(self) -> bool:
        return self._thread is not None and threading.get_ident() == self._thread.ident

    def _start_locked(self) -> None:
        loop = _new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            try:
                loop.run_forever()
            finally:
                _cancel_all_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=run, name=self._name, daemon=True)
        thread.start()
        if not started.wait(timeout=10.0):  # a loop that cannot start in 10 s is broken
            raise KitUsageError("kit's runtime thread did not start within 10 s")
        self._loop = loop
        self._thread = thread
        logger.debug("runtime %s started (%s)", self._name, type(loop).__name__)

    @overload
    def call(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        timeout: float | None = ...,
        return_future: Literal[False] = ...,
    ) -> T: ...

    @overload
    def call(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        timeout: float | None = ...,
        return_future: Literal[True],
    ) -> concurrent.futures.Future[T]: ...

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        timeout: float | None = None,
        return_future: bool = False,
    ) -> T | concurrent.futures.Future[T]:
        """Run ``coro`` on the runtime loop and wait for its result (or return a future).

        Args:
            coro: the coroutine to run.
            timeout: seconds to wait for the result; on expiry the coroutine is cancelled and
                :class:`~kit.errors.KitTimeout` is raised. ``None`` waits until it finishes (the
                coroutine must then bound its own waits, as every kit coroutine does).
            return_future: return a ``concurrent.futures.Future`` at once instead of waiting.

        Raises:
            KitUsageError: when called from the runtime thread itself (it would deadlock).
        """
        if self.in_runtime_thread():
            coro.close()
            raise KitUsageError(
                "a blocking kit call was made from kit's own event loop thread, which would "
                "deadlock - help: inside a coroutine, await the async method instead"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        if return_future:
            return future
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise KitTimeout(f"operation did not finish within {timeout} s") from e

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel every task on the loop and stop the thread (tests; process exit)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)


class PeriodicTask:
    """A coroutine (:meth:`once`) every ``period`` seconds, as one owned task on the running
    loop: :meth:`start` it there, :meth:`shutdown` cancels it. A ``KitError`` from one run is
    logged (the DHT recovers) and the next period tries again; a bug propagates and ends it."""

    period: float
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the task (call on the loop that should run it)."""
        if self._task is not None:
            raise KitUsageError(f"{type(self).__name__}.start() was called twice - help: once")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=type(self).__name__)

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.once()
            except KitError as e:  # the DHT recovers; the next period tries again
                logger.debug("%s: %s", type(self).__name__, e)
            await asyncio.sleep(self.period)

    async def once(self) -> None:
        raise NotImplementedError


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


_runtime = Runtime()


def get_runtime() -> Runtime:
    """The process-wide runtime shared by every kit object in this process."""
    return _runtime


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout: float) -> None:
    """Cancel ``tasks`` and wait (at most ``timeout``) until they are done.

    Cancels again every 10 ms: on Python <= 3.11 ``asyncio.wait_for`` can swallow a cancellation
    that arrives as its inner future completes (CPython gh-86296), and the task then runs on.
    """
    pending = {task for task in tasks if not task.done()}
    give_up = asyncio.get_running_loop().time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        left = give_up - asyncio.get_running_loop().time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(0.01, left))

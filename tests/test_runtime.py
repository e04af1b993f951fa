"""The one background loop, its blocking facade, and periodic tasks on it."""

from __future__ import annotations

import asyncio

import pytest

from kit.errors import KitTimeout, KitUsageError, PeerUnavailable
from kit.runtime import PeriodicTask, Runtime


@pytest.fixture
def runtime() -> Runtime:
    runtime = Runtime("test-runtime")
    yield runtime  # type: ignore[misc]
    runtime.shutdown()


def test_call_returns_result_and_future(runtime: Runtime) -> None:
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    assert runtime.call(add(1, 2), timeout=5) == 3
    assert runtime.call(add(2, 2), return_future=True).result(5) == 4


def test_timeout_cancels_the_coroutine(runtime: Runtime) -> None:
    cancelled = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(KitTimeout):
        runtime.call(slow(), timeout=0.1)
    runtime.call(asyncio.sleep(0.05), timeout=5)
    assert cancelled == [True]


def test_blocking_call_from_the_runtime_thread_is_refused(runtime: Runtime) -> None:
    async def nested() -> None:
        runtime.call(asyncio.sleep(0), timeout=1)

    with pytest.raises(KitUsageError, match="help:"):
        runtime.call(nested(), timeout=5)


def test_works_while_the_caller_runs_its_own_loop(runtime: Runtime) -> None:
    """As in Jupyter: the main thread's loop is running, and blocking calls still work."""

    async def notebook_cell() -> int:
        async def work() -> int:
            return 42

        return runtime.call(work(), timeout=5)

    assert asyncio.run(notebook_cell()) == 42


def test_exceptions_propagate(runtime: Runtime) -> None:
    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        runtime.call(fail(), timeout=5)


async def test_a_periodic_task_runs_every_period_survives_kit_errors_and_stops() -> None:
    class Ticks(PeriodicTask):
        period = 0.01

        def __init__(self) -> None:
            self.runs = 0

        async def once(self) -> None:
            self.runs += 1
            if self.runs == 2:
                raise PeerUnavailable("the DHT is down for a moment")  # logged, goes on

    ticks = Ticks()
    ticks.start()
    with pytest.raises(KitUsageError, match="called twice"):
        ticks.start()
    for _ in range(200):  # bounded: 2 s at most
        if ticks.runs >= 4:
            break
        await asyncio.sleep(0.01)
    assert ticks.runs >= 4  # the error on the 2nd run did not end it
    await ticks.shutdown()
    stopped = ticks.runs
    await asyncio.sleep(0.05)
    assert ticks.runs == stopped
    await ticks.shutdown()  # twice: nothing to do

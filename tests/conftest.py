"""Shared test settings: one scalable time unit, ``async def`` tests, no network beyond loopback.

``async def test_...`` functions run in a fresh event loop each (``asyncio.run``), bounded by
``ASYNC_TEST_TIMEOUT`` seconds (or ``@pytest.mark.async_timeout(seconds)``), so a hung test fails
instead of stalling CI.
"""

from __future__ import annotations

import asyncio
import inspect
import os

import pytest

#: Multiply every test timeout by KIT_TESTS_TIMEOUT_FACTOR on slow machines.
TIMEOUT_FACTOR = float(os.environ.get("KIT_TESTS_TIMEOUT_FACTOR", "1"))
#: One millisecond, scaled: write waits in tests as ``500 * MS``.
MS = 0.001 * TIMEOUT_FACTOR
ASYNC_TEST_TIMEOUT = 60.0 * TIMEOUT_FACTOR


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "async_timeout(seconds): time limit of an async test")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    marker = pyfuncitem.get_closest_marker("async_timeout")
    timeout = (marker.args[0] * TIMEOUT_FACTOR) if marker else ASYNC_TEST_TIMEOUT
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**arguments), timeout))
    return True

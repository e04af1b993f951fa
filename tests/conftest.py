"""Shared test settings: one scalable time unit, ``async def`` tests, no network beyond loopback;
one real ``kit demo`` run for the tests that judge its checkpoints (``demo_run``).

``async def test_...`` functions run in a fresh event loop each (``asyncio.run``), bounded by
``ASYNC_TEST_TIMEOUT`` seconds (or ``@pytest.mark.async_timeout(seconds)``), so a hung test fails
instead of stalling CI.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path

import pytest

#: Multiply every test timeout by KIT_TESTS_TIMEOUT_FACTOR on slow machines.
TIMEOUT_FACTOR = float(os.environ.get("KIT_TESTS_TIMEOUT_FACTOR", "1"))
#: One millisecond, scaled: write waits in tests as ``500 * MS``.
MS = 0.001 * TIMEOUT_FACTOR
ASYNC_TEST_TIMEOUT = 60.0 * TIMEOUT_FACTOR


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "async_timeout(seconds): time limit of an async test")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (setup.cfg): a test module runs whole on one
    worker, so its module-scoped fixtures are built once; the tests that judge ``demo_run`` share
    one worker, so the session's one ``kit demo`` run stays one."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        group = "demo_run" if "demo_run" in fixtures else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    marker = pyfuncitem.get_closest_marker("async_timeout")
    timeout = (marker.args[0] * TIMEOUT_FACTOR) if marker else ASYNC_TEST_TIMEOUT
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**arguments), timeout))
    return True


#: Seconds of training of the tests' ``kit demo``: its coordinator saves about every 30 s, from
#: about 40 s on, so this leaves two checkpoints or more (one at the least on a loaded machine).
DEMO_SECONDS = 80


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one real ``kit demo --work-dir`` run (run.yaml, coordinator/checkpoints/),
    shared by the tests that judge its checkpoints (about 100 s, once per session)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    work = tmp_path_factory.mktemp("demo-run") / "demo"
    log = work.parent / "demo.log"
    command = [sys.executable, "-m", "kit", "demo", "--work-dir", str(work)]
    command += ["--duration", str(DEMO_SECONDS), "--peers", "2"]
    # This checkout's kit, also for the volunteers it starts in folders of their own.
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    with log.open("w") as output:  # a file: a full pipe would stall the demo
        subprocess.run(
            command,
            cwd=repo,
            env=dict(os.environ, PYTHONPATH=path),
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=DEMO_SECONDS + 240,
            check=False,  # its loss verdict is test_demo's business; its checkpoints are ours
        )
    saved = sorted((work / "coordinator" / "checkpoints").glob("step_*/kit_checkpoint.json"))
    assert saved, log.read_text()[-3000:]
    return work

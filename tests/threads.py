"""Peers that train in threads of their own, as a test runs them: start all, join all, and fail
with what any of them raised (a thread's exception otherwise only reaches the log)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_in_threads(
    target: Callable[..., Any], arguments: Iterable[tuple[Any, ...]], timeout: float
) -> None:
    """``target(*args)`` for each ``args`` in a thread of its own, all at once; waits for each
    at most ``timeout`` seconds.

    Raises:
        AssertionError: a thread raised (all errors listed), or one still runs after its wait.
    """
    errors: list[BaseException] = []

    def guarded(*args: Any) -> None:
        try:
            target(*args)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=args) for args in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not errors, errors
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"{len(stuck)} thread(s) still running after {timeout} s"

"""Fixtures of the hivemind compatibility tests: kit's real peers on loopback, hivemind's names.

Every test in this folder uses kit the way a ported hivemind script does (``import kit as
hivemind``) and names the test of hivemind 1.1.12's own suite it mirrors (the one test without a
counterpart says so), written anew from the behaviour that test checks (no hivemind code).
``swarm.dhts(n)`` is hivemind's ``launch_dht_instances(n)``: ``n`` websocket DHT peers on
127.0.0.1, the first one the others' initial peer. They run in this process, on kit's runtime
thread (README, the ``hivemind.DHT`` row), so starting one costs milliseconds. Everything a test
hands to ``swarm.own`` (and every DHT it made) is shut down after the test, in reverse order,
even when it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import kit as hivemind


class Swarm:
    """DHT peers on loopback and whatever runs on them, shut down together."""

    def __init__(self) -> None:
        self._owned: list[Any] = []

    def own(self, *objects: Any) -> Any:
        """Shut ``objects`` down after the test (before the DHTs made earlier); returns them."""
        self._owned.extend(objects)
        return objects[0] if len(objects) == 1 else objects

    def dhts(self, n: int, clients: int = 0) -> list[hivemind.DHT]:
        """``n`` DHT peers joined through the first; the last ``clients`` of them in client mode.

        The others run in server mode (hivemind's default); the first one also relays, because
        kit's client-mode peers listen nowhere and are reached through a relay (README, "Peers,
        addresses and networks").
        """
        first = hivemind.DHT(start=True, client_mode=False, peer_options={"relay_service": True})
        peers = [self.own(first)]
        for index in range(1, n):
            client_mode = index >= n - clients
            dht = hivemind.DHT(first.get_visible_maddrs(), start=True, client_mode=client_mode)
            peers.append(self.own(dht))
        return peers

    def shutdown(self) -> None:
        errors = []
        for obj in reversed(self._owned):
            try:
                obj.shutdown()
            except Exception as e:  # shut the rest down, then report
                errors.append(e)
        self._owned.clear()
        if errors:
            raise errors[0]


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    peers = Swarm()
    try:
        yield peers
    finally:
        peers.shutdown()

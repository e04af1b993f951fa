"""Fixtures of the DHT tests: the peer factory the swarm tests run on.

Swarm tests take ``peer_factory`` and run twice: on in-process ``MemoryNetwork`` peers and on
real websocket peers on loopback (marker ``sockets``). Tests that inject faults take
``network`` (memory only).
"""

from __future__ import annotations

import functools

import pytest

from kit.p2p.memory import MemoryNetwork
from tests.dht.swarm import PeerFactory


@pytest.fixture
def network() -> MemoryNetwork:
    """A fresh in-process network (its asyncio objects are made lazily, in the test's loop)."""
    return MemoryNetwork()


@pytest.fixture(params=["memory", pytest.param("sockets", marks=pytest.mark.sockets)])
def peer_factory(request: pytest.FixtureRequest, network: MemoryNetwork) -> PeerFactory:
    """How swarm tests create peers: in memory, or websocket peers on 127.0.0.1."""
    if request.param == "memory":
        return network.create_peer
    from kit.p2p.peer import create_peer

    # public peers relay for the client-mode ones, as `kit dht` does
    return functools.partial(create_peer, host="127.0.0.1", relay_service=True)

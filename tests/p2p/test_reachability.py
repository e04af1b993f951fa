"""client_mode=None: public when an initial peer can dial us back, client mode otherwise."""

from __future__ import annotations

import pytest

from kit.errors import PeerUnavailable
from kit.p2p.identity import PeerID
from kit.p2p.peer import create_peer

pytestmark = pytest.mark.sockets


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request


async def test_reachable_peer_stays_public() -> None:
    bootstrap = await create_peer(run_id="test", relay_service=True)
    peer = await create_peer(bootstrap.get_visible_addresses(), run_id="test", client_mode=None)
    try:
        assert not peer.client_mode and peer.listen_port is not None
        assert bootstrap.connected_peers() == [peer.peer_id]  # the probe connection was not kept
    finally:
        await peer.shutdown()
        await bootstrap.shutdown()


async def test_unreachable_peer_switches_to_client_mode() -> None:
    """It listens on 127.0.0.2 but is seen at 127.0.0.1: the dial-back fails, as behind NAT."""
    bootstrap = await create_peer(run_id="test", relay_service=True)
    peer = await create_peer(
        bootstrap.get_visible_addresses(), run_id="test", client_mode=None, host="127.0.0.2"
    )
    outsider = await create_peer(run_id="test")
    try:
        assert peer.client_mode and peer.listen_port is None
        peer.add_unary_handler("echo", echo)
        await outsider.connect(peer.get_visible_addresses()[0], timeout=5)
        assert await outsider.call(peer.peer_id, "echo", b"via relay", timeout=5) == b"via relay"
    finally:
        for p in (outsider, peer, bootstrap):
            await p.shutdown()


async def test_no_initial_peer_answering_is_a_clear_error() -> None:
    with pytest.raises(PeerUnavailable, match="none of the initial peers answered"):
        await create_peer(
            ["/ip4/127.0.0.1/tcp/9/ws"], run_id="test", client_mode=None, dial_timeout=1.0
        )

"""Address parsing and formatting (multiaddr-style and URL forms)."""

from __future__ import annotations

import pytest

from kit.address import AddressError, parse_address
from kit.p2p.identity import Identity


def test_round_trips() -> None:
    peer, relay = Identity.generate().peer_id, Identity.generate().peer_id
    for text in (
        f"/ip4/127.0.0.1/tcp/4000/ws/p2p/{peer}",
        f"/ip6/::1/tcp/4000/ws/p2p/{peer}",
        f"/dns/coord.example.org/tcp/443/wss/p2p/{peer}",
        f"/dns/example.org/tcp/443/wss/http-path/kit%2Fp2p/p2p/{peer}",
        f"/ip4/10.0.0.1/tcp/1/ws/p2p/{relay}/p2p-circuit/p2p/{peer}",
        "/ip4/127.0.0.1/tcp/4000/ws",
    ):
        assert str(parse_address(text)) == text


def test_urls_and_hivemind_forms() -> None:
    peer = Identity.generate().peer_id
    address = parse_address(f"wss://coord.example.org/kit#{peer}")
    assert (address.host, address.port, address.secure, address.path, address.peer_id) == (
        "coord.example.org",
        443,
        True,
        "/kit",
        peer,
    )
    assert address.url == "wss://coord.example.org:443/kit"
    hivemind = parse_address(f"/ip4/1.2.3.4/tcp/31337/p2p/{peer}")
    assert hivemind.url == "ws://1.2.3.4:31337/" and hivemind.peer_id == peer
    assert parse_address("ws://[::1]:8000").url == "ws://[::1]:8000/"


def test_relayed_address_dials_the_relay() -> None:
    peer, relay = Identity.generate().peer_id, Identity.generate().peer_id
    address = parse_address(f"/ip4/10.0.0.1/tcp/7/ws/p2p/{relay}/p2p-circuit/p2p/{peer}")
    assert address.peer_id == peer and address.relay is not None and address.relay.peer_id == relay
    assert address.url == "ws://10.0.0.1:7/"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "localhost:8000",
        "/ip4/1.2.3.4/udp/1",
        "/ip4/1.2.3.4/tcp/99999/ws",
        "/ip4/1.2.3.4/tcp/1/ws/p2p/0OIl",
        "/ip4/1.2.3.4/tcp/1/quic",
        "http://x",
        "/ip4/1.2.3.4/tcp/1/ws/p2p-circuit/p2p",
    ],
)
def test_bad_addresses_say_what_is_valid(text: str) -> None:
    with pytest.raises(AddressError):
        parse_address(text)

"""Which addresses a listening peer hands out: never a wildcard; a bare announced host takes the
listening port; a real peer on 0.0.0.0 hands out its interfaces' addresses."""

from __future__ import annotations

import asyncio

import pytest

from kit.address import Address, AddressError, parse_address
from kit.errors import ConfigError
from kit.p2p import interfaces
from kit.p2p.interfaces import Scope, announced_address, scope, visible_addresses
from kit.p2p.options import PeerOptions
from kit.p2p.peer import create_peer

GLOBAL_V4, GLOBAL_V6 = "11.2.3.4", "2a00:1450::1"  # is_global (not documentation ranges)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("0.0.0.0", Scope.UNSPECIFIED),
        ("::", Scope.UNSPECIFIED),
        ("127.0.0.1", Scope.LOOPBACK),
        ("127.8.9.1", Scope.LOOPBACK),
        ("::1", Scope.LOOPBACK),
        ("localhost", Scope.LOOPBACK),
        ("169.254.1.2", Scope.LINK_LOCAL),
        ("fe80::1", Scope.LINK_LOCAL),
        ("10.0.0.4", Scope.PRIVATE),
        ("172.17.0.1", Scope.PRIVATE),  # Docker's bridge
        ("192.168.1.5", Scope.PRIVATE),
        ("100.64.3.2", Scope.PRIVATE),  # carrier-grade NAT (RFC 6598)
        ("fd00::2", Scope.PRIVATE),  # IPv6 ULA
        ("192.0.2.2", Scope.PRIVATE),  # documentation range: not on the Internet
        (GLOBAL_V4, Scope.GLOBAL),
        (GLOBAL_V6, Scope.GLOBAL),
        ("::ffff:11.2.3.4", Scope.GLOBAL),
        ("run.example.org", Scope.NAME),
    ],
)
def test_scope(host: str, expected: Scope) -> None:
    assert scope(host) is expected


def test_an_announced_host_takes_the_listening_port_and_scheme() -> None:
    assert str(announced_address("run.example.org", 8765, True)) == (
        "/dns/run.example.org/tcp/8765/wss"
    )
    assert announced_address("11.2.3.4:443", 8765, False) == Address(GLOBAL_V4, 443, False)
    assert announced_address("[2a00:1450::1]:9", None, False) == Address(GLOBAL_V6, 9, False)
    assert announced_address(GLOBAL_V6, 7, False) == Address(GLOBAL_V6, 7, False)
    # URLs and kit addresses are taken as written; https:// is the same server's wss://.
    assert announced_address("https://run.example.org", 8765, False) == Address(
        "run.example.org", 443, True
    )
    assert announced_address("/dns/a.example.org/tcp/31337/ws", 1, True) == Address(
        "a.example.org", 31337, False
    )
    for bad in ("run.example.org:http", "run.example.org:70000", "a b", "user@host", ""):
        with pytest.raises(AddressError):
            announced_address(bad, 8765, False)
    with pytest.raises(AddressError, match="listen on a fixed port"):
        announced_address("run.example.org", None, False)


def test_a_wildcard_is_replaced_by_global_addresses_or_else_private_ones() -> None:
    listening = [Address("0.0.0.0", 8765, True)]
    found = [GLOBAL_V6, "10.0.0.4", GLOBAL_V4, "172.17.0.1"]
    # An IPv4 socket: the global IPv4 address only, never the Docker bridge or 0.0.0.0.
    assert visible_addresses(listening, (), found) == [Address(GLOBAL_V4, 8765, True)]
    # A LAN with no global address: its private addresses (a run inside that network).
    assert visible_addresses(listening, (), ["10.0.0.4", "fd00::2"]) == [
        Address("10.0.0.4", 8765, True)
    ]
    # "::" is dual-stack: every global address, in the interfaces' order.
    assert visible_addresses([Address("::", 1, False)], (), found) == [
        Address(GLOBAL_V6, 1, False),
        Address(GLOBAL_V4, 1, False),
    ]
    assert visible_addresses(listening, (), []) == []  # nothing others can dial: nothing
    # A specific listening address is kept; announce entries replace everything.
    assert visible_addresses([Address("10.0.0.4", 5, False)], (), found) == [
        Address("10.0.0.4", 5, False)
    ]
    assert visible_addresses(listening, ["run.example.org"], found) == [
        Address("run.example.org", 8765, True)
    ]


def test_a_typo_in_announce_fails_before_any_socket_opens() -> None:
    with pytest.raises(ConfigError, match="PeerOptions.announce"):
        PeerOptions(announce=("run.example.org:port",))
    PeerOptions(announce=("run.example.org",))  # a bare host: fine, the port comes later


@pytest.mark.sockets
def test_a_peer_listening_on_every_interface_hands_out_its_interfaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        interfaces, "_raw_interface_addresses", lambda: ["127.0.0.1", "10.9.8.7", GLOBAL_V4]
    )

    async def main() -> list[str]:
        peer = await create_peer(host="0.0.0.0")
        try:
            return peer.get_visible_addresses()
        finally:
            await peer.shutdown()

    (address,) = asyncio.run(main())
    parsed = parse_address(address)
    assert parsed.host == GLOBAL_V4 and parsed.port > 0 and parsed.peer_id is not None

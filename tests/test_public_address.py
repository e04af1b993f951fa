"""What a coordinator hands out, checked before anything starts (``kit.public_address``): a
wildcard listener with no public address is refused with a hint; announced wildcards and
loopback addresses are refused; TLS files that cannot serve are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.errors import ConfigError
from kit.public_address import check_public_address, check_tls_files
from tests.p2p.tls import make_certificate

GLOBAL_V4 = "11.2.3.4"


def test_a_wildcard_listener_needs_a_global_address_or_an_announced_one() -> None:
    check_public_address("0.0.0.0", (), interfaces=["10.0.0.4", GLOBAL_V4])
    for private_only in (["10.0.0.4", "172.17.0.1"], [], ["2a00:1450::1"]):  # v6 on a v4 socket
        with pytest.raises(ConfigError) as refused:
            check_public_address("0.0.0.0", (), interfaces=private_only)
        message = str(refused.value)
        assert "no public address" in message and "help: pass --announce" in message
        assert "PUBLIC_ADDRESS" in message and "127.0.0.1" in message
    assert "10.0.0.4 (private)" in str(
        pytest.raises(
            ConfigError, check_public_address, "0.0.0.0", (), interfaces=["10.0.0.4"]
        ).value
    )
    check_public_address("::", (), interfaces=["2a00:1450::1"])
    # Announced, the interfaces do not matter; a private announce is an explicit LAN run.
    check_public_address("0.0.0.0", ("run.example.org",), interfaces=[])
    check_public_address("0.0.0.0", ("10.0.0.4",), interfaces=[])
    # Loopback listeners run on this machine only (kit demo, tests, behind a reverse proxy).
    check_public_address("127.0.0.1", (), interfaces=[])
    check_public_address("127.0.0.1", ("wss://run.example.org",), interfaces=[])
    check_public_address("127.0.0.1", ("127.0.0.1",), interfaces=[])


@pytest.mark.parametrize(
    ("announce", "reason"),
    [
        ("0.0.0.0", "names no machine"),
        ("/ip6/::/tcp/443/wss", "names no machine"),
        ("127.0.0.1", "loopback address"),
        ("ws://localhost:8765", "loopback address"),
        ("169.254.0.7", "link-local address"),
        ("run.example.org:https", "invalid TCP port"),
        ("/ip4/11.2.3.4/tcp/1/ws/p2p-circuit", "relayed address"),
    ],
)
def test_an_announced_address_nobody_else_can_dial_is_refused(announce: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as refused:
        check_public_address("0.0.0.0", (announce,), interfaces=[GLOBAL_V4])
    assert "help: pass --announce" in str(refused.value)


def test_tls_files_that_cannot_serve_are_refused(tmp_path: Path) -> None:
    certfile, keyfile = make_certificate(tmp_path)
    check_tls_files(str(certfile), str(keyfile))
    _, other_key = make_certificate(tmp_path, prefix="other-")
    with pytest.raises(ConfigError, match="does not match the certificate"):
        check_tls_files(str(certfile), str(other_key))
    with pytest.raises(ConfigError, match="does not exist"):
        check_tls_files(str(tmp_path / "missing.pem"), str(keyfile))
    with pytest.raises(ConfigError, match="cannot be loaded"):
        check_tls_files(str(keyfile), str(keyfile))  # a key where the certificate goes
    old_cert, old_key = make_certificate(tmp_path, prefix="old-", expired=True)
    with pytest.raises(ConfigError, match="expired on .* help: renew it"):
        check_tls_files(str(old_cert), str(old_key))

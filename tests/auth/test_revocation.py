"""Revocation lists: building and signing them (pure), and their transport through the DHT."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import pytest

from kit.auth import RevocationList, TokenIssuer, fetch_revocations, publish_revocations
from kit.auth.revocation import MAX_REVOCATION_ENTRIES, revocation_key
from kit.dht import (
    DHTConfig,
    DHTNode,
    Ed25519SignatureValidator,
    ValueWithExpiration,
    get_dht_time,
    owner_marker,
)
from kit.errors import BadSignature, ConfigError, ForgedRecord, MalformedToken, Revoked
from kit.p2p.identity import Identity
from kit.p2p.memory import MemoryNetwork, memory_address
from tests.conftest import MS

AUTHORITY = Identity.generate()
KEY = Identity.generate().public_key
NOW = 1_700_000_000.0


def test_bans_have_their_own_end_and_the_later_one_wins() -> None:
    bans = RevocationList("run", 0.0).revoke(usernames=["bob", "alice"], until=NOW + 100)
    bans = bans.revoke(usernames=["alice"], peer_public_keys=[KEY], until=NOW + 10)
    assert bans.usernames == (("alice", NOW + 100), ("bob", NOW + 100))  # sorted; later end kept
    assert (
        bans.reason("alice", b"k" * 32, NOW + 50) == "user 'alice' is revoked for 50 more seconds"
    )
    assert "is revoked" in (bans.reason("carol", KEY, NOW + 5) or "")
    assert bans.reason("carol", KEY, NOW + 11) is None  # the key's ban ended
    assert bans.reason("alice", KEY, NOW + 100) is None
    assert bans.pruned(NOW + 50).peer_public_keys == () and len(bans.pruned(NOW).usernames) == 2


def test_signed_lists_survive_the_wire_and_forgeries_do_not_verify() -> None:
    signed = (
        RevocationList("run", 0.0).revoke(usernames=["bob"], until=NOW + 1).sign(AUTHORITY, NOW)
    )
    received = RevocationList.from_bytes(signed.to_bytes())
    assert received == signed
    received.verify(AUTHORITY.public_key)
    with pytest.raises(BadSignature, match="help:"):
        received.verify(Identity.generate().public_key)
    body = msgpack.unpackb(signed.to_bytes())
    body["users"] = []  # lift the ban without the authority
    with pytest.raises(BadSignature):
        RevocationList.from_bytes(msgpack.packb(body)).verify(AUTHORITY.public_key)


@pytest.mark.parametrize(
    "change",
    [
        {"users": [["bob"]]},
        {"users": [["bob", 1]]},
        {"users": [["not a name", 1.0]]},
        {"keys": [[b"short", 1.0]]},
        {"issued": "now"},
        {"sig": b""},
        {"v": 2},
        {"extra": 1},
        {"users": [["u", 1.0]] * (MAX_REVOCATION_ENTRIES + 1)},
    ],
)
def test_malformed_lists_get_a_typed_error(change: dict[str, object]) -> None:
    body = msgpack.unpackb(RevocationList("run", 0.0).sign(AUTHORITY, NOW).to_bytes())
    body.update(change)
    with pytest.raises(MalformedToken):
        RevocationList.from_bytes(msgpack.packb(body, use_bin_type=True))


def test_bad_revocations_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="help:"):
        RevocationList("run", 0.0).revoke(usernames=["not a name"], until=NOW)
    with pytest.raises(ConfigError, match="not a PeerID"):
        RevocationList("run", 0.0).revoke(peer_public_keys=[b"k" * 31], until=NOW)
    too_many = RevocationList("run", 0.0).revoke(
        usernames=[f"user{i}" for i in range(MAX_REVOCATION_ENTRIES + 1)], until=NOW
    )
    with pytest.raises(ConfigError, match="does not fit"):
        too_many.sign(AUTHORITY, NOW)


def test_the_issuer_refuses_revoked_users_and_each_list_is_newer_than_the_last() -> None:
    issuer = TokenIssuer(AUTHORITY, "run", lifetime=60)
    issuer.issue("bob", KEY, now=NOW)
    first = issuer.revoke(usernames=["bob"], duration=100, now=NOW)
    with pytest.raises(Revoked, match="user 'bob' is revoked.*help: ask the organizer"):
        issuer.issue("bob", Identity.generate().public_key, now=NOW + 1)
    second = issuer.revoke(peer_public_keys=[KEY], now=NOW - 500)  # the clock stepped back
    assert second.issued_at > first.issued_at
    with pytest.raises(Revoked, match="peer .* is revoked"):
        issuer.issue("alice", KEY, now=NOW)
    third = issuer.reinstate(usernames=["bob"], now=NOW + 2)
    assert third.issued_at > second.issued_at and third.usernames == ()
    assert issuer.issue("bob", Identity.generate().public_key, now=NOW + 2).username == "bob"
    third.verify(AUTHORITY.public_key)
    assert issuer.issue("bob", KEY, now=NOW + 24 * 3600 + 1).username == "bob"  # ban over


# --- through the DHT ------------------------------------------------------------------------

FAST = DHTConfig(rpc_timeout=500 * MS, lookup_timeout=5000 * MS, bootstrap_timeout=5000 * MS)


@asynccontextmanager
async def dht_nodes(count: int) -> AsyncIterator[list[DHTNode]]:
    network = MemoryNetwork()
    nodes: list[DHTNode] = []
    try:
        for _ in range(count):
            peer = await network.create_peer()
            initial = [memory_address(nodes[0].peer_id)] if nodes else []
            nodes.append(await DHTNode.create(peer, initial, config=FAST))
        yield nodes
    finally:
        for node in nodes:
            await node.shutdown()
            await node.peer.shutdown()  # type: ignore[attr-defined]


async def test_revocations_published_by_the_coordinator_reach_other_peers() -> None:
    issuer = TokenIssuer(AUTHORITY, "run")
    async with dht_nodes(3) as (coordinator, relay, volunteer):
        assert await fetch_revocations(volunteer, AUTHORITY.public_key, "run") is None
        bans = issuer.revoke(usernames=["mallory"], now=get_dht_time())
        expiration = get_dht_time() + 600
        assert await publish_revocations(coordinator, AUTHORITY, bans, expiration_time=expiration)
        fetched = await fetch_revocations(volunteer, AUTHORITY.public_key, "run")
        assert fetched == bans and fetched.reason("mallory", KEY, get_dht_time()) is not None
        # Another peer cannot write the authority's record: storing nodes check the owner
        # signature, and without the authority key it cannot even sign one.
        forged = RevocationList("run", 0.0).sign(Identity.generate(), get_dht_time())
        with pytest.raises(BadSignature):
            await publish_revocations(relay, AUTHORITY, forged, expiration_time=expiration + 1)
        with pytest.raises(ForgedRecord):
            await relay.store(
                revocation_key("run"),
                forged.to_bytes(),
                expiration + 1,
                subkey=owner_marker(AUTHORITY.public_key),
            )
        # A list under the attacker's own owner subkey is simply not the authority's.
        attacker = Identity.generate()
        relay.add_validators([Ed25519SignatureValidator(attacker)])
        empty = RevocationList("run", 0.0).sign(attacker, get_dht_time() + 5)
        await publish_revocations(relay, attacker, empty, expiration_time=expiration + 1)
        assert await fetch_revocations(volunteer, AUTHORITY.public_key, "run") == bans
        assert await fetch_revocations(volunteer, attacker.public_key, "run") == empty


class LyingNode:
    """A DHT node that answers ``get`` with whatever it was given (a malicious storing node)."""

    def __init__(self, value: object) -> None:
        self.value = value

    async def get(self, key: object, latest: bool = False) -> ValueWithExpiration[object]:
        assert key == revocation_key("run") and latest
        entry = ValueWithExpiration(self.value, NOW)
        return ValueWithExpiration({owner_marker(AUTHORITY.public_key): entry}, NOW)


@pytest.mark.parametrize(
    "value, error",
    [
        (RevocationList("run", 1.0).sign(Identity.generate(), NOW).to_bytes(), BadSignature),
        (RevocationList("other", 1.0).sign(AUTHORITY, NOW).to_bytes(), MalformedToken),
        (b"garbage", MalformedToken),
        ("not bytes", MalformedToken),
    ],
    ids=["forged", "other-run", "garbage", "not-bytes"],
)
async def test_fetch_verifies_the_list_itself(value: object, error: type[Exception]) -> None:
    # Storing nodes check DHT record signatures, but the fetcher must not rely on them.
    with pytest.raises(error):
        await fetch_revocations(LyingNode(value), AUTHORITY.public_key, "run")  # type: ignore[arg-type]
    genuine = RevocationList("run", 1.0).sign(AUTHORITY, NOW)
    assert (
        await fetch_revocations(LyingNode(genuine.to_bytes()), AUTHORITY.public_key, "run")
        == genuine
    )  # type: ignore[arg-type]

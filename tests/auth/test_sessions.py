"""The session guard: a ban holds at every peer, not only at the coordinator, and a connection
lives only as long as its access token (renewed, or closed)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable

import pytest

from kit.auth import (
    AllowlistAuthorizer,
    IssuerTokenSource,
    TokenIssuer,
)
from kit.auth.tokens import AccessToken
from kit.coordinator import Coordinator
from kit.dht.node import get_dht_time
from kit.dht.protocol import STORE, NodeInfo, StoreRequest, StoreResponse, decode, encode
from kit.dht.storage import StoreStatus
from kit.dht.validation import DHTRecord
from kit.dht.values import RecordLimits, pack_key, pack_value
from kit.errors import (
    ConnectionLost,
    HandshakeRefused,
    PeerError,
    Revoked,
    TokenServiceUnavailable,
)
from kit.p2p.api import StreamAPI
from kit.p2p.identity import Identity, PeerID
from kit.p2p.peer import Peer, create_peer
from kit.runtime import get_runtime
from kit.testing.fake_hub import FakeHub
from tests.auth import volunteer_process
from tests.auth.members import CoordinatorMembers
from tests.conftest import TIMEOUT_FACTOR
from tests.test_coordinator import access_coordinator

pytestmark = pytest.mark.sockets
RUN = "sessions"


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def authorizer(
    issuer: TokenIssuer, user: str, identity: Identity, clock: Clock, **settings: object
) -> AllowlistAuthorizer:
    source = IssuerTokenSource(issuer, user, clock=clock)
    return AllowlistAuthorizer(
        identity,
        issuer.authority_public_key,
        source,
        clock=clock,
        **settings,  # type: ignore[arg-type]
    )


async def start(issuer: TokenIssuer, user: str, clock: Clock, **settings: object) -> Peer:
    identity = Identity.generate()
    settings = {"check_period": 0.2, "clock_skew": 10.0, "refresh_before": 40.0, **settings}
    return await create_peer(
        identity=identity,
        authorizer=authorizer(issuer, user, identity, clock, **settings),
        run_id=RUN,
    )


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout * TIMEOUT_FACTOR
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_volunteer_closes_banned_users_and_keys_and_refuses_them() -> None:
    clock = Clock()
    issuer = TokenIssuer(Identity.generate(), RUN)
    volunteer = await start(issuer, "bob", clock)
    carol = await start(issuer, "carol", clock)
    dave = await start(issuer, "dave", clock)
    try:
        volunteer.add_stream_handler("hold", hold)
        streams = []
        for peer in (carol, dave):
            remote = await peer.connect(volunteer.get_visible_addresses()[0], timeout=5)
            streams.append(await peer.open_stream(remote, "hold", timeout=5))
        bans = issuer.revoke(
            usernames=["carol"], peer_public_keys=[dave.identity.public_key], now=clock()
        )
        volunteer.authorizer.update_revocations(bans)  # type: ignore[attr-defined]
        # Within one check period (0.2 s), the volunteer closes both, and says why.
        started = time.monotonic()
        for stream, why in zip(streams, ("user 'carol' is revoked", "is revoked"), strict=True):
            with pytest.raises(ConnectionLost, match=f"unauthorized.*{why}"):
                await stream.receive_message(timeout=5)
        assert time.monotonic() - started < 2.0 * TIMEOUT_FACTOR
        assert not volunteer.connected_peers()
        for peer, why in (
            (carol, "user 'carol' is revoked"),
            (dave, f"peer {dave.peer_id.short()} is revoked"),
        ):
            with pytest.raises(HandshakeRefused, match=why) as refused:
                await peer.connect(volunteer.get_visible_addresses()[0], timeout=5)
            assert refused.value.reason == "unauthorized"
        # A ban by key alone is bypassed with a fresh key: dave's user may get a new token.
        dave_again = await start(issuer, "dave", clock)
        try:
            assert await dave_again.connect(volunteer.get_visible_addresses()[0], timeout=5)
        finally:
            await dave_again.shutdown()
        # carol cannot bring her still-valid token to a fresh key: it names her old one.
        token = AccessToken.from_bytes(await carol.authorizer.credentials())  # type: ignore[attr-defined]
        fresh = Identity.generate()
        stolen = AllowlistAuthorizer(fresh, issuer.authority_public_key, _fixed(token), clock=clock)
        stolen._token, stolen._token_bytes = token, token.to_bytes()
        thief = await create_peer(identity=fresh, authorizer=stolen, run_id=RUN)
        try:
            with pytest.raises(HandshakeRefused, match="issued to peer"):
                await thief.connect(volunteer.get_visible_addresses()[0], timeout=5)
        finally:
            await thief.shutdown()
    finally:
        for peer in (volunteer, carol, dave):
            await peer.shutdown()


async def hold(stream: StreamAPI) -> None:
    while await stream.receive_message(timeout=60) is not None:
        pass


def _fixed(token: AccessToken) -> Callable[[bytes], object]:
    async def source(key: bytes) -> AccessToken:
        return token

    return source


async def test_a_connection_lives_as_long_as_its_token_is_renewed() -> None:
    clock = Clock()
    issuer = TokenIssuer(Identity.generate(), RUN, lifetime=100.0)
    volunteer = await start(issuer, "bob", clock)
    alice = await start(issuer, "alice", clock)  # renews her token
    failing = IssuerTokenSource(issuer, "dave", clock=clock)
    dave_identity = Identity.generate()
    dave_authorizer = authorizer(
        issuer, "dave", dave_identity, clock, check_period=0.2, clock_skew=10.0, refresh_before=40.0
    )

    async def coordinator_gone(key: bytes) -> AccessToken:
        if dave_authorizer.token is None:
            return await failing(key)
        raise TokenServiceUnavailable("the coordinator is unreachable")

    dave_authorizer._source = coordinator_gone
    dave = await create_peer(identity=dave_identity, authorizer=dave_authorizer, run_id=RUN)
    try:
        for peer in (alice, dave):
            await peer.connect(volunteer.get_visible_addresses()[0], timeout=5)
        guard = volunteer.authorizer.session_guard(volunteer)  # type: ignore[attr-defined]
        assert guard is not None
        first = {p: guard.token_of(volunteer.connection(p)) for p in (alice.peer_id, dave.peer_id)}
        clock.now += 85  # both tokens expire in 15 s: the volunteer asks for renewed ones
        alice_token = alice.authorizer  # type: ignore[attr-defined]
        await eventually(
            lambda: alice_token.token.expiration_time > first[alice.peer_id].expiration_time,
            "alice renewing her own token",
        )
        await eventually(
            lambda: (
                guard.token_of(volunteer.connection(alice.peer_id)).expiration_time
                == alice_token.token.expiration_time
            ),
            "the volunteer holding alice's renewed token",
        )
        assert guard.token_of(volunteer.connection(dave.peer_id)) == first[dave.peer_id]
        clock.now += 26  # dave's token expired 11 s ago (clock_skew 10 s), never renewed
        await eventually(lambda: volunteer.connection(dave.peer_id) is None, "dave cut off")
        assert volunteer.connection(alice.peer_id) is not None  # alice's renewed token holds
        assert alice.connection(volunteer.peer_id) is not None  # and the volunteer renewed too
    finally:
        for peer in (volunteer, alice, dave):
            await peer.shutdown()


# --- end to end: a real coordinator, a volunteer in its own process, a revoked user ----------------


async def store_at(peer: Peer, target: PeerID, key: str) -> list[StoreStatus]:
    """One DHT STORE request straight to ``target`` (no routing: only that peer is asked)."""
    limits = RecordLimits()
    record = DHTRecord(pack_key(key, limits), None, pack_value("x", limits), get_dht_time() + 60)
    request = StoreRequest(NodeInfo((), True, 1, get_dht_time()), (record,))
    answer = await peer.call(target, STORE, encode(request), timeout=5)
    return list(decode(StoreResponse, answer).results)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_revoked_user_is_cut_off_at_a_volunteer_and_cannot_come_back(
    tmp_path, monkeypatch
) -> None:
    """carol is connected to a volunteer (its own process), not to the coordinator. The organizer
    bans her: within one check period the VOLUNTEER closes her connection, then refuses her
    dials, her DHT stores, and her token under a fresh key; alice keeps working with it."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as hub:
        for user in ("alice", "bob", "carol"):
            hub.add_user(user, token=f"hf_{user}", token_role="read")
        coordinator = access_coordinator(
            tmp_path / "coordinator",
            hub.endpoint,
            usernames=("alice", "bob", "carol"),
            check_seconds=1.0,
        )
        volunteer = volunteer_process.start(coordinator.join_url, "hf_bob", tmp_path / "bob")
        try:
            assert volunteer.stdout is not None
            address = volunteer.stdout.readline().strip()
            assert address, "the volunteer did not start"
            carol = Visitor(coordinator, address)
            run = get_runtime().call
            try:
                run(carol.connect_and_work(), timeout=60)
                coordinator.revoke(usernames=["carol"], duration=600.0)
                run(carol.cut_off_and_refused(), timeout=60)
            finally:
                run(carol.leave(), timeout=30)
        finally:
            if volunteer.stdin is not None:
                volunteer.stdin.close()
            try:
                volunteer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                volunteer.kill()
                volunteer.wait(timeout=10)
            coordinator.shutdown()


class Visitor:
    """carol (banned halfway) and alice (never banned), each with a peer of her own, on the
    runtime loop; they know the volunteer only, never dial the coordinator's peer."""

    def __init__(self, coordinator: Coordinator, address: str) -> None:
        self.coordinator = coordinator
        self.address = address
        self.members = CoordinatorMembers(coordinator)
        self.join = self.members.join
        self.leave = self.members.leave

    async def connect_and_work(self) -> None:
        carol = await self.join("carol")
        self.volunteer = await carol.connect(self.address, timeout=10)
        assert self.volunteer != self.coordinator.dht.peer_id
        self.stream = await carol.open_stream(self.volunteer, "test/hold", timeout=10)
        await self.stream.send_message(b"hi", timeout=10)
        assert await self.stream.receive_message(timeout=10) == b"hi"
        assert await store_at(carol, self.volunteer, "carol-was-here") == [StoreStatus.STORED]
        assert carol.connection(self.coordinator.dht.peer_id) is None  # she knows the volunteer

    async def cut_off_and_refused(self) -> None:
        carol = self.members.peers["carol"]
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="unauthorized.*user 'carol' is revoked"):
            await self.stream.receive_message(timeout=30)
        took = time.monotonic() - started
        assert took < 1.0 + 10.0 * TIMEOUT_FACTOR, f"closed after {took:.1f} s"  # one check
        with pytest.raises(HandshakeRefused, match="revoked") as refused:  # her dials
            await carol.connect(self.address, timeout=10)
        assert refused.value.reason == "unauthorized"
        with pytest.raises((HandshakeRefused, PeerError)):  # her stores (any request at all)
            await store_at(carol, self.volunteer, "carol-again")
        with pytest.raises(Revoked, match="help:"):  # a fresh key gets no token: bans are by user
            await self.join("carol")
        # alice, allowlisted and not banned, goes on with the volunteer.
        alice = await self.join("alice")
        assert await alice.connect(self.address, timeout=10) == self.volunteer
        assert await store_at(alice, self.volunteer, "alice-was-here") == [StoreStatus.STORED]

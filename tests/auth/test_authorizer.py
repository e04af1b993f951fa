"""The allowlist authorizer in real handshakes between loopback peers, and every attack on it.

A run here is a fake Hub, a coordinator peer that serves the token endpoint, and volunteers
that join with their HF tokens (``tests.auth.allowlisted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import websockets.asyncio.client
import websockets.asyncio.server

from kit.auth import (
    AccessToken,
    AllowlistAuthorizer,
    IssuerTokenSource,
    enforce_revocations,
    publish_revocations,
)
from kit.dht import DHTConfig, DHTNode, get_dht_time
from kit.dht.protocol import PING
from kit.errors import (
    BadSignature,
    ConfigError,
    HandshakeRefused,
    MalformedToken,
    NotAllowlisted,
    PeerError,
    Revoked,
    TokenExpired,
    TokenMismatch,
    TokenServiceUnavailable,
    UnknownProtocol,
)
from kit.p2p import wire
from kit.p2p.frame_auth import AuthenticatedChannel
from kit.p2p.handshake import DialerHandshake, HandshakeSettings, RemoteHello
from kit.p2p.identity import Identity, PeerID
from kit.p2p.peer import Peer
from kit.p2p.wire import FrameType
from tests.auth.allowlisted import RUN_ID, AllowlistedRun, allowlisted_run
from tests.conftest import MS

pytestmark = pytest.mark.sockets


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request + caller.to_bytes()


class Presenting:
    """An authorizer that presents fixed credentials and admits everyone (an attacker's)."""

    def __init__(self, credentials: bytes = b"") -> None:
        self._credentials = credentials

    async def credentials(self) -> bytes:
        return self._credentials

    async def authorize(self, remote: RemoteHello) -> None:
        return None


async def refusal(run: AllowlistedRun, credentials: bytes, identity: Identity | None = None) -> str:
    """Dial the coordinator with ``credentials``; return the refusal message the dialer gets."""
    peer = await run.start_peer(identity or Identity.generate(), Presenting(credentials))
    before = run.coordinator.connection(peer.peer_id)  # the genuine holder of ``identity``'s
    with pytest.raises(HandshakeRefused) as refused:
        await peer.connect(run.coordinator.get_visible_addresses()[0], timeout=5)
    assert refused.value.reason == "unauthorized"
    assert run.coordinator.connection(peer.peer_id) is before  # nothing new was admitted
    return refused.value.message


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(20 * MS)


async def test_allowlisted_users_join_and_call_each_other() -> None:
    async with allowlisted_run() as run:
        run.coordinator.add_unary_handler("echo", echo)
        alice, bob = await run.join("alice"), await run.join("bob")  # by name / by org
        alice.add_unary_handler("echo", echo)
        assert await alice.call(run.coordinator.peer_id, "echo", b"hi", timeout=5) == (
            b"hi" + alice.peer_id.to_bytes()
        )
        assert await bob.connect(alice.get_visible_addresses()[0], timeout=5) == alice.peer_id
        assert await bob.call(alice.peer_id, "echo", b"", timeout=5) == bob.peer_id.to_bytes()
        connection = alice.connection(bob.peer_id)
        assert connection is not None and connection.remote.frame_auth  # private run: MACs on
        assert isinstance(connection.channel, AuthenticatedChannel)
        assert run.coordinator_authorizer.token is not None
        assert run.coordinator_authorizer.token.username == "@coordinator"


async def test_an_unlisted_user_gets_no_token_and_a_peer_without_one_is_refused() -> None:
    async with allowlisted_run() as run:
        with pytest.raises(NotAllowlisted, match="'mallory'.*help: ask the organizer to add you"):
            await run.join("mallory")
        message = await refusal(run, b"")
        assert "presented no access token" in message and "help:" in message
        assert "not valid msgpack" in await refusal(run, b"\x01garbage")
        # The open peer (default authorizer) cannot even dial a run that admits token holders.
        open_peer = await run.start_peer(Identity.generate(), None)
        with pytest.raises(HandshakeRefused, match="unauthorized"):
            await open_peer.connect(run.coordinator.get_visible_addresses()[0], timeout=5)


async def test_a_forged_token_is_refused() -> None:
    async with allowlisted_run() as run:
        thief = Identity.generate()
        forged = AccessToken.sign(Identity.generate(), "alice", thief.public_key, RUN_ID, 9e9)
        message = await refusal(run, forged.to_bytes(), thief)
        assert "not signed by this run's authority" in message and "help:" in message


async def test_an_expired_token_is_refused() -> None:
    async with allowlisted_run() as run:
        holder = Identity.generate()
        an_hour_ago = time.time() - 3600
        expired = run.issuer.issue("alice", holder.public_key, now=an_hour_ago)  # 30 min tokens
        message = await refusal(run, expired.to_bytes(), holder)
        assert "expired" in message and "raise clock_skew" in message


async def test_a_stolen_token_is_useless_and_a_peer_id_cannot_be_claimed() -> None:
    async with allowlisted_run() as run:
        alice = await run.join("alice")
        authorizer: AllowlistAuthorizer = alice.authorizer  # type: ignore[assignment]
        assert authorizer.token is not None
        stolen = authorizer.token.to_bytes()
        # Mallory copies alice's token but has her own key: the token names alice's key.
        message = await refusal(run, stolen)
        assert f"issued to peer {alice.peer_id.short()}" in message and "do not copy" in message
        # Mallory claims alice's public key (and PeerID) too, with alice's token: she passes the
        # authorizer, but cannot sign the handshake transcript without alice's private key.
        genuine = run.coordinator.connection(alice.peer_id)
        impostor = Impersonating(alice.identity.public_key, Identity.generate())
        code = await raw_handshake(run.coordinator, impostor, stolen)
        assert code == "protocol_error"  # BadSignature: "the dialer's handshake signature ..."
        assert run.coordinator.connection(alice.peer_id) is genuine  # alice is unaffected


class Impersonating:
    """An identity that claims someone else's public key but signs with its own private key."""

    def __init__(self, claimed_public_key: bytes, real: Identity) -> None:
        self.public_key = claimed_public_key
        self.peer_id = PeerID.from_public_key(claimed_public_key)
        self._real = real

    def sign(self, data: bytes) -> bytes:
        return self._real.sign(data)


async def raw_handshake(listener: Peer, identity: Any, credentials: bytes) -> str:
    """Handshake with ``listener`` as ``identity``; return the GOAWAY code it answers with."""
    url = f"ws://127.0.0.1:{listener.listen_port}/"
    async with websockets.asyncio.client.connect(url, compression=None) as websocket:
        handshake = DialerHandshake(identity, HandshakeSettings(RUN_ID, credentials=credentials))
        await websocket.send(handshake.hello())
        _, auth = handshake.receive_hello(wire.decode_frame(await websocket.recv(), 0))
        await websocket.send(auth)
        return await goaway_code(websocket)


async def goaway_code(websocket: Any) -> str:
    frame = wire.decode_frame(await asyncio.wait_for(websocket.recv(), 5), 0)
    assert frame.type is FrameType.GOAWAY, frame.type
    return wire.decode_reason(frame.payload, "GOAWAY")[0]


@contextlib.asynccontextmanager
async def recording_proxy(target: Peer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A websocket relay to ``target`` that records what dialers send (an eavesdropper)."""
    recorded: list[bytes] = []

    async def relay(client: websockets.asyncio.server.ServerConnection) -> None:
        url = f"ws://127.0.0.1:{target.listen_port}/"
        async with websockets.asyncio.client.connect(url, compression=None) as upstream:

            async def pump(source: Any, sink: Any, record: bool) -> None:
                async for message in source:
                    if record:
                        recorded.append(message)
                    await sink.send(message)

            tasks = [
                asyncio.ensure_future(pump(client, upstream, True)),
                asyncio.ensure_future(pump(upstream, client, False)),
            ]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()

    server = await websockets.asyncio.server.serve(relay, "127.0.0.1", 0, compression=None)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"/ip4/127.0.0.1/tcp/{port}/ws/p2p/{target.peer_id}", recorded
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)


async def test_a_recorded_handshake_cannot_be_replayed() -> None:
    async with allowlisted_run() as run:
        alice = await run.join("alice")
        async with recording_proxy(run.coordinator) as (address, recorded):
            bob = await run.join("bob", connect=False)
            await bob.connect(address, timeout=5)
            assert run.coordinator.connection(bob.peer_id) is not None
            hello, auth = recorded[0], recorded[1]  # bob's HELLO (with his valid token) and AUTH
            assert wire.decode_frame(hello, 0).type is FrameType.HELLO
            assert wire.decode_frame(auth, 0).type is FrameType.AUTH
        await bob.shutdown()
        await eventually(lambda: run.coordinator.connection(bob.peer_id) is None)
        for listener in (run.coordinator, alice):  # replayed to the same peer, or another one
            url = f"ws://127.0.0.1:{listener.listen_port}/"
            async with websockets.asyncio.client.connect(url, compression=None) as replayer:
                await replayer.send(hello)  # the token inside is still valid...
                answer = wire.decode_frame(await asyncio.wait_for(replayer.recv(), 5), 0)
                assert (
                    answer.type is FrameType.HELLO
                )  # ...so the listener answers, with a new nonce
                await replayer.send(auth)  # but the old signature does not cover it
                assert await goaway_code(replayer) == "protocol_error"
            assert listener.connection(bob.peer_id) is None


FAST_DHT = DHTConfig(rpc_timeout=1000 * MS, lookup_timeout=5000 * MS, bootstrap_timeout=5000 * MS)


async def test_a_revoked_user_is_disconnected_and_refused_everywhere() -> None:
    async with allowlisted_run() as run:
        alice, bob = await run.join("alice"), await run.join("bob")
        await bob.connect(alice.get_visible_addresses()[0], timeout=5)
        coordinator_node = await DHTNode.create(run.coordinator, config=FAST_DHT)
        seeds = run.coordinator.get_visible_addresses()
        alice_node = await DHTNode.create(alice, seeds, config=FAST_DHT)
        try:
            guard = alice.authorizer.session_guard(alice)  # type: ignore[attr-defined]
            assert guard is not None and guard.fetch is not None  # reads the DHT's list
            bans = run.issuer.revoke(usernames=["bob"], now=time.time())
            # The coordinator applies the list itself and publishes it for everyone else.
            assert run.coordinator_authorizer.update_revocations(bans)
            assert enforce_revocations(run.coordinator, run.coordinator_authorizer) == [bob.peer_id]
            expiration = get_dht_time() + 600
            assert await publish_revocations(
                coordinator_node, run.issuer.authority, bans, expiration_time=expiration
            )
            # alice's next check (every 30 s by default; one now) reads the list and closes bob
            assert await guard.check() == [bob.peer_id]
            assert alice.connection(bob.peer_id) is None
            await eventually(lambda: bob.connection(alice.peer_id) is None)  # bob was told why
            for listener in (alice, run.coordinator):
                with pytest.raises(HandshakeRefused, match="unauthorized.*'bob' is revoked"):
                    await bob.connect(listener.get_visible_addresses()[0], timeout=5)
            with pytest.raises(Revoked, match="help: ask the organizer"):
                await run.join("bob")  # and no new token either
            assert not run.coordinator_authorizer.update_revocations(bans)  # not newer
            assert alice.connection(run.coordinator.peer_id) is not None  # others unaffected
        finally:
            await alice_node.shutdown()
            await coordinator_node.shutdown()


async def serves_the_dht(caller: Peer, peer_id: PeerID) -> bool:
    try:
        await caller.call(peer_id, PING, b"not a ping", timeout=5)
    except UnknownProtocol:
        return False
    except PeerError:  # a handler refused the bytes: it is there
        return True
    return True


async def test_a_shut_down_dht_node_is_no_longer_read_while_its_peer_runs_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with allowlisted_run() as run:
        alice = await run.join("alice")
        seeds = run.coordinator.get_visible_addresses()
        guard = alice.authorizer.session_guard(alice)  # type: ignore[attr-defined]
        assert guard is not None and guard.fetch is None  # no DHT node yet
        coordinator_node = await DHTNode.create(run.coordinator, config=FAST_DHT)
        first = await DHTNode.create(alice, seeds, config=FAST_DHT)
        try:
            assert guard.fetch is not None
            await first.shutdown()  # (the peer keeps running)
            assert guard.fetch is None
            with caplog.at_level(logging.WARNING, logger="kit.auth.sessions"):
                await guard.check()  # the other checks go on, without a warning about the list
            assert not [r for r in caplog.records if "revocation list" in r.getMessage()]
            # A new node of the same peer serves, and is read, in its place; the old one's
            # late unfollow leaves it alone.
            second = await DHTNode.create(alice, seeds, config=FAST_DHT)
            try:
                assert guard.fetch_through is second
                alice.authorizer.unfollow_dht(first)  # type: ignore[attr-defined]
                assert guard.fetch_through is second and guard.fetch is not None
                assert await serves_the_dht(run.coordinator, alice.peer_id)
            finally:
                await second.shutdown()
            assert guard.fetch is None
            assert not await serves_the_dht(run.coordinator, alice.peer_id)  # its handlers went
        finally:
            await first.shutdown()
            await coordinator_node.shutdown()


async def test_tokens_refresh_before_expiry_and_new_dials_keep_working() -> None:
    settings = {"clock_skew": 0.0, "refresh_before": 1.0}
    async with allowlisted_run(lifetime=2.0, **settings) as run:
        run.coordinator.add_unary_handler("echo", echo)
        started = time.monotonic()
        alice, bob = await run.join("alice", **settings), await run.join("bob", **settings)
        authorizer: AllowlistAuthorizer = alice.authorizer  # type: ignore[assignment]
        first = authorizer.token
        assert first is not None
        await asyncio.sleep(max(0.0, started + 1.2 - time.monotonic()))
        await bob.connect(alice.get_visible_addresses()[0], timeout=5)  # alice renews meanwhile
        await eventually(lambda: authorizer.token != first, timeout=3)
        await asyncio.sleep(max(0.0, first.expiration_time + 0.3 - time.time()))
        assert time.time() > first.expiration_time  # the first token is dead by now...
        message = await refusal(run, first.to_bytes(), alice.identity)
        assert "expired" in message  # ...and refused,
        alice.connection(bob.peer_id).close()  # type: ignore[union-attr]
        await eventually(lambda: alice.connection(bob.peer_id) is None)
        assert await alice.connect(bob.get_visible_addresses()[0], timeout=5) == bob.peer_id
        assert await alice.call(run.coordinator.peer_id, "echo", b"", timeout=5)  # long-lived
        carol = await run.join("alice", **settings)  # a newcomer dials alice's renewed token
        assert await carol.connect(alice.get_visible_addresses()[0], timeout=5) == alice.peer_id


async def test_credentials_wait_for_a_token_only_when_there_is_none() -> None:
    calls = {"count": 0}
    authority, identity = Identity.generate(), Identity.generate()
    now = [1000.0]

    from kit.auth import TokenIssuer

    issuer = TokenIssuer(authority, RUN_ID, lifetime=100)
    inner = IssuerTokenSource(issuer, "alice", clock=lambda: now[0])

    async def source(key: bytes) -> AccessToken:
        calls["count"] += 1
        return await inner(key)

    authorizer = AllowlistAuthorizer(
        identity,
        authority.public_key,
        source,
        refresh_before=10,
        clock_skew=5,
        clock=lambda: now[0],
    )
    first = AccessToken.from_bytes(await authorizer.credentials())
    assert calls["count"] == 1 and first.expiration_time == 1100
    now[0] = 1080  # well before the refresh window: no request
    assert await authorizer.credentials() == first.to_bytes() and calls["count"] == 1
    now[0] = 1095  # in the window: the old token now, a new one in the background
    assert await authorizer.credentials() == first.to_bytes()
    await eventually(lambda: calls["count"] == 2)
    await asyncio.sleep(0)
    assert AccessToken.from_bytes(await authorizer.credentials()).expiration_time == 1195
    now[0] = 2000  # long expired (the machine slept): wait for a new one
    assert AccessToken.from_bytes(await authorizer.credentials()).expiration_time == 2100
    await authorizer.close()


async def test_a_token_source_that_fails_gives_the_reason() -> None:
    authority, identity = Identity.generate(), Identity.generate()

    async def wrong_authority(key: bytes) -> AccessToken:
        return AccessToken.sign(Identity.generate(), "alice", key, RUN_ID, time.time() + 60)

    async def other_key(key: bytes) -> AccessToken:
        return AccessToken.sign(authority, "alice", Identity.generate().public_key, RUN_ID, 9e9)

    async def hanging(key: bytes) -> AccessToken:
        await asyncio.sleep(10)
        raise AssertionError("not reached")

    cases: list[tuple[Callable[[bytes], Awaitable[AccessToken]], type[Exception]]] = [
        (wrong_authority, BadSignature),
        (other_key, TokenMismatch),
        (hanging, TokenServiceUnavailable),
    ]
    for source, error in cases:
        authorizer = AllowlistAuthorizer(identity, authority.public_key, source, fetch_timeout=0.2)
        with pytest.raises(error, match="help:"):
            await authorizer.credentials()
        await authorizer.close()
    with pytest.raises(ConfigError):
        AllowlistAuthorizer(identity, b"short", wrong_authority)


def remote_hello(identity: Identity, credentials: bytes, run_id: str = RUN_ID) -> RemoteHello:
    """A verified hello as the handshake hands it to the authorizer (only these fields matter)."""
    fields: dict[str, Any] = {field.name: None for field in dataclasses.fields(RemoteHello)}
    fields.update(
        peer_id=identity.peer_id,
        public_key=identity.public_key,
        run_id=run_id,
        credentials=credentials,
    )
    return RemoteHello(**fields)


async def test_authorize_checks_each_condition() -> None:
    from kit.auth import TokenIssuer

    issuer = TokenIssuer(Identity.generate(), RUN_ID)
    authorizer = AllowlistAuthorizer.for_coordinator(Identity.generate(), issuer)
    peer = Identity.generate()
    token = issuer.issue("alice", peer.public_key, now=time.time()).to_bytes()
    await authorizer.authorize(remote_hello(peer, token))
    with pytest.raises(MalformedToken):
        await authorizer.authorize(remote_hello(peer, b"\x00"))
    with pytest.raises(TokenMismatch, match="not 'other'"):
        await authorizer.authorize(remote_hello(peer, token, run_id="other"))
    old = issuer.issue("alice", peer.public_key, now=time.time() - 1800 - 61).to_bytes()
    with pytest.raises(TokenExpired):
        await authorizer.authorize(remote_hello(peer, old))
    assert authorizer.update_revocations(
        issuer.revoke(peer_public_keys=[peer.public_key], now=time.time())
    )
    with pytest.raises(Revoked, match="peer .* is revoked"):
        await authorizer.authorize(remote_hello(peer, token))
    with pytest.raises(Revoked):
        authorizer.check_revoked(remote_hello(peer, old))  # expired or not, still revoked
    foreign = issuer.revocations.sign(Identity.generate(), time.time() + 10)
    with pytest.raises(BadSignature):
        authorizer.update_revocations(foreign)

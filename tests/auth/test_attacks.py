"""An attacker's afternoon against an allowlisted run on loopback: every attack is refused, for
the right reason, and the legitimate users still train afterwards.

The run: a real :class:`~kit.coordinator.Coordinator` (token endpoint behind a fake Hugging Face
Hub, DHT, relay, metrics collector, the join notebook's route) and bob's volunteer peer with its DHT node,
as ``kit.join`` starts one. Hub users: alice, bob, carol and dave are allowlisted; mallory is
not. The attacks (the first ten are the ones tried in issue 17):

 1. an unlisted user asks for a token, and dials without one;
 2. forged, expired and foreign-run tokens;
 3. a stolen token under another key;
 4. a recorded handshake replayed;
 5. a byte flipped on the path;
 6. DHT stores without a token, and a member storing under another member's name;
 7. path traversal on the coordinator's HTTP routes;
 8. oversized HTTP headers;
 9. slowloris (an HTTP upgrade that never ends);
10. a revoked user coming back through a volunteer (not the coordinator): her open connection,
    a new dial with her unexpired token, her stores, a fresh key, her token under a fresh key;
11. a member claiming 777 samples it never averaged;
12. 50 bogus HF tokens at the token endpoint (the Hub must not be hammered);
13. reading the allowlist from /api/run;
14. HELLO and AUTH in one write, garbage and half-closed handshakes.

Then alice and dave train a small model together (three global steps), are credited with the
samples they attested to each other, and nothing logged a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets.asyncio.client

import kit
from kit.auth import authorizer_from_coordinator
from kit.auth.tokens import AccessToken
from kit.coordinator import Coordinator
from kit.dht.node import DHTNode, get_dht_time
from kit.dht.protocol import STORE, NodeInfo, StoreRequest, StoreResponse, decode, encode
from kit.dht.storage import StoreStatus
from kit.dht.validation import DHTRecord, owner_marker
from kit.dht.values import RecordLimits, pack_key, pack_subkey, pack_value
from kit.errors import (
    ConnectionLost,
    HandshakeRefused,
    NotAllowlisted,
    PeerError,
    Revoked,
    StreamReset,
)
from kit.metrics import MetricsReporter
from kit.p2p import wire
from kit.p2p.api import StreamAPI
from kit.p2p.handshake import DialerHandshake, HandshakeSettings, RemoteHello
from kit.p2p.identity import Identity, PeerID, b58encode
from kit.p2p.peer import Peer, create_peer
from kit.p2p.websocket import OP_BINARY, apply_mask, frame_header
from kit.p2p.wire import FrameType
from kit.runtime import get_runtime
from kit.testing.fake_hub import FakeHub
from tests.conftest import TIMEOUT_FACTOR
from tests.p2p.test_frame_auth import TamperingProxy
from tests.test_coordinator import access_coordinator
from tests.threads import run_in_threads

pytestmark = [pytest.mark.sockets]

USERS = ("alice", "bob", "carol", "dave")
SECRET = "TOP-SECRET-CONTENT"


def run(coro: Any, timeout: float = 60.0) -> Any:
    return get_runtime().call(coro, timeout=timeout * TIMEOUT_FACTOR)


class Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(f"{record.name}: {record.getMessage()[:200]}")


@dataclasses.dataclass
class World:
    hub: FakeHub
    coordinator: Coordinator
    volunteer: Any  # bob's kit.DHT
    tmp: Path
    tracebacks: Tracebacks
    volunteer_address: str  # bob's peer (read once: blocking calls are not allowed on the loop)
    volunteer_id: PeerID
    volunteer_key: bytes
    peers: list[Peer] = dataclasses.field(default_factory=list)

    @property
    def url(self) -> str:
        return self.coordinator.join_url

    @property
    def authority(self) -> bytes:
        return self.coordinator.issuer.authority_public_key  # type: ignore[no-any-return]

    @property
    def run_id(self) -> str:
        return self.coordinator.config.collaboration.run_id

    async def member(self, user: str, identity: Identity | None = None) -> Peer:
        """A peer of ``user`` with a token from the coordinator (connected to nobody yet)."""
        identity = identity or Identity.generate()
        authorizer = await authorizer_from_coordinator(
            self.url, f"hf_{user}", identity, authority_public_key=self.authority, check_period=1.0
        )
        return await self.peer(identity, authorizer)

    async def peer(self, identity: Identity, authorizer: Any) -> Peer:
        made = await create_peer(identity=identity, authorizer=authorizer, run_id=self.run_id)
        self.peers.append(made)
        return made


async def hold(stream: StreamAPI) -> None:
    while (message := await stream.receive_message(timeout=60)) is not None:
        await stream.send_message(message, timeout=10)


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("attacks")
    (tmp / "secret.txt").write_text(SECRET)
    tracebacks = Tracebacks()
    for name in ("kit", "websockets"):
        logging.getLogger(name).addHandler(tracebacks)
    with FakeHub() as hub:
        for user in (*USERS, "mallory"):
            hub.add_user(user, token=f"hf_{user}", token_role="read")
        coordinator = access_coordinator(
            tmp / "coordinator",
            hub.endpoint,
            usernames=USERS,
            check_seconds=1.0,
            metrics_period=0.5,
        )
        config = coordinator.config
        identity = Identity.generate()
        bob = run(
            authorizer_from_coordinator(
                coordinator.join_url,
                "hf_bob",
                identity,
                authority_public_key=coordinator.issuer.authority_public_key,
                check_period=1.0,
            )
        )
        volunteer = kit.DHT(
            initial_peers=coordinator.addresses,
            host="127.0.0.1",
            client_mode=False,
            peer_options=dict(
                identity=identity, run_id=config.collaboration.run_id, authorizer=bob
            ),
        )

        async def serve(_: Any, node: Any) -> None:
            node.peer.add_stream_handler("test/hold", hold)
            node.peer.add_unary_handler("test/echo", echo, max_request=2**20)

        volunteer.run_coroutine(serve)
        made = World(
            hub,
            coordinator,
            volunteer,
            tmp,
            tracebacks,
            str(volunteer.get_visible_maddrs()[0]),
            volunteer.peer_id,
            identity.public_key,
        )
        try:
            yield made
        finally:

            async def leave() -> None:
                for peer in made.peers:
                    await peer.shutdown()
                    close = getattr(peer.authorizer, "close", None)
                    if close is not None:
                        await close()

            run(leave())
            volunteer.shutdown()
            run(bob.close())
            coordinator.shutdown()
            for name in ("kit", "websockets"):
                logging.getLogger(name).removeHandler(tracebacks)


class Presenting:
    """An authorizer that presents whatever credentials an attacker has, and accepts anyone."""

    private = True

    def __init__(self, credentials: bytes) -> None:
        self._credentials = credentials

    async def credentials(self) -> bytes:
        return self._credentials

    async def authorize(self, remote: RemoteHello) -> None:
        return None


async def refused_at_the_volunteer(world: World, credentials: bytes, identity: Identity) -> str:
    """Dial bob's volunteer with ``credentials``: the refusal's message (it must refuse)."""
    attacker = await world.peer(identity, Presenting(credentials))
    with pytest.raises(HandshakeRefused) as refused:
        await attacker.connect(world.volunteer_address, timeout=10)
    assert refused.value.reason == "unauthorized"
    return str(refused.value)


async def store_at(peer: Peer, target: PeerID, record: DHTRecord) -> tuple[StoreStatus, str]:
    request = StoreRequest(NodeInfo((), True, 1, get_dht_time()), (record,))
    answer = decode(StoreResponse, await peer.call(target, STORE, encode(request), timeout=10))
    return answer.results[0], answer.errors[0]


def plain_record(key: str, subkey: bytes | None = None) -> DHTRecord:
    limits = RecordLimits()
    packed = None if subkey is None else pack_subkey(subkey, limits)
    return DHTRecord(pack_key(key, limits), packed, pack_value("x", limits), get_dht_time() + 60)


# --- 1-3: who may join ------------------------------------------------------------------------


def test_1_an_unlisted_user_gets_no_token_and_a_tokenless_peer_no_connection(world: World) -> None:
    with pytest.raises(NotAllowlisted, match="not on the allowlist"):
        run(world.member("mallory"))

    async def tokenless() -> None:
        stranger = await create_peer(run_id=world.run_id)
        world.peers.append(stranger)
        with pytest.raises(HandshakeRefused, match="presented no access token"):
            await stranger.connect(world.volunteer_address, timeout=10)

    run(tokenless())


def test_2_forged_expired_and_foreign_run_tokens_are_refused(world: World) -> None:
    identity = Identity.generate()
    key, now = identity.public_key, time.time()
    forged = AccessToken.sign(Identity.generate(), "alice", key, world.run_id, now + 600)
    expired = world.coordinator.issuer.issue("alice", key, now=now - 7200)
    foreign = AccessToken.sign(
        world.coordinator.issuer.authority, "alice", key, "other-run", now + 600
    )
    for token, why in (
        (forged, "not signed by this run's authority"),
        (expired, "expired"),
        (foreign, "is for run 'other-run'"),
    ):
        assert why in run(refused_at_the_volunteer(world, token.to_bytes(), identity))


def test_3_a_stolen_token_is_useless_under_another_key(world: World) -> None:
    async def steal() -> str:
        alice = await world.member("alice")
        token = await alice.authorizer.credentials()  # type: ignore[attr-defined]
        return await refused_at_the_volunteer(world, token, Identity.generate())

    assert "was issued to peer" in run(steal())


# --- 4-6: the wire ----------------------------------------------------------------------------


def test_4_a_recorded_handshake_cannot_be_replayed(world: World) -> None:
    async def replay() -> str:
        identity = Identity.generate()
        alice = await authorizer_from_coordinator(
            world.url, "hf_alice", identity, authority_public_key=world.authority
        )
        url = world.volunteer_address.replace("/ip4/127.0.0.1/tcp/", "ws://127.0.0.1:")
        url = url.split("/ws/")[0] + "/"
        settings = HandshakeSettings(world.run_id, credentials=await alice.credentials())
        async with websockets.asyncio.client.connect(url, compression=None) as wire_tap:
            handshake = DialerHandshake(identity, settings)
            hello = handshake.hello()
            await wire_tap.send(hello)
            _, auth = handshake.receive_hello(wire.decode_frame(await wire_tap.recv(), 0))
            await wire_tap.send(auth)  # a genuine session, recorded on the path
            welcome = wire.decode_frame(await wire_tap.recv(), 0)
            assert welcome.type is FrameType.WELCOME
        await alice.close()
        async with websockets.asyncio.client.connect(url, compression=None) as replayer:
            await replayer.send(hello)  # the token inside is still valid...
            assert wire.decode_frame(await replayer.recv(), 0).type is FrameType.HELLO
            await replayer.send(auth)  # ...but the listener's nonce is new
            goaway = wire.decode_frame(await asyncio.wait_for(replayer.recv(), 10), 0)
            return wire.decode_reason(goaway.payload, "GOAWAY")[0]

    assert run(replay()) == "protocol_error"


def test_5_a_byte_flipped_on_the_path_drops_the_connection(world: World) -> None:
    async def tamper() -> None:
        port = int(world.volunteer_address.split("/tcp/")[1].split("/")[0])
        proxy = TamperingProxy(port)  # flips a bit in the dialer's next large write
        proxied = await proxy.start()
        try:
            alice = await world.member("alice")
            address = f"/ip4/127.0.0.1/tcp/{proxied}/ws/p2p/{world.volunteer_id}"
            await alice.connect(address, timeout=10)
            payload = os.urandom(100_000)
            answer = await alice.call(
                world.volunteer_id, "test/echo", payload, timeout=10, max_response=2**20
            )
            assert answer == payload
            proxy.flip = True
            with pytest.raises((ConnectionLost, StreamReset), match="failed authentication"):
                await alice.call(
                    world.volunteer_id, "test/echo", payload, timeout=10, max_response=2**20
                )
            assert proxy.flipped == 1
        finally:
            proxy.close()

    run(tamper())


def test_6_no_store_without_a_token_nor_under_another_members_name(world: World) -> None:
    async def stores() -> None:
        stranger = await create_peer(run_id=world.run_id)
        world.peers.append(stranger)
        stranger.add_address(world.volunteer_id, world.volunteer_address)
        with pytest.raises((HandshakeRefused, PeerError), match="no access token"):
            await store_at(stranger, world.volunteer_id, plain_record("stranger-was-here"))
        alice = await world.member("alice")
        alice.add_address(world.volunteer_id, world.volunteer_address)
        forged = plain_record(
            "bob's-record", owner_marker(world.volunteer_key)
        )  # unsigned, bob's name
        status, error = await store_at(alice, world.volunteer_id, forged)
        assert status is StoreStatus.INVALID and "ForgedRecord" in error

    run(stores())


# --- 7-9: the coordinator's HTTP port -----------------------------------------------------------


def http(port: int, raw: bytes, *, dribble: float = 0.0, half_close: bool = False) -> bytes:
    """Send ``raw`` (byte by byte every ``dribble`` seconds if given; then our EOF if
    ``half_close``); what came back until the server hung up."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        if dribble:
            for byte in raw:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break  # the server hung up on us
                time.sleep(dribble)
        else:
            sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def coordinator_port(world: World) -> int:
    return int(world.url.rsplit(":", 1)[1])


@pytest.mark.parametrize(
    "path",
    [
        "/join.ipynb/../../secret.txt",
        "/../secret.txt",
        "/%2e%2e/%2e%2e/secret.txt",
        "/join.ipynb%2f..%2f..%2fsecret.txt",
        "/api/..%2f..%2fsecret.txt",
        "//secret.txt",
    ],
)
def test_7_path_traversal_reaches_nothing_but_the_routes(world: World, path: str) -> None:
    answer = http(coordinator_port(world), f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert SECRET.encode() not in answer
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
    served = http(coordinator_port(world), b"GET /join.ipynb HTTP/1.1\r\nHost: x\r\n\r\n")
    assert served.startswith(b"HTTP/1.1 200") and b"nbformat" in served  # the route itself


def test_8_oversized_headers_are_refused(world: World) -> None:
    huge = b"GET /api/run HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 100_000 + b"\r\n\r\n"
    answer = http(coordinator_port(world), huge)
    assert answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400", b"HTTP/1.1 414")) or not answer
    fine = http(coordinator_port(world), b"GET /api/run HTTP/1.1\r\nHost: x\r\n\r\n")
    assert fine.startswith(b"HTTP/1.1 200")


def test_9_slowloris_connections_are_cut_and_others_are_served(world: World) -> None:
    port, started = coordinator_port(world), time.monotonic()
    request = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" * 20
    lasted: list[float] = []

    def slow() -> None:
        http(port, request, dribble=0.25)  # ~300 s to send it all
        lasted.append(time.monotonic() - started)

    threads = [threading.Thread(target=slow) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    fine = http(port, b"GET /api/run HTTP/1.1\r\nHost: x\r\n\r\n")
    assert fine.startswith(b"HTTP/1.1 200")  # the dribblers do not block anyone
    for thread in threads:
        thread.join(60)
    assert len(lasted) == 8 and max(lasted) < 10.0 + 10.0 * TIMEOUT_FACTOR  # open_timeout: 10 s


# --- 10-13: bans, credit, logins, the allowlist ---------------------------------------------------


def test_10_a_revoked_user_cannot_come_back_through_a_volunteer(world: World) -> None:
    state: dict[str, Any] = {}

    async def connect() -> None:
        carol = await world.member("carol")
        state["carol"], state["token"] = carol, await carol.authorizer.credentials()  # type: ignore[attr-defined]
        await carol.connect(world.volunteer_address, timeout=10)
        state["stream"] = await carol.open_stream(world.volunteer_id, "test/hold", timeout=10)
        await state["stream"].send_message(b"hi", timeout=10)
        assert await state["stream"].receive_message(timeout=10) == b"hi"
        status, _ = await store_at(carol, world.volunteer_id, plain_record("carol-1"))
        assert status is StoreStatus.STORED
        coordinator = world.coordinator.dht.peer_id
        assert carol.connection(coordinator) is None  # she is connected to the volunteer only

    async def cut_off() -> None:
        carol = state["carol"]
        with pytest.raises(ConnectionLost, match="unauthorized.*user 'carol' is revoked"):
            await state["stream"].receive_message(timeout=30)  # the volunteer closes it
        with pytest.raises(HandshakeRefused, match="revoked"):  # her unexpired token
            await carol.connect(world.volunteer_address, timeout=10)
        with pytest.raises((HandshakeRefused, PeerError)):  # her stores
            await store_at(carol, world.volunteer_id, plain_record("carol-2"))
        with pytest.raises(Revoked):  # a fresh key: no token for her
            await world.member("carol")
        # her still-valid token under a fresh key names her old key
        assert "was issued to peer" in await refused_at_the_volunteer(
            world, state["token"], Identity.generate()
        )

    run(connect())
    started = time.monotonic()
    world.coordinator.revoke(usernames=["carol"], duration=3600.0)
    run(cut_off())
    assert time.monotonic() - started < 1.0 + 15.0 * TIMEOUT_FACTOR


def test_11_a_claim_of_777_samples_never_averaged_is_capped_and_flagged(world: World) -> None:
    async def claim() -> Any:
        dave = await world.member("dave")
        node = await DHTNode.create(dave, world.coordinator.addresses, client_mode=True)
        token = dave.authorizer.token.to_bytes()  # type: ignore[attr-defined]
        reporter = MetricsReporter(
            node, world.run_id, dave.identity, token=lambda: token, period=0.5
        )
        reporter.start()
        reporter.update(epoch=1, samples_total=777, loss=1.0)  # a round of his own, attested
        reporter.attest_round(1, Round(os.urandom(16), [dave.peer_id], [777.0]))  # by himself
        return node, reporter

    node, reporter = run(claim())
    try:
        deadline = time.monotonic() + 30 * TIMEOUT_FACTOR
        while True:
            rows = {row["username"]: row for row in world.coordinator.collector.leaderboard()}
            if "dave" in rows and rows["dave"]["claimed"] == 777:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        time.sleep(1.5)  # the attestation record is read too
        dave = {row["username"]: row for row in world.coordinator.collector.leaderboard()}["dave"]
        assert (dave["samples"], dave["claimed"], dave["flagged"]) == (0, 777, True)
    finally:

        async def stop() -> None:
            await reporter.shutdown(final_store=False)
            await node.shutdown()

        run(stop())


@dataclasses.dataclass
class Round:  # what kit.averaging's RoundResult tells a round listener
    group_id: bytes
    peers: list[PeerID]
    weights: list[float]


def test_12_fifty_bogus_hf_tokens_cost_the_hub_five_calls(world: World) -> None:
    def whoamis() -> int:
        return len([r for r in world.hub.requests if r.path == "/api/whoami-v2"])

    before = whoamis()
    answers = []
    for i in range(50):  # from one address (behind the organizer's reverse proxy)
        request = (
            f"GET /api/token?peer_public_key={b58encode(Identity.generate().public_key)} "
            f"HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n"
            f"Authorization: Bearer hf_bogus_{i}\r\n\r\n"
        )
        answers.append(http(coordinator_port(world), request.encode()))
    assert whoamis() - before == 5
    assert sum(a.startswith(b"HTTP/1.1 429") for a in answers) == 45
    assert all(b"Retry-After" in a for a in answers if a.startswith(b"HTTP/1.1 429"))
    run(world.member("alice"))  # a legitimate login goes through meanwhile


def test_13_the_run_info_does_not_publish_the_allowlist(world: World) -> None:
    body = http(coordinator_port(world), b"GET /api/run HTTP/1.1\r\nHost: x\r\n\r\n")
    info = json.loads(body.split(b"\r\n\r\n", 1)[1])
    assert info["authority_public_key"] and info["initial_peers"]
    assert not any(user in json.dumps(info) for user in USERS)


# --- 14: the handshake itself -------------------------------------------------------------------


def test_14_hello_and_auth_in_one_write_and_garbage_are_refused_at_once(world: World) -> None:
    port = int(world.volunteer_address.split("/tcp/")[1].split("/")[0])
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (
        f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()

    def masked(payload: bytes) -> bytes:
        mask = os.urandom(4)
        body = bytearray(payload)
        apply_mask(body, mask)
        return frame_header(OP_BINARY, len(payload), mask) + bytes(body)

    hello = DialerHandshake(Identity.generate(), HandshakeSettings(world.run_id)).hello()
    auth = wire.encode_control(FrameType.AUTH, 0, {"sig": b"\0" * 64})
    started = time.monotonic()
    answer = http(port, upgrade + masked(hello) + masked(auth))
    assert b"must wait for our HELLO" in answer and time.monotonic() - started < 5.0
    for garbage in (os.urandom(500), upgrade[:50], b"GET /x HTTP/1.1\r\n\r\n" + os.urandom(64)):
        http(port, garbage, half_close=True)  # (test 15 checks that none logged a traceback)


def test_15_the_legitimate_users_still_train_and_are_credited(world: World) -> None:
    """alice and dave train a small model together for three global steps, attest each other's
    rounds, and the leaderboard credits them; nothing logged a traceback all afternoon."""
    import torch

    results: dict[str, Any] = {}
    # Both train from the same moment: a peer whose login and DHT start lag (the machine busy
    # with other tests) would otherwise find the other done with all three epochs alone, every
    # round without it, and nobody to attest it (seen once in 2,200 tests on two workers).
    together = threading.Barrier(2)

    def train(user: str, index: int) -> None:
        identity = Identity.generate()
        authorizer = run(
            authorizer_from_coordinator(
                world.url, f"hf_{user}", identity, authority_public_key=world.authority
            )
        )
        dht = kit.DHT(
            initial_peers=world.coordinator.addresses,
            host="127.0.0.1",
            client_mode=False,
            peer_options=dict(identity=identity, run_id=world.run_id, authorizer=authorizer),
        )
        torch.manual_seed(index)
        model = torch.nn.Linear(8, 2)
        opt = kit.Optimizer(
            dht=dht,
            run_id=world.run_id,
            target_batch_size=32,
            batch_size_per_step=8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            matchmaking_time=5.0,  # (a group of both begins as soon as both are in)
            averaging_timeout=20.0,
            tracker_opts={"min_refresh_period": 0.2, "max_refresh_period": 1.0},
        )

        async def start_reporter(_: Any, node: Any) -> MetricsReporter:
            reporter = MetricsReporter(
                node, world.run_id, identity, token=lambda: authorizer.token.to_bytes(), period=0.5
            )
            reporter.start()
            return reporter

        reporter = dht.run_coroutine(start_reporter)
        opt.add_round_listener(reporter.attest_round)  # as kit.volunteer wires it
        samples, deadline = 0, time.monotonic() + 90
        try:
            together.wait(timeout=60 * TIMEOUT_FACTOR)
            while opt.local_epoch < 3 and time.monotonic() < deadline:
                inputs = torch.randn(8, 8)
                torch.nn.functional.mse_loss(model(inputs), inputs[:, :2]).backward()
                opt.step()
                opt.zero_grad()
                samples += 8
                reporter.update(epoch=opt.local_epoch, samples_total=samples, loss=0.5)
            results[user] = opt.local_epoch
            time.sleep(3.0)  # the last records reach the collector

            async def stop(_: Any, __: Any) -> None:
                await reporter.shutdown()

            dht.run_coroutine(stop)
        finally:
            opt.shutdown()
            dht.shutdown()
            run(authorizer.close())

    run_in_threads(train, [(u, i) for i, u in enumerate(("alice", "dave"))], timeout=150)
    assert results == {"alice": 3, "dave": 3}
    rows = {row["username"]: row for row in world.coordinator.collector.leaderboard()}
    for user in ("alice", "dave"):
        assert rows[user]["attested"] > 0 and rows[user]["samples"] > 0, rows[user]
    assert not world.tracebacks.records, world.tracebacks.records[:5]

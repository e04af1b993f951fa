"""Reporters publish through real DHT nodes on loopback; the collector credits verified users."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kit.auth.authority import TokenIssuer
from kit.dht.node import DHTNode
from kit.errors import ConfigError, KitUsageError
from kit.metrics.attestations import RoundAttestor
from kit.metrics.collector import MetricsCollector
from kit.metrics.reporter import MetricsReporter
from kit.p2p.identity import Identity, PeerID
from kit.p2p.peer import create_peer
from tests.conftest import MS
from tests.dht.swarm import Swarm

RUN = "metrics-test"
PERIOD = 0.2

pytestmark = pytest.mark.sockets


def loopback_swarm() -> Swarm:
    return Swarm(functools.partial(create_peer, host="127.0.0.1", run_id=RUN, relay_service=True))


def reporter(node: DHTNode, token: bytes | None = None, **kwargs: Any) -> MetricsReporter:
    identity = node.peer.identity  # type: ignore[attr-defined]  # kit.p2p.peer.Peer
    made = MetricsReporter(
        node, RUN, identity, token=(lambda: token), period=PERIOD, expiration=30.0, **kwargs
    )
    made.start()
    return made


async def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20_000 * MS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def attestor(node: DHTNode, token: bytes) -> RoundAttestor:
    identity = node.peer.identity  # type: ignore[attr-defined]  # kit.p2p.peer.Peer
    made = RoundAttestor(node, RUN, identity, token=lambda: token, min_interval=PERIOD)
    made.start()
    return made


@dataclasses.dataclass
class Round:  # what a kit.averaging RoundResult tells the attestor
    group_id: bytes
    peers: list[PeerID]
    weights: list[float]


def board(collector: MetricsCollector) -> list[tuple[str, int, bool]]:
    return [(r["username"], r["samples"], r["verified"]) for r in collector.leaderboard()]


async def test_collector_credits_token_holders_and_not_a_peer_with_a_copied_token(
    tmp_path: Path,
) -> None:
    issuer = TokenIssuer(Identity.generate(), RUN)
    state = tmp_path / "state" / "metrics.json"
    async with loopback_swarm() as swarm:
        coordinator = await swarm.add_node()
        alice_node = await swarm.add_node()
        bob_node = await swarm.add_node(client_mode=True)
        mallory_node = await swarm.add_node(client_mode=True)
        now = time.time()

        def token_for(node: DHTNode, user: str) -> bytes:
            key = node.peer.identity.public_key  # type: ignore[attr-defined]
            return issuer.issue(user, key, now=now).to_bytes()

        bob_token = token_for(bob_node, "bob")
        alice_token = token_for(alice_node, "alice")
        reporters = [
            reporter(alice_node, alice_token, username="alice"),
            reporter(bob_node, bob_token, username="bob", client_mode=True),
            reporter(mallory_node, bob_token, username="bob"),  # bob's token, mallory's key
        ]
        # alice and bob average together and attest each other's weights (kit.metrics.ledger);
        # mallory attests a round of her own too, under bob's token: worth nothing.
        attestors = [
            attestor(alice_node, alice_token),
            attestor(bob_node, bob_token),
            attestor(mallory_node, bob_token),
        ]

        def average(epoch: int, alice: float, bob: float) -> None:
            group = Round(os.urandom(16), [alice_node.peer_id, bob_node.peer_id], [alice, bob])
            for made in attestors[:2]:
                made.record(epoch, group)
            fake = Round(os.urandom(16), [mallory_node.peer_id, bob_node.peer_id], [10**6, 1])
            attestors[2].record(epoch, fake)

        collector = MetricsCollector(
            coordinator,
            RUN,
            authority_public_key=issuer.authority_public_key,
            state_path=state,
            period=PERIOD,
        )
        collector.start()
        try:
            for epoch in range(3):
                average(epoch, 64.0, 32.0)
                reporters[0].update(epoch=epoch, loss=3.0 - epoch, samples_total=64 * (epoch + 1))
                reporters[1].update(epoch=epoch, loss=4.0 - epoch, samples_total=32 * (epoch + 1))
                reporters[2].update(epoch=epoch, loss=0.1, samples_total=10**6)

                def caught_up(e: int = epoch) -> bool:
                    return (
                        collector.summary()["global_epoch"] == e
                        and len(collector.loss_curve()) == e + 1
                        and sum(row[1] for row in board(collector)) == 96 * (e + 1)
                    )

                await wait_for(caught_up, f"epoch {epoch} at the collector")
            assert board(collector) == [("alice", 192, True), ("bob", 96, True)]
            curve = collector.loss_curve()
            assert [point.epoch for point in curve] == [0, 1, 2]
            assert all(point.peers == 2 for point in curve)  # mallory is not on the curve
            summary = collector.summary()
            assert summary["peers_online"] == 2 and summary["users"] == 2
            assert all(r.stores >= 1 for r in reporters)
        finally:
            for made in reporters:
                await made.shutdown()
            await collector.shutdown()
        assert state.exists() and not state.with_name("metrics.json.tmp").exists()
        charts = collector.history.points()
        assert charts and any(point["peers"] == 2 for point in charts)

        # a restarted coordinator resumes the counts and the charts; a restarted alice adds a
        # new session
        resumed = MetricsCollector(
            coordinator,
            RUN,
            authority_public_key=issuer.authority_public_key,
            state_path=state,
            period=PERIOD,
        )
        assert board(resumed) == [("alice", 192, True), ("bob", 96, True)]
        assert resumed.history.points() == charts
        resumed.start()
        again = reporter(alice_node, token_for(alice_node, "alice"))
        try:
            again.update(epoch=3, samples_total=16, loss=0.5)
            average(3, 16.0, 0.0)  # bob had nothing to add this time
            await wait_for(lambda: board(resumed)[0][1] == 208, "alice's new session")
            assert board(resumed) == [("alice", 208, True), ("bob", 96, True)]
            rows = {row["username"]: row for row in resumed.leaderboard()}
            assert not any(row["flagged"] for row in rows.values())
        finally:
            await again.shutdown()
            await resumed.shutdown()
            for made in attestors:
                await made.shutdown()


async def test_open_run_uses_declared_names_and_updates_from_a_thread(tmp_path: Path) -> None:
    async with loopback_swarm() as swarm:
        coordinator = await swarm.add_node()
        carol_node = await swarm.add_node()
        carol = reporter(carol_node, username="carol", device="cpu")
        collector = MetricsCollector(coordinator, RUN, authority_public_key=None, period=PERIOD)
        collector.start()
        try:
            # the trainer calls update() from its own thread
            worker = threading.Thread(
                target=carol.update, kwargs={"epoch": 2, "samples_total": 77, "loss": 1.5}
            )
            worker.start()
            worker.join(5)
            await wait_for(lambda: board(collector) == [("carol", 77, False)], "carol's record")
            assert collector.summary()["global_epoch"] == 2
        finally:
            await carol.shutdown()
            await collector.shutdown()


async def test_reporter_rejects_bad_settings_and_unknown_fields() -> None:
    async with loopback_swarm() as swarm:
        node = await swarm.add_node()
        identity = node.peer.identity  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match="help:"):
            MetricsReporter(node, RUN, identity, period=10.0, expiration=5.0)
        made = MetricsReporter(node, RUN, identity, period=PERIOD)
        with pytest.raises(KitUsageError, match="help:"):
            made.update(samples=3)
        made.update(samples_total=3)  # before start(): just recorded
        assert made.record.samples_total == 3
        with pytest.raises(ConfigError):
            MetricsCollector(node, RUN, authority_public_key=None, period=0.0)


async def test_an_unreadable_state_file_is_set_aside(tmp_path: Path) -> None:
    state = tmp_path / "metrics.json"
    state.write_text("{ not json")
    async with loopback_swarm() as swarm:
        node = await swarm.add_node()
        collector = MetricsCollector(node, RUN, authority_public_key=None, state_path=state)
        assert collector.leaderboard() == []
        assert (tmp_path / "metrics.json.unreadable").read_text() == "{ not json"
        await collector.shutdown()
        assert state.exists()  # a fresh, readable state

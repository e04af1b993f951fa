"""MetricsBook (pure): sessions and restarts, verification of names by token, curve, board."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from kit.auth.authority import TokenIssuer
from kit.errors import MetricsStateError
from kit.metrics.book import ANONYMOUS, MetricsBook
from kit.metrics.records import ContributionRecord
from kit.metrics.verification import token_verifier
from kit.p2p.identity import Identity

RUN = "test-run"
T0 = 1_790_000_000.0


class Peer:
    """A peer's key and a helper making its records (as its reporter would)."""

    def __init__(self, username: str, session: str = "s1") -> None:
        self.identity = Identity.generate()
        self.owner = self.identity.public_key
        self.username = username
        self.session = session
        self.token: bytes | None = None

    def record(self, time: float, **changes: Any) -> tuple[bytes, ContributionRecord]:
        fields: dict[str, Any] = {
            "peer_id": self.identity.peer_id.to_bytes(),
            "session": self.session,
            "username": self.username,
            "token": self.token,
            "epoch": 0,
            "loss": None,
            "samples_total": 0,
            "compute_seconds": 0.0,
            "samples_per_second": 0.0,
            "time": time,
            "client_mode": False,
            "auxiliary": False,
            "device": "cpu",
        }
        fields.update(changes)
        return self.owner, ContributionRecord(**fields)


def users(board: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(row["username"], row["samples"]) for row in board]


# --- sessions: duplicates, restarts, stale records ------------------------------------------


def test_open_run_credits_self_declared_names_as_unverified() -> None:
    alice, bob, nameless = Peer("alice"), Peer("bob"), Peer("")
    book = MetricsBook()
    accepted = book.add(
        [
            alice.record(T0, samples_total=300, compute_seconds=7200.0),
            bob.record(T0, samples_total=500, compute_seconds=3600.0),
            nameless.record(T0, samples_total=10),
        ],
        now=T0 + 1,
    )
    assert accepted == 3
    board = book.leaderboard(T0 + 1)
    assert users(board) == [("bob", 500), ("alice", 300), (ANONYMOUS, 10)]
    assert [row["rank"] for row in board] == [1, 2, 3]
    assert board[1]["compute_hours"] == pytest.approx(2.0)
    assert not any(row["verified"] for row in board)


def test_a_record_seen_twice_counts_once_and_counters_never_decrease() -> None:
    alice = Peer("alice")
    book = MetricsBook()
    first = alice.record(T0, samples_total=100, compute_seconds=50.0)
    assert book.add([first], T0) == 1
    assert book.add([first, first], T0 + 10) == 0  # the DHT returns it until it expires
    # a later record with smaller counters (a buggy or lying peer) does not lower the totals
    assert book.add([alice.record(T0 + 5, samples_total=40, compute_seconds=1.0)], T0 + 10) == 1
    (row,) = book.leaderboard(T0 + 10)
    assert row["samples"] == 100 and row["compute_hours"] == pytest.approx(50 / 3600)
    # an older record arriving late is ignored
    assert book.add([alice.record(T0 + 2, samples_total=900)], T0 + 11) == 0
    assert book.leaderboard(T0 + 11)[0]["samples"] == 100


def test_a_restarted_process_adds_to_its_user_instead_of_replacing() -> None:
    before = Peer("alice", session="first")
    after = Peer("alice", session="second")
    after.identity, after.owner = before.identity, before.owner  # same key, new process
    book = MetricsBook()
    book.add([before.record(T0, samples_total=1000)], T0)
    book.add([after.record(T0 + 60, samples_total=200)], T0 + 60)
    book.add([after.record(T0 + 70, samples_total=250)], T0 + 70)
    assert users(book.leaderboard(T0 + 70)) == [("alice", 1250)]
    # two machines of one user add up, and each counts as a peer online
    laptop = Peer("alice")
    book.add([laptop.record(T0 + 71, samples_total=50)], T0 + 71)
    (row,) = book.leaderboard(T0 + 71)
    assert row["samples"] == 1300 and row["peers_online"] == 2


def test_stale_future_and_misattributed_records_are_dropped(caplog: Any) -> None:
    alice, mallory = Peer("alice"), Peer("mallory")
    book = MetricsBook(max_clock_skew=60.0, max_record_age=900.0)
    now = T0 + 10_000
    stale = alice.record(now - 901, samples_total=5)
    future = alice.record(now + 61, samples_total=5)
    # mallory signs a record claiming alice's peer id: the owner key does not match it
    _, forged = alice.record(now, samples_total=10**6)
    with caplog.at_level(logging.DEBUG, logger="kit.metrics.book"):
        assert book.add([stale, future, (mallory.owner, forged)], now) == 0
    assert "not its signer" in caplog.text
    assert book.leaderboard(now) == []
    assert book.add([alice.record(now - 30, samples_total=5)], now) == 1


def test_peers_go_offline_when_their_records_stop() -> None:
    alice = Peer("alice")
    book = MetricsBook(online_window=60.0)
    book.add([alice.record(T0, samples_total=1, samples_per_second=4.0)], T0)
    assert book.summary(T0 + 59)["peers_online"] == 1
    assert book.summary(T0 + 59)["samples_per_second"] == 4.0
    # the same record fetched again later is not a sign of life
    book.add([alice.record(T0, samples_total=1)], T0 + 50)
    summary = book.summary(T0 + 61)
    assert summary["peers_online"] == 0 and summary["samples_per_second"] == 0
    assert book.leaderboard(T0 + 61)[0]["peers_online"] == 0
    assert book.leaderboard(T0 + 61)[0]["last_seen"] == T0


def test_auxiliary_peers_are_online_but_not_on_the_board() -> None:
    helper, alice = Peer("@coordinator"), Peer("alice")
    book = MetricsBook()
    book.add([helper.record(T0, auxiliary=True), alice.record(T0, samples_total=3)], T0)
    summary = book.summary(T0)
    assert summary["peers_online"] == 1 and summary["auxiliary_online"] == 1
    assert users(book.leaderboard(T0)) == [("alice", 3)]


def test_many_sessions_are_folded_into_their_users_totals() -> None:
    book = MetricsBook(max_sessions=2)
    peers = [Peer("alice"), Peer("alice"), Peer("bob"), Peer("carol")]
    for i, peer in enumerate(peers):
        book.add([peer.record(T0 + i, samples_total=10 * (i + 1))], T0 + i)
    assert len(book._sessions) == 2
    assert users(book.leaderboard(T0 + 4)) == [("carol", 40), ("alice", 30), ("bob", 30)]


# --- verified names in authenticated runs ------------------------------------------------------


@pytest.fixture
def issuer() -> TokenIssuer:
    return TokenIssuer(Identity.generate(), RUN, lifetime=1800.0)


def test_a_valid_token_credits_the_user_it_names(issuer: TokenIssuer) -> None:
    alice = Peer("claims-to-be-bob")  # the self-declared name does not matter
    alice.token = issuer.issue("alice", alice.owner, now=T0).to_bytes()
    book = MetricsBook(token_verifier(issuer.authority_public_key, RUN))
    assert book.add([alice.record(T0 + 5, samples_total=64)], T0 + 5) == 1
    (row,) = book.leaderboard(T0 + 5)
    assert (row["username"], row["samples"], row["verified"]) == ("alice", 64, True)


def test_a_token_issued_to_another_key_is_not_credited(issuer: TokenIssuer, caplog: Any) -> None:
    bob, mallory = Peer("bob"), Peer("bob")
    bob.token = issuer.issue("bob", bob.owner, now=T0).to_bytes()
    mallory.token = bob.token  # copied from bob's records in the DHT
    book = MetricsBook(token_verifier(issuer.authority_public_key, RUN))
    with caplog.at_level(logging.DEBUG, logger="kit.metrics"):
        accepted = book.add(
            [bob.record(T0, samples_total=10), mallory.record(T0, samples_total=10**6)], T0
        )
    assert accepted == 1
    assert users(book.leaderboard(T0)) == [("bob", 10)]
    assert "was issued to peer" in caplog.text


def test_a_revoked_user_or_key_is_credited_nothing_more(issuer: TokenIssuer) -> None:
    alice, bob, carol = Peer("alice"), Peer("bob"), Peer("carol")
    for peer in (alice, bob, carol):
        peer.token = issuer.issue(peer.username, peer.owner, now=T0).to_bytes()
    held: list[Any] = [None]  # what the coordinator's authorizer holds now
    book = MetricsBook(
        token_verifier(issuer.authority_public_key, RUN, revocations=lambda: held[0])
    )
    book.add([p.record(T0, samples_total=10) for p in (alice, bob, carol)], T0)
    held[0] = issuer.revoke(usernames=["alice"], peer_public_keys=[bob.owner], now=T0 + 1)
    book.add([p.record(T0 + 5, samples_total=50) for p in (alice, bob, carol)], T0 + 5)
    # Their tokens are still valid, but the bans hold: what they did before stays theirs.
    assert sorted(users(book.leaderboard(T0 + 5))) == [("alice", 10), ("bob", 10), ("carol", 50)]


def test_forged_expired_foreign_and_missing_tokens_are_dropped(issuer: TokenIssuer) -> None:
    other_authority = TokenIssuer(Identity.generate(), RUN)
    other_run = TokenIssuer(issuer.authority, "another-run")
    forged, expired, foreign, missing, garbage = (Peer(name) for name in "vwxyz")
    forged.token = other_authority.issue("v", forged.owner, now=T0).to_bytes()
    expired.token = issuer.issue("w", expired.owner, now=T0 - 4000).to_bytes()
    foreign.token = other_run.issue("x", foreign.owner, now=T0).to_bytes()
    garbage.token = b"\x81\xa1v\x01"  # msgpack, but not a token
    tampered = Peer("t")
    genuine = issuer.issue("t", tampered.owner, now=T0).to_bytes()
    tampered.token = genuine.replace(b"\xa1t", b"\xa1u", 1)  # rename the user in the token
    assert tampered.token != genuine
    book = MetricsBook(token_verifier(issuer.authority_public_key, RUN))
    peers = [forged, expired, foreign, missing, garbage, tampered]
    assert book.add([peer.record(T0, samples_total=5) for peer in peers], T0) == 0
    assert book.leaderboard(T0) == []


# --- the loss curve and the summary -------------------------------------------------------------


def test_loss_curve_weights_each_session_by_its_samples_in_the_epoch() -> None:
    alice, bob = Peer("alice"), Peer("bob")
    book = MetricsBook()
    book.add([alice.record(T0, epoch=0, samples_total=100, loss=5.0)], T0)
    book.add([bob.record(T0 + 1, epoch=0, samples_total=300, loss=4.0)], T0 + 1)
    # epoch 1: alice processes 100 more samples at loss 3, bob 300 more at loss 2
    book.add([alice.record(T0 + 10, epoch=1, samples_total=200, loss=3.0)], T0 + 10)
    book.add([bob.record(T0 + 12, epoch=1, samples_total=600, loss=2.0)], T0 + 12)
    curve = book.loss_curve()
    assert [point.epoch for point in curve] == [0, 1]
    assert curve[0].loss == pytest.approx((100 * 5.0 + 300 * 4.0) / 400)
    assert curve[1].loss == pytest.approx((100 * 3.0 + 300 * 2.0) / 400)
    assert curve[1].peers == 2 and curve[1].time == T0 + 10
    # alice's newer record in epoch 1 replaces her earlier contribution to that point
    book.add([alice.record(T0 + 14, epoch=1, samples_total=500, loss=1.0)], T0 + 14)
    assert book.loss_curve()[1].loss == pytest.approx((400 * 1.0 + 300 * 2.0) / 700)


def test_old_epochs_are_final_and_stragglers_do_not_change_them() -> None:
    alice, late = Peer("alice"), Peer("late")
    book = MetricsBook(open_epochs=1)
    for epoch in range(5):
        book.add([alice.record(T0 + epoch, epoch=epoch, loss=10.0 - epoch)], T0 + epoch)
    frozen = book.loss_curve()
    book.add([late.record(T0 + 6, epoch=1, loss=99.0, samples_total=10**6)], T0 + 6)
    assert book.loss_curve()[:3] == frozen[:3]
    assert [p.loss for p in book.loss_curve()] == [10.0, 9.0, 8.0, 7.0, 6.0]
    assert book.leaderboard(T0 + 6)[0]["username"] == "late"  # its samples still count


def test_the_curve_keeps_at_most_max_points() -> None:
    alice = Peer("alice")
    book = MetricsBook(max_points=3, open_epochs=0)
    for epoch in range(10):
        book.add([alice.record(T0 + epoch, epoch=epoch, loss=1.0)], T0 + epoch)
    assert [p.epoch for p in book.loss_curve()] == [7, 8, 9]


def test_summary_estimates_the_next_step_from_recent_steps() -> None:
    alice, bob = Peer("alice"), Peer("bob")
    book = MetricsBook()
    assert book.summary(T0)["eta_next_step"] is None
    for epoch in range(4):  # a step every 30 s
        at = T0 + 30 * epoch
        book.add(
            [
                alice.record(at, epoch=epoch, loss=2.0, samples_per_second=3.0),
                bob.record(at + 1, epoch=epoch, loss=3.0, samples_per_second=5.0),
            ],
            at + 1,
        )
    summary = book.summary(T0 + 100)
    assert summary["global_epoch"] == 3
    assert summary["seconds_per_step"] == pytest.approx(30.0)
    assert summary["eta_next_step"] == pytest.approx(T0 + 90 + 30 - (T0 + 100))
    assert summary["samples_per_second"] == 8.0 and summary["peers_online"] == 2
    assert summary["loss"] == pytest.approx(2.5)
    json.dumps(summary, allow_nan=False)  # JSON-ready


# --- persistence -------------------------------------------------------------------------------


def test_state_survives_a_coordinator_restart_without_double_counting() -> None:
    alice, bob = Peer("alice"), Peer("bob")
    book = MetricsBook(open_epochs=1)
    for epoch in range(4):
        book.add(
            [
                alice.record(T0 + epoch, epoch=epoch, samples_total=10 * epoch, loss=1.0 + epoch),
                bob.record(T0 + epoch, epoch=epoch, samples_total=7 * epoch, loss=2.0),
            ],
            T0 + epoch,
        )
    restored = MetricsBook.from_json(book.to_json(), open_epochs=1)
    assert restored.loss_curve() == book.loss_curve()
    assert restored.leaderboard(T0 + 5) == book.leaderboard(T0 + 5)
    assert restored.summary(T0 + 5) == book.summary(T0 + 5)
    # the records still in the DHT are fetched again: nothing counts twice
    last = alice.record(T0 + 3, epoch=3, samples_total=30, loss=4.0)
    assert restored.add([last], T0 + 6) == 0
    restored.add([alice.record(T0 + 7, epoch=4, samples_total=45)], T0 + 7)
    assert users(restored.leaderboard(T0 + 7)) == [("alice", 45), ("bob", 21)]


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", '{"version": 99}', '{"version": 1, "sessions": {"k": {"x": 1}}}'],
)
def test_an_unreadable_state_raises_a_typed_error(text: str) -> None:
    with pytest.raises(MetricsStateError, match="help:"):
        MetricsBook.from_json(text)


def test_verifier_is_not_part_of_the_saved_state(issuer: TokenIssuer) -> None:
    alice = Peer("alice")
    alice.token = issuer.issue("alice", alice.owner, now=T0).to_bytes()
    verify = token_verifier(issuer.authority_public_key, RUN)
    book = MetricsBook(verify)
    book.add([alice.record(T0, samples_total=3)], T0)
    restored = MetricsBook.from_json(book.to_json(), verify)
    assert restored.leaderboard(T0)[0]["verified"] is True
    # an unsigned newcomer is still refused after the restart
    assert restored.add([Peer("eve").record(T0 + 1, samples_total=9)], T0 + 1) == 0

"""The attestation ledger (pure): credit is what the OTHER members of a peer's rounds attested,
and the book caps claims at it: a peer claiming 777 samples it never averaged is credited 0."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kit.auth.authority import COORDINATOR_USERNAME, TokenIssuer
from kit.metrics.attestations import AttestationRecord, AttestedRound
from kit.metrics.book import MetricsBook
from kit.metrics.ledger import AttestationLedger
from kit.metrics.verification import token_verifier
from kit.p2p.identity import Identity
from tests.metrics.test_book import RUN, T0, Peer

A, B, C, D, AUX = (bytes([i]) * 34 for i in range(1, 6))


def attests(attester: bytes, *rounds: tuple[bytes, dict[bytes, float]]) -> AttestationRecord:
    made = tuple(AttestedRound(gid, 7, tuple(weights.items())) for gid, weights in rounds)
    return AttestationRecord(attester, None, made)


def ledger_with(users: dict[bytes, str]) -> AttestationLedger:
    ledger = AttestationLedger(settle_after=100.0)
    for peer, user in users.items():
        ledger.note_user(peer, user)
    return ledger


def test_a_member_is_credited_what_the_others_saw_not_what_it_says() -> None:
    ledger = ledger_with({A: "alice", B: "bob"})
    round_1 = os.urandom(16)
    ledger.add(A, "alice", attests(A, (round_1, {A: 777.0, B: 32.0})), T0)  # alice lies
    ledger.add(B, "bob", attests(B, (round_1, {A: 64.0, B: 32.0})), T0)
    assert ledger.credit(A) == 64.0 and ledger.credit(B) == 32.0


def test_own_and_same_user_attestations_count_for_nothing() -> None:
    ledger = ledger_with({A: "mallory", B: "mallory"})  # two peers of one user
    gid = os.urandom(16)
    for peer in (A, B):
        ledger.add(peer, "mallory", attests(peer, (gid, {A: 777.0, B: 777.0})), T0)
    assert ledger.credit(A) == 0.0 and ledger.credit(B) == 0.0


def test_only_members_attest_a_round() -> None:
    ledger = ledger_with({A: "alice", C: "carol"})
    gid = os.urandom(16)
    ledger.add(C, "carol", attests(C, (gid, {A: 500.0})), T0)  # carol was not in it
    assert ledger.credit(A) == 0.0


def test_the_organizers_attestation_decides_and_others_take_the_lower_median() -> None:
    ledger = ledger_with({A: "alice", B: "bob", C: "carol", D: "dave", AUX: COORDINATOR_USERNAME})
    with_aux, three, two = os.urandom(16), os.urandom(16), os.urandom(16)
    members = {A: 64.0, B: 1.0, AUX: 0.0}
    ledger.add(AUX, COORDINATOR_USERNAME, attests(AUX, (with_aux, members)), T0)
    ledger.add(B, "bob", attests(B, (with_aux, {**members, A: 999.0})), T0)  # bob colludes
    assert ledger.credit(A) == 64.0  # the auxiliary peer's word holds
    group = {A: 10.0, B: 1.0, C: 1.0, D: 1.0}
    ledger.add(B, "bob", attests(B, (three, {**group, A: 999.0})), T0)
    ledger.add(C, "carol", attests(C, (three, group)), T0)
    ledger.add(D, "dave", attests(D, (three, group)), T0)
    assert ledger.credit(A) == 64.0 + 10.0  # most of the others saw 10
    pair = {A: 5.0, B: 1.0, C: 1.0}
    ledger.add(B, "bob", attests(B, (two, {**pair, A: 0.0})), T0)  # bob lowers alice's credit
    ledger.add(C, "carol", attests(C, (two, pair)), T0)
    assert ledger.credit(A) == 64.0 + 10.0 + 0.0  # two others disagree: the smaller (documented)


def test_settled_rounds_keep_their_credit_count_once_and_survive_a_restart() -> None:
    ledger = ledger_with({A: "alice", B: "bob"})
    gid = os.urandom(16)
    records = {A: attests(A, (gid, {A: 64.0, B: 32.0})), B: attests(B, (gid, {A: 64.0, B: 32.0}))}
    for peer, user in ((A, "alice"), (B, "bob")):
        ledger.add(peer, user, records[peer], T0)
    ledger.add(A, "alice", attests(A), T0 + 101)  # time passes: the round settles
    assert ledger.credit(A) == 64.0 and ledger.largest_round(A) == 64.0
    for peer, user in ((A, "alice"), (B, "bob")):  # the same records, read again
        assert ledger.add(peer, user, records[peer], T0 + 200) == 0
    restored = AttestationLedger(settle_after=100.0)
    restored.load_state(ledger.to_state())
    assert restored.credit(A) == 64.0 and restored.credit(B) == 32.0
    assert restored.add(A, "alice", records[A], T0 + 300) == 0


@pytest.fixture
def issuer() -> TokenIssuer:
    return TokenIssuer(Identity.generate(), RUN)


def attestation(peer: Peer, rounds: list[tuple[bytes, dict[Peer, float]]]) -> Any:
    made = tuple(
        AttestedRound(gid, 3, tuple((p.identity.peer_id.to_bytes(), w) for p, w in group.items()))
        for gid, group in rounds
    )
    return peer.owner, AttestationRecord(peer.identity.peer_id.to_bytes(), peer.token, made)


def test_the_leaderboard_caps_claims_at_the_attested_credit_and_flags_them(
    issuer: TokenIssuer,
) -> None:
    alice, bob, mallory = Peer("alice"), Peer("bob"), Peer("mallory")
    for peer in (alice, bob, mallory):
        peer.token = issuer.issue(peer.username, peer.owner, now=T0).to_bytes()
    book = MetricsBook(token_verifier(issuer.authority_public_key, RUN), ledger=AttestationLedger())
    rounds = [(os.urandom(16), {alice: 64.0, bob: 32.0}) for _ in range(3)]
    book.add_attestations([attestation(alice, rounds), attestation(bob, rounds)], T0)
    # mallory attests a round of her own and claims 777 samples she never averaged.
    book.add_attestations([attestation(mallory, [(os.urandom(16), {mallory: 777.0})])], T0)
    book.add(
        [
            alice.record(T0, samples_total=3 * 64 + 40),  # a round's worth not yet averaged
            bob.record(T0, samples_total=3 * 32),
            mallory.record(T0, samples_total=777),
        ],
        T0,
    )
    rows = {row["username"]: row for row in book.leaderboard(T0)}
    assert (rows["alice"]["samples"], rows["alice"]["claimed"]) == (192, 232)
    assert (rows["bob"]["samples"], rows["mallory"]["samples"]) == (96, 0)
    assert rows["mallory"]["claimed"] == 777 and rows["mallory"]["flagged"]
    assert not rows["alice"]["flagged"] and not rows["bob"]["flagged"]
    assert [row["username"] for row in book.leaderboard(T0)] == ["alice", "bob", "mallory"]
    # A stolen token does not attest: mallory signs with her key, the token names bob's.
    thief = Peer("bob")
    thief.token = bob.token
    assert book.add_attestations([attestation(thief, [(os.urandom(16), {alice: 1.0})])], T0) == 0
    # The state (and the credit) survive a restart of the coordinator.
    restored = MetricsBook.from_json(
        book.to_json(), token_verifier(issuer.authority_public_key, RUN), ledger=AttestationLedger()
    )
    assert [(r["username"], r["samples"]) for r in restored.leaderboard(T0)] == [
        ("alice", 192),
        ("bob", 96),
        ("mallory", 0),
    ]

"""Round attestations as they travel (pure parsing), and what a RoundAttestor publishes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import msgpack
import pytest

from kit.metrics.attestations import (
    MAX_MEMBERS,
    MAX_ROUNDS,
    AttestationRecord,
    AttestedRound,
    RoundAttestor,
)
from kit.p2p.identity import Identity, PeerID


def a_record(rounds: int = 2) -> AttestationRecord:
    peers = [Identity.generate().peer_id.to_bytes() for _ in range(3)]
    made = tuple(
        AttestedRound(os.urandom(16), epoch, tuple((p, 8.0 * (i + 1)) for i, p in enumerate(peers)))
        for epoch in range(rounds)
    )
    return AttestationRecord(peers[0], b"token", made)


def test_a_record_survives_msgpack() -> None:
    record = a_record()
    wire = msgpack.unpackb(msgpack.packb(record.to_dict(), use_bin_type=True), raw=False)
    assert AttestationRecord.from_dict(wire) == record


def broken(change: str) -> Any:
    body = a_record().to_dict()
    if change == "group id":
        body["rounds"][0][0] = b"short"
    elif change == "weight":
        body["rounds"][0][2][0][1] = -1.0
    elif change == "nan":
        body["rounds"][0][2][0][1] = float("nan")
    elif change == "index":
        body["rounds"][0][2][0][0] = 99
    elif change == "twice":
        body["rounds"][0][2][1][0] = body["rounds"][0][2][0][0]
    elif change == "too many rounds":
        body["rounds"] = body["rounds"] * (MAX_ROUNDS + 1)
    elif change == "epoch":
        body["rounds"][0][1] = True
    elif change == "not a map":
        body = [body]
    return body


@pytest.mark.parametrize(
    "change",
    ["group id", "weight", "nan", "index", "twice", "too many rounds", "epoch", "not a map"],
)
def test_malformed_records_are_dropped(change: str) -> None:
    assert AttestationRecord.from_dict(broken(change)) is None


@dataclasses.dataclass
class Round:
    group_id: bytes
    peers: list[PeerID]
    weights: list[float]


class NoDHT:
    def add_validators(self, validators: Any) -> None:
        pass


def test_the_attestor_keeps_the_newest_rounds_that_fit_one_record() -> None:
    identity = Identity.generate()
    attestor = RoundAttestor(NoDHT(), "run", identity, token=lambda: b"t")  # type: ignore[arg-type]
    me = identity.peer_id
    for epoch in range(MAX_ROUNDS + 10):
        others = [Identity.generate().peer_id for _ in range(3)]
        attestor.record(epoch, Round(os.urandom(16), [me, *others], [1.0, 2.0, 3.0, 4.0]))
    attestor.record(99, Round(os.urandom(16), [me], [1.0, 2.0]))  # one weight per member: no
    record = attestor.current()
    members = {pid for r in record.rounds for pid, _ in r.weights}
    assert len(members) <= MAX_MEMBERS and record.token == b"t"
    assert [r.epoch for r in record.rounds] == list(range(MAX_ROUNDS + 10))[-len(record.rounds) :]
    assert AttestationRecord.from_dict(record.to_dict()) == record

"""Owner-signed records, schema validators, composition, and the checks of storing nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from kit.dht.storage import ValueWithExpiration
from kit.dht.validation import (
    SIGNATURE_TAG,
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    SchemaValidator,
    check_record,
    default_validator,
    find_owners,
    owned_values,
    owner_marker,
    signed_payload,
)
from kit.dht.values import RecordLimits
from kit.errors import (
    ForgedRecord,
    InvalidRecord,
    KitUsageError,
    RecordTooLarge,
    SchemaViolation,
    ValueNotSerializable,
)
from kit.p2p.identity import Identity

ALICE = Identity.generate()
MALLORY = Identity.generate()
LIMITS = RecordLimits()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def record(key: Any, subkey: Any, value: Any, expiration: float = 100.0) -> DHTRecord:
    return DHTRecord(pack(key), None if subkey is None else pack(subkey), pack(value), expiration)


def signed(validator: Any, unsigned: DHTRecord) -> DHTRecord:
    return dataclasses.replace(unsigned, value=validator.sign_value(unsigned))


def test_owner_marker_is_base58_of_the_public_key() -> None:
    marker = owner_marker(ALICE.public_key)
    assert marker.startswith(b"[owner:") and marker.endswith(b"]")
    assert find_owners(record("progress", marker, 1)) == {ALICE.public_key}
    assert find_owners(record(b"run" + marker, None, 1)) == {ALICE.public_key}
    assert Ed25519SignatureValidator(ALICE).local_owner == marker
    with pytest.raises(KitUsageError):
        _ = Ed25519SignatureValidator().local_owner


def test_signed_record_verifies_and_strips_back_to_msgpack() -> None:
    alice = Ed25519SignatureValidator(ALICE)
    original = record("progress", alice.local_owner, {"step": 5})
    wire = signed(alice, original)
    assert wire.value.startswith(original.value)
    assert (
        wire.value[len(original.value) : len(original.value) + len(SIGNATURE_TAG)] == SIGNATURE_TAG
    )
    verifier = Ed25519SignatureValidator()  # any node verifies, with no key of its own
    verifier.validate(wire)
    assert verifier.strip_value(wire) == original.value
    plain = record("public", None, 1)
    assert alice.sign_value(plain) == plain.value  # unowned records stay unsigned
    verifier.validate(plain)


def test_forged_owner_records_are_rejected() -> None:
    alice = Ed25519SignatureValidator(ALICE)
    mallory = Ed25519SignatureValidator(MALLORY)
    verifier = Ed25519SignatureValidator()
    honest = signed(alice, record("progress", alice.local_owner, {"step": 5}))
    two_owners = record("progress", alice.local_owner + mallory.local_owner, 1)
    with pytest.raises(ForgedRecord):
        mallory.sign_value(two_owners)  # a writer cannot sign it either
    forgeries = {
        "unsigned": record("progress", alice.local_owner, {"step": 999}),
        "signed by another key": dataclasses.replace(
            honest,
            value=pack({"step": 999})
            + SIGNATURE_TAG
            + MALLORY.sign(b"whatever, mallory cannot sign for alice"),
        ),
        "value changed": dataclasses.replace(
            honest, value=pack({"step": 6}) + honest.value[len(pack({"step": 5})) :]
        ),
        "expiration extended": dataclasses.replace(honest, expiration_time=1e9),
        "replayed under another key": dataclasses.replace(honest, key=pack("metrics")),
        "mallory adds her key to alice's subkey": dataclasses.replace(
            two_owners,
            value=two_owners.value
            + SIGNATURE_TAG
            + MALLORY.sign(signed_payload(two_owners, two_owners.value)),
        ),
        "truncated signature": dataclasses.replace(honest, value=honest.value[:-1]),
    }
    for name, forged in forgeries.items():
        with pytest.raises(ForgedRecord):
            verifier.validate(forged)
            pytest.fail(f"accepted a forgery: {name}")


def test_schema_validator_checks_decoded_values_under_its_prefix() -> None:
    def check(value: Any, subkey: Any) -> bool:
        return isinstance(value, dict) and isinstance(value.get("step"), int)

    schema = SchemaValidator("run_", check)
    schema.validate(record("run_progress", b"sub", {"step": 1}))
    schema.validate(record("other", None, "anything"))  # not under the prefix
    with pytest.raises(SchemaViolation):
        schema.validate(record("run_progress", b"sub", {"step": "one"}))

    def raises(value: Any, subkey: Any) -> None:
        raise TypeError("expected a dict")

    with pytest.raises(SchemaViolation, match="expected a dict"):
        SchemaValidator("run_", raises).validate(record(b"run_x", None, 1))
    owned = SchemaValidator("run_", check, require_owner=True)
    with pytest.raises(SchemaViolation, match="owner"):
        owned.validate(record("run_progress", b"anonymous", {"step": 1}))


def test_composite_signs_outermost_and_checks_schema_on_the_stripped_value() -> None:
    seen = []

    def check(value: Any, subkey: Any) -> bool:
        seen.append((value, subkey))
        return True

    alice = Ed25519SignatureValidator(ALICE)
    composite = default_validator([SchemaValidator("run_", check, require_owner=True), alice])
    assert len(composite.validators) == 2  # alice's key merged into the default verifier
    original = record("run_progress", alice.local_owner, {"step": 1})
    wire = signed(composite, original)
    composite.validate(wire)
    assert seen == [({"step": 1}, alice.local_owner)]
    assert composite.strip_value(wire) == original.value
    with pytest.raises(ForgedRecord):
        default_validator().validate(original)  # unsigned
    with pytest.raises(KitUsageError):
        CompositeValidator(["not a validator"])  # type: ignore[list-item]


def test_check_record_runs_every_check_a_storing_node_needs() -> None:
    validator = default_validator()
    assert check_record(record("k", None, [1, 2]), validator, LIMITS, now=0.0) == pack([1, 2])
    limits = RecordLimits(max_value_bytes=64)
    with pytest.raises(RecordTooLarge):
        check_record(record("k", None, b"x" * 2000), validator, limits, now=0.0)
    not_msgpack = DHTRecord(pack("k"), None, b"\xc1\xc1", 10.0)
    with pytest.raises(ValueNotSerializable):
        check_record(not_msgpack, validator, LIMITS, now=0.0)
    with pytest.raises(ValueNotSerializable):
        check_record(DHTRecord(b"\xc1", None, pack(1), 10.0), validator, LIMITS, now=0.0)
    with pytest.raises(InvalidRecord):
        check_record(record("k", None, 1, expiration=float("nan")), validator, LIMITS, now=0.0)


def test_owned_values_keeps_entries_with_one_owner_and_a_well_formed_value() -> None:
    alice, bob = Identity.generate().public_key, Identity.generate().public_key

    def entry(value: Any) -> ValueWithExpiration[Any]:
        return ValueWithExpiration(value, 100.0)

    def parse(value: Any) -> int | None:
        return value if isinstance(value, int) else None

    answer = {
        owner_marker(alice): entry(1),
        b"x" + owner_marker(bob): entry(2),
        owner_marker(alice) + owner_marker(bob): entry(3),  # two owners: whose is it?
        b"nobody": entry(4),
        owner_marker(bob): entry("malformed"),
        "not-bytes": entry(5),
    }
    assert sorted(owned_values(answer, parse)) == sorted([(alice, 1), (bob, 2)])
    assert owned_values(None, parse) == [] and owned_values(entry(1), parse) == []

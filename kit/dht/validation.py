"""Record validation: owner-signed records, schema checks, and the checks every storing node runs.

**Owner-signed records.** A key or subkey whose msgpack bytes contain ``[owner:<base58 Ed25519
public key>]`` may only be written by the holder of that key (hivemind's ``[owner:...]``
convention, with Ed25519 instead of RSA). Per-peer records such as training progress and metrics
use the owner marker as their subkey, so no peer can overwrite or forge another's. Byte format of
a signed value::

    value_bytes = inner_msgpack || b"\\xc1kitsig1" || signature (64 bytes)

``0xc1`` is never a valid msgpack type byte, so a signed value cannot be mistaken for plain
msgpack. The Ed25519 signature covers ``msgpack([SIGNED_RECORD_DOMAIN, key, subkey, inner,
expiration_time])``: the whole record, so a signature cannot be replayed under another key or
subkey, nor with a later expiration.

**Schemas.** :class:`SchemaValidator` decodes values stored under a key prefix and passes them
to a check function (e.g. a pydantic model's ``model_validate``), optionally demanding that the
records be owner-signed.

**Composition.** :class:`CompositeValidator` runs several validators: ``sign_value`` in
ascending ``priority``, ``validate`` and ``strip_value`` in descending order (the outermost
layer, added last, is checked and removed first), like hivemind's ``CompositeValidator``.

What this module does not do: storage (``storage``), serialization rules (``values``).
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgpack

from kit.dht.values import (
    VALIDATOR_OVERHEAD_BYTES,
    RecordLimits,
    check_expiration,
    unpack,
    unpack_subkey,
)
from kit.errors import (
    ForgedRecord,
    InvalidRecord,
    KitUsageError,
    RecordTooLarge,
    SchemaViolation,
)
from kit.p2p.identity import PUBLIC_KEY_SIZE, Identity, b58decode, b58encode, verify_signature

SIGNATURE_TAG = b"\xc1kitsig1"
SIGNATURE_SIZE = 64
SIGNED_RECORD_DOMAIN = "kit.dht.signed-record/1"
_OWNER_RE = re.compile(rb"\[owner:([1-9A-HJ-NP-Za-km-z]{32,48})\]")


@dataclasses.dataclass(frozen=True)
class DHTRecord:
    """One record as validators see it: msgpack bytes of key / subkey, value bytes, expiration.

    ``subkey`` is None for a regular value. ``value`` is what travels on the wire: the value's
    msgpack bytes wrapped by whatever the validators added.
    """

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float


class RecordValidator(abc.ABC):
    """Checks (and optionally signs) records; every node of a swarm must run the same ones."""

    #: Order in a :class:`CompositeValidator`: higher priorities wrap (sign) last.
    priority: int = 0

    def sign_value(self, record: DHTRecord) -> bytes:
        """The value bytes to send for a record this node writes (default: unchanged)."""
        return record.value

    @abc.abstractmethod
    def validate(self, record: DHTRecord) -> None:
        """Accept the record or raise a subclass of :class:`~kit.errors.InvalidRecord`."""

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value bytes with what :meth:`sign_value` added removed (default: unchanged)."""
        return record.value

    def merge_with(self, other: RecordValidator) -> bool:
        """Absorb ``other`` into this validator if they are of one kind; True if done."""
        return False


def owner_marker(public_key: bytes) -> bytes:
    """The bytes that mark a key or subkey as owned by ``public_key``: ``b"[owner:<b58>]"``."""
    return b"[owner:" + b58encode(public_key).encode() + b"]"


T = TypeVar("T")


def find_owners(record: DHTRecord) -> set[bytes]:
    """The raw public keys named by ``[owner:...]`` markers in the record's key and subkey."""
    owners = set()
    for part in (record.key, record.subkey or b""):
        for match in _OWNER_RE.finditer(part):
            owners.add(b58decode(match.group(1).decode()))
    return owners


def owned_values(value: Any, parse: Callable[[Any], T | None]) -> list[tuple[bytes, T]]:
    """The entries of a ``node.get`` answer whose subkey has exactly one owner marker, parsed
    (``parse`` returns None for a malformed one: skipped), each with its owner's public key."""
    records: list[tuple[bytes, T]] = []
    if not isinstance(value, dict):
        return records
    for subkey, entry in value.items():
        if not isinstance(subkey, bytes):
            continue
        owners = find_owners(DHTRecord(b"", subkey, b"", 0.0))
        if len(owners) != 1:
            continue
        record = parse(getattr(entry, "value", None))
        if record is not None:
            records.append((next(iter(owners)), record))
    return records


def signed_payload(record: DHTRecord, inner_value: bytes) -> bytes:
    """The bytes an owner signs: the whole record, with a domain tag."""
    fields = [SIGNED_RECORD_DOMAIN, record.key, record.subkey, inner_value, record.expiration_time]
    return msgpack.packb(fields, use_bin_type=True)


class Ed25519SignatureValidator(RecordValidator):
    """Owner-signed records: ``[owner:<public key>]`` in a key or subkey demands its signature.

    Every node verifies; a node signs the records of the identities it was given. Use
    :attr:`local_owner` as a subkey (or inside a key) to publish a record only you can change::

        validator = Ed25519SignatureValidator(identity)
        dht = kit.dht.DHT(initial_peers, record_validators=[validator])
        dht.store("run_progress", progress, get_dht_time() + 60, subkey=validator.local_owner)

    Args:
        identities: keys this node may sign with. None or empty: verify only. An identity is
            not a peer's identity file on purpose: the file is locked by the running peer.
    """

    priority = 10  # outermost: signs the final inner value, is stripped first

    def __init__(self, identities: Identity | Iterable[Identity] | None = None) -> None:
        if isinstance(identities, Identity):
            identities = [identities]
        self._identities: dict[bytes, Identity] = {}
        for identity in identities or ():
            self._identities[identity.public_key] = identity

    @property
    def local_owner(self) -> bytes:
        """The owner marker of this validator's first identity, e.g. for use as a subkey."""
        if not self._identities:
            raise KitUsageError(
                "this Ed25519SignatureValidator holds no identity - help: pass one, e.g. "
                "Ed25519SignatureValidator(kit.p2p.identity.Identity.generate())"
            )
        return owner_marker(next(iter(self._identities)))

    #: hivemind's name for :attr:`local_owner`.
    local_public_key = local_owner

    def merge_with(self, other: RecordValidator) -> bool:
        if not isinstance(other, Ed25519SignatureValidator):
            return False
        self._identities.update(other._identities)
        return True

    def _owner(self, record: DHTRecord) -> bytes | None:
        owners = find_owners(record)
        if len(owners) > 1:
            raise ForgedRecord(
                "a record's key and subkey name different owners - help: mark a record with "
                "one [owner:...] key only"
            )
        return next(iter(owners), None)

    def sign_value(self, record: DHTRecord) -> bytes:
        owner = self._owner(record)
        identity = self._identities.get(owner) if owner is not None else None
        if identity is None:
            return record.value
        signature = identity.sign(signed_payload(record, record.value))
        return record.value + SIGNATURE_TAG + signature

    def validate(self, record: DHTRecord) -> None:
        owner = self._owner(record)
        if owner is None:
            return
        if len(owner) != PUBLIC_KEY_SIZE:
            raise ForgedRecord(f"[owner:...] names a {len(owner)}-byte key, not an Ed25519 key")
        trailer = len(SIGNATURE_TAG) + SIGNATURE_SIZE
        value = record.value
        if len(value) < trailer or value[-trailer:-SIGNATURE_SIZE] != SIGNATURE_TAG:
            raise ForgedRecord(
                f"record owned by [owner:{b58encode(owner)}] carries no signature - help: only "
                "the owner's DHT can write it; add Ed25519SignatureValidator(<owner identity>) "
                "to record_validators of the DHT that stores it"
            )
        inner, signature = value[:-trailer], value[-SIGNATURE_SIZE:]
        if not verify_signature(owner, signature, signed_payload(record, inner)):
            raise ForgedRecord(f"bad signature on a record owned by [owner:{b58encode(owner)}]")

    def strip_value(self, record: DHTRecord) -> bytes:
        trailer = len(SIGNATURE_TAG) + SIGNATURE_SIZE
        value = record.value
        if self._owner(record) is None or value[-trailer:-SIGNATURE_SIZE] != SIGNATURE_TAG:
            return value
        return value[:-trailer]


#: A schema check: gets the decoded value (and decoded subkey, or None); rejects it by raising
#: (ValueError, TypeError, a pydantic ValidationError...) or by returning False.
ValueCheck = Callable[[Any, Any], object]


class SchemaValidator(RecordValidator):
    """Checks the decoded values stored under keys that start with ``prefix``.

    Args:
        prefix: str keys starting with it are checked (bytes keys: ``prefix.encode()``).
        check: called as ``check(value, subkey)``; subkey is None for regular values.
        require_owner: also demand an ``[owner:...]`` marker (so records must be signed), as
            hivemind's ``BytesWithPublicKey`` subkey type does for progress records.
    """

    priority = 0  # innermost: sees the value once signatures are stripped

    def __init__(self, prefix: str, check: ValueCheck, *, require_owner: bool = False) -> None:
        self.prefix = prefix
        self.check = check
        self.require_owner = require_owner

    def _applies(self, key_bytes: bytes) -> bool:
        try:
            key = unpack(key_bytes, what="key")
        except InvalidRecord:
            return False
        if isinstance(key, str):
            return key.startswith(self.prefix)
        return isinstance(key, bytes) and key.startswith(self.prefix.encode())

    def validate(self, record: DHTRecord) -> None:
        if not self._applies(record.key):
            return
        if self.require_owner and not find_owners(record):
            raise SchemaViolation(
                f"records under {self.prefix!r} must be owner-signed - help: use "
                "Ed25519SignatureValidator(identity).local_owner as the subkey"
            )
        value = unpack(record.value)
        subkey = None if record.subkey is None else unpack_subkey(record.subkey)
        try:
            accepted = self.check(value, subkey)
        except Exception as e:  # the check is user code: any failure is a rejection
            raise SchemaViolation(f"value under {self.prefix!r} fails its schema: {e}") from None
        if accepted is False:
            raise SchemaViolation(f"value under {self.prefix!r} fails its schema")


class CompositeValidator(RecordValidator):
    """Several validators as one; validators of one kind are merged (their keys pooled)."""

    def __init__(self, validators: Iterable[RecordValidator] = ()) -> None:
        self._validators: list[RecordValidator] = []
        self.extend(validators)

    @property
    def validators(self) -> tuple[RecordValidator, ...]:
        return tuple(self._validators)

    def extend(self, validators: Iterable[RecordValidator]) -> None:
        for validator in validators:
            if not isinstance(validator, RecordValidator):
                raise KitUsageError(
                    f"{validator!r} is not a RecordValidator - help: pass instances such as "
                    "Ed25519SignatureValidator(identity) or SchemaValidator(prefix, check)"
                )
            if not any(held.merge_with(validator) for held in self._validators):
                self._validators.append(validator)
        self._validators.sort(key=lambda validator: validator.priority)

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def validate(self, record: DHTRecord) -> None:
        for validator in reversed(self._validators):
            validator.validate(record)
            record = dataclasses.replace(record, value=validator.strip_value(record))

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value


def default_validator(extra: Iterable[RecordValidator] = ()) -> CompositeValidator:
    """What every kit DHT node runs: owner signatures are always verified, plus ``extra``."""
    return CompositeValidator([Ed25519SignatureValidator(), *extra])


def check_record(
    record: DHTRecord, validator: RecordValidator, limits: RecordLimits, now: float
) -> bytes:
    """Every check a node runs on a record before storing it; returns the inner msgpack value.

    Expired records pass (storage reports them as expired); everything else that is wrong
    raises a typed error.

    Raises:
        RecordTooLarge, ValueNotSerializable, ForgedRecord, SchemaViolation, InvalidRecord.
    """
    if len(record.key) > limits.max_key_bytes:
        raise RecordTooLarge(f"key of {len(record.key)} bytes > {limits.max_key_bytes}")
    if record.subkey is not None and len(record.subkey) > limits.max_subkey_bytes:
        raise RecordTooLarge(f"subkey of {len(record.subkey)} bytes > {limits.max_subkey_bytes}")
    if len(record.value) > limits.max_value_bytes + VALIDATOR_OVERHEAD_BYTES:
        raise RecordTooLarge(f"value of {len(record.value)} bytes > {limits.max_value_bytes}")
    check_expiration(record.expiration_time, now, limits)
    unpack(record.key, what="key")
    if record.subkey is not None:
        unpack_subkey(record.subkey)
    validator.validate(record)
    inner = validator.strip_value(record)
    if len(inner) > limits.max_value_bytes:
        raise RecordTooLarge(f"value of {len(inner)} bytes > {limits.max_value_bytes}")
    unpack(inner)
    return inner

"""The bookkeeping of Kademlia lookups and of the values they gather, pure (no I/O, no clocks).

:class:`Lookup` keeps the candidates of one iterative lookup (Kademlia §2.3); :class:`ValueSearch`
validates and merges the values that replicas return. A few helpers convert between stored
entries and records. The async driver that sends the requests is ``kit.dht.node``.

What this module does not do: send anything, read clocks, decide where to store.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from kit.dht.protocol import MAX_RECORDS_PER_STORE, FoundValue
from kit.dht.routing import DHTID, Contact
from kit.dht.storage import (
    DHTStorage,
    DictionaryDHTValue,
    StoredEntry,
    StoreStatus,
    ValueWithExpiration,
)
from kit.dht.validation import DHTRecord, RecordValidator, check_record
from kit.dht.values import RecordLimits, unpack, unpack_subkey
from kit.errors import InvalidRecord

logger = logging.getLogger(__name__)

#: Bytes of records in one store request (records are batched up to this).
STORE_BATCH_BYTES = 1024 * 1024


class CandidateState(enum.Enum):
    """Where one node stands in one lookup."""

    NEW = "new"
    QUERYING = "querying"
    RESPONDED = "responded"
    FAILED = "failed"


class Lookup:
    """Bookkeeping of one iterative lookup (Kademlia §2.3), without I/O.

    The driver asks :meth:`next_to_query` for up to alpha nodes, sends them requests, and reports
    each outcome with :meth:`responded` (with the contacts the node returned) or :meth:`failed`.
    The lookup is finished when the ``beam`` closest non-failed nodes it heard of have all
    responded: querying every one of them, not only the last round's, is what makes the result
    converge on the true nearest nodes even when a round brings nobody closer.
    """

    def __init__(self, target: int, beam: int, exclude: Collection[int] = ()) -> None:
        self.target = target
        self.beam = beam
        self._exclude = set(exclude)
        self._order: list[tuple[int, DHTID]] = []  # (distance, id), sorted
        self._states: dict[DHTID, CandidateState] = {}
        self._contacts: dict[DHTID, Contact] = {}

    def add(self, candidates: Iterable[tuple[DHTID, Contact]]) -> None:
        for node_id, contact in candidates:
            if node_id in self._exclude:
                continue
            if node_id not in self._states:
                self._states[node_id] = CandidateState.NEW
                bisect.insort(self._order, (node_id ^ self.target, node_id))
            if self._states[node_id] is CandidateState.NEW:
                self._contacts[node_id] = contact

    def _beam(self) -> Iterator[DHTID]:
        taken = 0
        for _, node_id in self._order:
            if taken >= self.beam:
                return
            if self._states[node_id] is not CandidateState.FAILED:
                taken += 1
                yield node_id

    def next_to_query(self, limit: int) -> list[tuple[DHTID, Contact]]:
        chosen: list[tuple[DHTID, Contact]] = []
        for node_id in self._beam():
            if len(chosen) >= limit:
                break
            if self._states[node_id] is CandidateState.NEW:
                self._states[node_id] = CandidateState.QUERYING
                chosen.append((node_id, self._contacts[node_id]))
        return chosen

    def responded(self, node_id: DHTID, found: Iterable[tuple[DHTID, Contact]] = ()) -> None:
        self._states[node_id] = CandidateState.RESPONDED
        self.add(found)

    def failed(self, node_id: DHTID) -> None:
        self._states[node_id] = CandidateState.FAILED

    @property
    def finished(self) -> bool:
        return all(self._states[node_id] is CandidateState.RESPONDED for node_id in self._beam())

    def nearest_responded(self, k: int) -> list[tuple[DHTID, Contact]]:
        """The ``k`` closest nodes that answered, nearest first."""
        found: list[tuple[DHTID, Contact]] = []
        for _, node_id in self._order:
            if len(found) >= k:
                break
            if self._states[node_id] is CandidateState.RESPONDED:
                found.append((node_id, self._contacts[node_id]))
        return found


class CheckedRecords:
    """Records (exact bytes, expiration included) that passed :func:`check_record` lately.

    A record valid once stays valid (its signature covers those bytes; an expiration not too
    far ahead then is not later), so a node polling one key (matchmaking: hundreds of subkeys,
    several polls a second) checks each record once, not at every poll. Bounded: forgets all
    at ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: set[DHTRecord] = set()

    def __contains__(self, record: DHTRecord) -> bool:
        return record in self._records

    def add(self, record: DHTRecord) -> None:
        if len(self._records) >= self.capacity:
            self._records.clear()
        if self.capacity:
            self._records.add(record)


class ValueSearch:
    """The value of one key as gathered from replicas: validated, then merged by expiration.

    Merging follows the storage rules (later expiration wins, subkeys merge one by one), so a
    ``latest=True`` get returns the union of the freshest subkeys that any replica holds, as
    hivemind's search does.

    Args:
        key: msgpack bytes of the key.
        sufficient_expiration: the search is :meth:`done` once the merged value expires at or
            after this (``now``: any live value; ``inf``: ask every replica on the way).
    """

    def __init__(
        self,
        key: bytes,
        sufficient_expiration: float,
        validator: RecordValidator,
        limits: RecordLimits,
        *,
        max_subkeys: int,
        max_dictionary_bytes: int,
        checked: CheckedRecords | None = None,
    ) -> None:
        self.key = key
        self.key_id = DHTID.from_key_bytes(key)
        self.sufficient_expiration = sufficient_expiration
        self.holders: set[DHTID] = set()
        self._validator = validator
        self._limits = limits
        self._merged = DHTStorage(1, max_subkeys, max_dictionary_bytes)
        self._checked = checked if checked is not None else CheckedRecords(0)

    def add_entry(self, entry: StoredEntry, now: float) -> None:
        """Merge a local entry (its records were validated when stored)."""
        for record in entry_records(entry, now):
            store_record(self._merged, self.key_id, record, now)

    def add_found(self, found: FoundValue, holder: DHTID, now: float) -> None:
        """Merge what a remote node returned; records that fail validation are dropped."""
        if found.subkeys is not None:
            records = [DHTRecord(self.key, sub, value, exp) for sub, value, exp in found.subkeys]
        else:
            assert found.value is not None
            records = [DHTRecord(self.key, None, found.value, found.expiration_time)]
        merged = self._merged.get(self.key_id, now)
        held = merged.value if merged is not None else None
        for record in records:
            same = (
                held.get(record.subkey, now)
                if isinstance(held, DictionaryDHTValue) and record.subkey is not None
                else None
            )
            if (
                same is not None
                and same.value == record.value
                and same.expiration_time == record.expiration_time
            ):  # another replica's copy of a record already checked: skip the signature work
                self.holders.add(holder)
                continue
            if record not in self._checked:
                try:
                    check_record(record, self._validator, self._limits, now)
                except InvalidRecord as e:
                    logger.debug("dropped a record from %r: %s", holder, e)
                    continue
                self._checked.add(record)
            if store_record(self._merged, self.key_id, record, now) is StoreStatus.STORED:
                self.holders.add(holder)

    def entry(self, now: float) -> StoredEntry | None:
        return self._merged.get(self.key_id, now)

    def done(self, now: float) -> bool:
        entry = self.entry(now)
        return entry is not None and entry.expiration_time >= self.sufficient_expiration

    def result(self, now: float) -> ValueWithExpiration[Any] | None:
        """The merged value, decoded for the user."""
        entry = self.entry(now)
        if entry is None:
            return None
        validator = self._validator
        if isinstance(entry.value, bytes):
            record = DHTRecord(entry.key, None, entry.value, entry.expiration_time)
            return ValueWithExpiration(unpack(validator.strip_value(record)), entry.expiration_time)
        items: dict[Any, ValueWithExpiration[Any]] = {}
        for subkey, item in entry.value.items(now):
            record = DHTRecord(entry.key, subkey, item.value, item.expiration_time)
            value = unpack(validator.strip_value(record))
            items[unpack_subkey(subkey)] = ValueWithExpiration(value, item.expiration_time)
        if not items:
            return None
        return ValueWithExpiration(items, max(item.expiration_time for item in items.values()))


def store_record(storage: DHTStorage, key_id: int, record: DHTRecord, now: float) -> StoreStatus:
    """Store a regular or subkey record into ``storage``."""
    if record.subkey is None:
        return storage.store(key_id, record.key, record.value, record.expiration_time, now)
    return storage.store_subkey(
        key_id, record.key, record.subkey, record.value, record.expiration_time, now
    )


def entry_records(entry: StoredEntry, now: float) -> list[DHTRecord]:
    """The records (one per live subkey) that make up a stored entry."""
    if isinstance(entry.value, bytes):
        return [DHTRecord(entry.key, None, entry.value, entry.expiration_time)]
    return [
        DHTRecord(entry.key, subkey, item.value, item.expiration_time)
        for subkey, item in entry.value.items(now)
    ]


def found_value(entry: StoredEntry, now: float) -> FoundValue:
    """A stored entry as a find response carries it."""
    if isinstance(entry.value, DictionaryDHTValue):
        subkeys = tuple(
            (sub, item.value, item.expiration_time) for sub, item in entry.value.items(now)
        )
        return FoundValue(entry.expiration_time, subkeys=subkeys)
    return FoundValue(entry.expiration_time, value=entry.value)


def found_size(found: FoundValue) -> int:
    """Roughly how many bytes a found value adds to a response."""
    if found.subkeys is not None:
        return sum(len(sub) + len(value) + 16 for sub, value, _ in found.subkeys)
    return len(found.value or b"")


def batches(records: Sequence[DHTRecord]) -> Iterator[list[DHTRecord]]:
    """Records grouped into store requests of bounded count and size."""
    batch: list[DHTRecord] = []
    size = 0
    for record in records:
        record_size = len(record.key) + len(record.subkey or b"") + len(record.value)
        if batch and (
            len(batch) >= MAX_RECORDS_PER_STORE or size + record_size > STORE_BATCH_BYTES
        ):
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += record_size
    if batch:
        yield batch

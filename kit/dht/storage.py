"""Expiring DHT records held by one node, with hivemind's conflict rules; pure (``now`` passed in).

Rules (hivemind ``dht/storage.py`` semantics):

* A record lives until its absolute ``expiration_time``. Storing an already expired record fails.
* A key holds either one regular value or a dictionary of subkeys (:class:`DictionaryDHTValue`),
  each subkey with its own expiration; the dictionary expires with its latest subkey.
* Later expiration wins: a store whose expiration is earlier than the one held is rejected, for
  the whole key and for each subkey. A regular value replaces a dictionary (and vice versa) only
  if it expires later than everything the dictionary holds.
* Equal expirations: an identical re-store succeeds without change (so republishing is
  idempotent), a different value is rejected (the first one stays, as in hivemind).

Values are stored as the bytes that travel on the wire (msgpack, plus signatures if any); this
module never decodes them. It does not validate records either (``validation`` does).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ValueWithExpiration(Generic[T]):
    """A value and its absolute expiration time; unpacks as ``value, expiration_time = item``."""

    value: T
    expiration_time: float

    def __iter__(self) -> Iterator[Any]:
        return iter((self.value, self.expiration_time))

    def __getitem__(self, index: int) -> Any:
        return (self.value, self.expiration_time)[index]

    def __len__(self) -> int:
        return 2

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ValueWithExpiration):
            return (self.value, self.expiration_time) == (other.value, other.expiration_time)
        if isinstance(other, tuple):
            return (self.value, self.expiration_time) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((ValueWithExpiration, self.expiration_time))


class StoreStatus(enum.IntEnum):
    """The outcome of storing one record (also sent back by storing nodes)."""

    STORED = 1  # accepted (or an identical copy was already held)
    OUTDATED = 2  # a record with a later (or equal) expiration is held
    EXPIRED = 3  # the record's expiration time has passed
    INVALID = 4  # failed validation (bad signature, schema, not msgpack, too large)
    FULL = 5  # a storage limit (subkeys or bytes of one key) is reached
    REFUSED = 6  # the node does not store for others (client mode, shutting down)


def _compare(
    held_value: bytes, held_expiration: float, value: bytes, expiration: float
) -> StoreStatus | None:
    """None if the new record wins, or the status that rejects it."""
    if expiration > held_expiration:
        return None
    if expiration == held_expiration and value == held_value:
        return StoreStatus.STORED
    return StoreStatus.OUTDATED


class DictionaryDHTValue:
    """The subkeys of one key, each with its own value bytes and expiration time.

    Args:
        max_subkeys: subkeys held at once; new subkeys beyond it are refused (``FULL``).
        max_bytes: bytes of subkeys + values held at once; likewise.
    """

    def __init__(self, max_subkeys: int, max_bytes: int) -> None:
        self.max_subkeys = max_subkeys
        self.max_bytes = max_bytes
        self.latest_expiration_time = float("-inf")
        self._items: dict[bytes, ValueWithExpiration[bytes]] = {}
        self._nbytes = 0
        # No subkey expires before this (a lower bound): sweeps skip until it passes, so that
        # merging an N-subkey dictionary costs O(N), not O(N^2) (a matchmaking key of 256 peers
        # took 3 s per get before).
        self._earliest_expiration = float("inf")

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def store(self, subkey: bytes, value: bytes, expiration_time: float, now: float) -> StoreStatus:
        if expiration_time < now:
            return StoreStatus.EXPIRED
        held = self._items.get(subkey)
        if held is not None and held.expiration_time >= now:
            status = _compare(held.value, held.expiration_time, value, expiration_time)
            if status is not None:
                return status
        self.remove_expired(now)
        held = self._items.get(subkey)
        held_bytes = 0 if held is None else len(subkey) + len(held.value)
        too_many = held is None and len(self._items) >= self.max_subkeys
        if too_many or self._nbytes - held_bytes + len(subkey) + len(value) > self.max_bytes:
            return StoreStatus.FULL
        self._items[subkey] = ValueWithExpiration(value, expiration_time)
        self._nbytes += len(subkey) + len(value) - held_bytes
        self._earliest_expiration = min(self._earliest_expiration, expiration_time)
        self.latest_expiration_time = max(self.latest_expiration_time, expiration_time)
        return StoreStatus.STORED

    def get(self, subkey: bytes, now: float) -> ValueWithExpiration[bytes] | None:
        item = self._items.get(subkey)
        return item if item is not None and item.expiration_time >= now else None

    def items(self, now: float) -> list[tuple[bytes, ValueWithExpiration[bytes]]]:
        """The subkeys that have not expired, as a snapshot."""
        return [(sub, item) for sub, item in self._items.items() if item.expiration_time >= now]

    def remove_expired(self, now: float) -> None:
        if now <= self._earliest_expiration:
            return
        for subkey in [sub for sub, item in self._items.items() if item.expiration_time < now]:
            item = self._items.pop(subkey)
            self._nbytes -= len(subkey) + len(item.value)
        self._earliest_expiration = min(
            (item.expiration_time for item in self._items.values()), default=float("inf")
        )


@dataclasses.dataclass
class StoredEntry:
    """What one node holds under one key: the key's msgpack bytes and a value or dictionary."""

    key: bytes
    value: bytes | DictionaryDHTValue
    expiration_time: float


class DHTStorage:
    """Records held by one node (or its cache), keyed by DHTID, with expiration and limits.

    Args:
        max_records: keys held at once; past it, the record that expires first is evicted.
            Increase it if you see ``evicted`` counts grow on a busy public node.
        max_subkeys: subkeys per key (see :class:`DictionaryDHTValue`).
        max_dictionary_bytes: bytes per dictionary; keep it well below the RPC message limit.
    """

    def __init__(self, max_records: int, max_subkeys: int, max_dictionary_bytes: int) -> None:
        self.max_records = max_records
        self.max_subkeys = max_subkeys
        self.max_dictionary_bytes = max_dictionary_bytes
        self.evicted = 0
        self._entries: dict[int, StoredEntry] = {}
        self._heap: list[tuple[float, int]] = []  # (expiration, key_id); stale items skipped

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._entries

    def store(
        self, key_id: int, key: bytes, value: bytes, expiration_time: float, now: float
    ) -> StoreStatus:
        """Store a regular value under ``key_id`` (later expiration wins)."""
        if expiration_time < now:
            return StoreStatus.EXPIRED
        held = self.get(key_id, now)
        if held is not None:
            if isinstance(held.value, bytes):
                status = _compare(held.value, held.expiration_time, value, expiration_time)
                if status is not None:
                    return status
            elif expiration_time <= held.expiration_time:
                return StoreStatus.OUTDATED
        self._put(key_id, StoredEntry(key, value, expiration_time), now)
        return StoreStatus.STORED

    def store_subkey(
        self,
        key_id: int,
        key: bytes,
        subkey: bytes,
        value: bytes,
        expiration_time: float,
        now: float,
    ) -> StoreStatus:
        """Store one subkey of a dictionary value (per-subkey later expiration wins)."""
        if expiration_time < now:
            return StoreStatus.EXPIRED
        held = self.get(key_id, now)
        if held is not None and isinstance(held.value, bytes):
            if expiration_time <= held.expiration_time:
                return StoreStatus.OUTDATED
            held = None  # a later subkey replaces the regular value
        if held is None:
            dictionary = DictionaryDHTValue(self.max_subkeys, self.max_dictionary_bytes)
            status = dictionary.store(subkey, value, expiration_time, now)
            if status is StoreStatus.STORED:
                self._put(key_id, StoredEntry(key, dictionary, expiration_time), now)
            return status
        assert isinstance(held.value, DictionaryDHTValue)
        status = held.value.store(subkey, value, expiration_time, now)
        if status is StoreStatus.STORED and expiration_time > held.expiration_time:
            held.expiration_time = expiration_time
            heapq.heappush(self._heap, (expiration_time, key_id))
        return status

    def get(self, key_id: int, now: float) -> StoredEntry | None:
        """What is held under ``key_id``, or None if nothing (or only expired records)."""
        entry = self._entries.get(key_id)
        if entry is None:
            return None
        if entry.expiration_time < now:
            del self._entries[key_id]
            return None
        if isinstance(entry.value, DictionaryDHTValue):
            entry.value.remove_expired(now)
        return entry

    def remove(self, key_id: int) -> None:
        self._entries.pop(key_id, None)

    def items(self, now: float) -> list[tuple[int, StoredEntry]]:
        """Every non-expired entry, as a snapshot."""
        self.remove_expired(now)
        return list(self._entries.items())

    def remove_expired(self, now: float) -> int:
        """Drop expired records; returns how many keys were dropped."""
        dropped = 0
        while self._heap and self._heap[0][0] < now:
            expiration, key_id = heapq.heappop(self._heap)
            entry = self._entries.get(key_id)
            if entry is not None and entry.expiration_time == expiration:
                del self._entries[key_id]
                dropped += 1
        for entry in self._entries.values():
            if isinstance(entry.value, DictionaryDHTValue):
                entry.value.remove_expired(now)
        return dropped

    def _put(self, key_id: int, entry: StoredEntry, now: float) -> None:
        if key_id not in self._entries and len(self._entries) >= self.max_records:
            self.remove_expired(now)
            while len(self._entries) >= self.max_records and self._heap:
                expiration, victim = heapq.heappop(self._heap)
                held = self._entries.get(victim)
                if held is not None and held.expiration_time == expiration:
                    del self._entries[victim]
                    self.evicted += 1
        self._entries[key_id] = entry
        heapq.heappush(self._heap, (entry.expiration_time, key_id))
        if len(self._heap) > 4 * max(len(self._entries), 64):  # drop stale heap items
            self._heap = [(e.expiration_time, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

"""Pure storage: expiration with explicit ``now``, later-expiration-wins, subkeys, limits."""

from __future__ import annotations

from kit.dht.storage import DHTStorage, DictionaryDHTValue, StoreStatus, ValueWithExpiration

KEY = b"\xa3key"
STORED, OUTDATED, EXPIRED, FULL = (
    StoreStatus.STORED,
    StoreStatus.OUTDATED,
    StoreStatus.EXPIRED,
    StoreStatus.FULL,
)


def storage(**limits: int) -> DHTStorage:
    return DHTStorage(
        limits.get("max_records", 100),
        limits.get("max_subkeys", 100),
        limits.get("max_dictionary_bytes", 10_000),
    )


def test_value_with_expiration_unpacks_like_hivemind() -> None:
    item = ValueWithExpiration({"a": 1}, 12.5)
    value, expiration = item
    assert value == {"a": 1} and expiration == 12.5
    assert item[0] == {"a": 1} and item[1] == 12.5
    assert item == ({"a": 1}, 12.5) and item == ValueWithExpiration({"a": 1}, 12.5)
    assert item != ValueWithExpiration({"a": 2}, 12.5)


def test_records_expire_at_their_expiration_time() -> None:
    held = storage()
    assert held.store(1, KEY, b"v", expiration_time=10.0, now=0.0) is STORED
    entry = held.get(1, now=10.0)
    assert entry is not None and entry.value == b"v" and entry.key == KEY
    assert held.get(1, now=10.01) is None
    assert held.store(2, KEY, b"v", expiration_time=5.0, now=6.0) is EXPIRED
    held.store(3, KEY, b"v", expiration_time=20.0, now=0.0)
    held.store(4, KEY, b"v", expiration_time=30.0, now=0.0)
    assert held.remove_expired(now=25.0) == 1
    assert 4 in held and 3 not in held


def test_later_expiration_wins_and_earlier_is_rejected() -> None:
    held = storage()
    assert held.store(1, KEY, b"first", 10.0, now=0.0) is STORED
    assert held.store(1, KEY, b"older", 9.0, now=0.0) is OUTDATED
    assert held.store(1, KEY, b"different", 10.0, now=0.0) is OUTDATED  # equal: first stays
    assert held.store(1, KEY, b"first", 10.0, now=0.0) is STORED  # identical: idempotent
    assert held.store(1, KEY, b"newer", 11.0, now=0.0) is STORED
    entry = held.get(1, now=0.0)
    assert entry is not None and (entry.value, entry.expiration_time) == (b"newer", 11.0)


def test_subkeys_have_their_own_expiration_and_later_wins_per_subkey() -> None:
    held = storage()
    assert held.store_subkey(1, KEY, b"a", b"a1", 10.0, now=0.0) is STORED
    assert held.store_subkey(1, KEY, b"b", b"b1", 20.0, now=0.0) is STORED
    assert held.store_subkey(1, KEY, b"a", b"a0", 9.0, now=0.0) is OUTDATED
    assert held.store_subkey(1, KEY, b"a", b"a2", 15.0, now=0.0) is STORED
    entry = held.get(1, now=0.0)
    assert entry is not None and isinstance(entry.value, DictionaryDHTValue)
    assert entry.expiration_time == 20.0
    assert dict(entry.value.items(now=0.0)) == {
        b"a": ValueWithExpiration(b"a2", 15.0),
        b"b": ValueWithExpiration(b"b1", 20.0),
    }
    assert [sub for sub, _ in entry.value.items(now=16.0)] == [b"b"]  # a expired on its own
    assert held.get(1, now=20.5) is None  # the dictionary expires with its latest subkey


def test_regular_values_and_dictionaries_replace_each_other_only_when_later() -> None:
    held = storage()
    held.store(1, KEY, b"regular", 10.0, now=0.0)
    assert held.store_subkey(1, KEY, b"a", b"x", 9.0, now=0.0) is OUTDATED
    assert held.store_subkey(1, KEY, b"a", b"x", 11.0, now=0.0) is STORED
    entry = held.get(1, now=0.0)
    assert entry is not None and isinstance(entry.value, DictionaryDHTValue)
    assert held.store(1, KEY, b"regular", 11.0, now=0.0) is OUTDATED
    assert held.store(1, KEY, b"regular", 12.0, now=0.0) is STORED
    entry = held.get(1, now=0.0)
    assert entry is not None and entry.value == b"regular"


def test_dictionary_limits_refuse_new_subkeys_but_allow_updates() -> None:
    held = storage(max_subkeys=2)
    held.store_subkey(1, KEY, b"a", b"1", 10.0, now=0.0)
    held.store_subkey(1, KEY, b"b", b"1", 10.0, now=0.0)
    assert held.store_subkey(1, KEY, b"c", b"1", 10.0, now=0.0) is FULL
    assert held.store_subkey(1, KEY, b"a", b"2", 11.0, now=0.0) is STORED
    assert held.store_subkey(1, KEY, b"c", b"1", 30.0, now=10.5) is STORED  # b expired: room
    small = DictionaryDHTValue(max_subkeys=100, max_bytes=10)
    assert small.store(b"a", b"12345678", 5.0, now=0.0) is STORED
    assert small.store(b"b", b"12", 5.0, now=0.0) is FULL
    assert small.nbytes == 9


def test_max_records_evicts_the_record_that_expires_first() -> None:
    held = storage(max_records=3)
    for key_id, expiration in ((1, 30.0), (2, 10.0), (3, 20.0)):
        held.store(key_id, KEY, b"v", expiration, now=0.0)
    held.store(1, KEY, b"v", 40.0, now=0.0)  # an update does not evict
    assert len(held) == 3 and held.evicted == 0
    held.store(4, KEY, b"v", 50.0, now=0.0)
    assert 2 not in held and {1, 3, 4} <= {k for k, _ in held.items(now=0.0)}
    assert held.evicted == 1

"""msgpack-only DHT data: serialization, strict decoding, size limits, expiration checks."""

from __future__ import annotations

import datetime
import math

import msgpack
import pytest

from kit.dht.values import (
    RecordLimits,
    check_expiration,
    pack_key,
    pack_subkey,
    pack_value,
    unpack,
    unpack_subkey,
)
from kit.errors import ConfigError, InvalidRecord, RecordTooLarge, ValueNotSerializable

LIMITS = RecordLimits()


def test_plain_data_round_trips() -> None:
    value = {"step": 3, "loss": 1.25, "peers": ["a", "b"], "blob": b"\x00\x01", "none": None}
    assert unpack(pack_value(value, LIMITS)) == value
    assert unpack(pack_value((1, 2), LIMITS)) == [1, 2]  # tuples come back as lists
    assert unpack_subkey(pack_subkey((1, "a"), LIMITS)) == (1, "a")  # subkeys stay hashable
    assert pack_key("key", LIMITS) == msgpack.packb("key", use_bin_type=True)


@pytest.mark.parametrize("bad", [object(), datetime.datetime(2020, 1, 1), {1, 2}, 2**70])
def test_non_msgpack_values_raise_a_typed_error_with_help(bad: object) -> None:
    with pytest.raises(ValueNotSerializable, match="help:"):
        pack_value(bad, LIMITS)
    with pytest.raises(ValueNotSerializable):
        pack_key(bad, LIMITS)


def test_unhashable_subkeys_are_rejected() -> None:
    with pytest.raises(ValueNotSerializable, match="hashable"):
        pack_subkey({"a": 1}, LIMITS)


def test_size_limits() -> None:
    limits = RecordLimits(max_key_bytes=32, max_subkey_bytes=32, max_value_bytes=100)
    pack_value(b"x" * 90, limits)
    with pytest.raises(RecordTooLarge, match="max_value_bytes"):
        pack_value(b"x" * 100, limits)
    with pytest.raises(RecordTooLarge):
        pack_key("k" * 40, limits)
    with pytest.raises(RecordTooLarge):
        pack_subkey("s" * 40, limits)
    with pytest.raises(ConfigError):
        RecordLimits(max_value_bytes=0)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never used in msgpack
        b"\x01\x02",  # trailing data
        b"\x92\x01",  # truncated
        msgpack.packb(msgpack.ExtType(5, b"x")),  # extension types are code, not data
        b"\x91" * 100_000,  # nesting bomb
    ],
)
def test_strict_decoding_rejects_non_msgpack(data: bytes) -> None:
    with pytest.raises(ValueNotSerializable):
        unpack(data)


def test_expiration_must_be_finite_and_not_too_far() -> None:
    limits = RecordLimits(max_ttl=100.0)
    assert check_expiration(50, now=0.0, limits=limits) == 50.0
    assert check_expiration(-5.0, now=0.0, limits=limits) == -5.0  # expired: storage says so
    for bad in (math.nan, math.inf, "10", True, None):
        with pytest.raises(InvalidRecord, match="help:"):
            check_expiration(bad, now=0.0, limits=limits)
    with pytest.raises(InvalidRecord, match="max_ttl"):
        check_expiration(101.0, now=0.0, limits=limits)

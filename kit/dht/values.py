"""What may be stored in kit's DHT: msgpack data within size limits, and how it is (de)serialized.

Keys, subkeys and values are plain msgpack data (None, bool, int, float, str, bytes, lists, dicts),
as in hivemind. There is no pickle and no custom extension type, so a record stored by one peer
can never make another peer run code. Tuples are sent as msgpack arrays and come back as lists
(subkeys come back as tuples, so they stay hashable).

What this module does not hold: storage and expiration (``storage``), signatures and schemas
(``validation``), messages (``protocol``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import msgpack

from kit.errors import ConfigError, InvalidRecord, RecordTooLarge, ValueNotSerializable

#: Room left above ``max_value_bytes`` for what validators add to a value (signatures).
VALIDATOR_OVERHEAD_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class RecordLimits:
    """Size and lifetime limits of DHT records, enforced by the writer and by every storing node.

    All nodes of one swarm should use the same limits, or stores near a limit will succeed on
    some replicas and fail on others.
    """

    # fmt: off
    max_key_bytes: int = 4096  # msgpack bytes of one key; keys are hashed, so this only bounds memory
    max_subkey_bytes: int = 4096  # msgpack bytes of one subkey; [owner:...] subkeys are ~52 bytes
    max_value_bytes: int = 64 * 1024  # msgpack bytes of one value; increase if you see RecordTooLarge for legitimate records
    max_ttl: float = 30 * 24 * 3600.0  # expiration at most this far ahead; bounds how long a record can squat a key
    # fmt: on

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_subkey_bytes", "max_value_bytes"):
            if getattr(self, name) < 16:
                raise ConfigError(f"RecordLimits.{name} must be >= 16 - help: keep the default")
        if not self.max_ttl > 0:
            raise ConfigError("RecordLimits.max_ttl must be > 0 seconds - help: keep the default")


def _reject_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed in DHT data")


def _pack(obj: Any, what: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueNotSerializable(
            f"DHT {what} {obj!r:.80} is not msgpack data ({e}) - help: store plain data "
            "(None, bool, int, float, str, bytes, lists, dicts), e.g. tensor.tolist() or bytes"
        ) from None


def _check_size(data: bytes, limit: int, what: str, field: str) -> None:
    if len(data) > limit:
        raise RecordTooLarge(
            f"DHT {what} is {len(data)} bytes serialized, more than the limit of {limit} - help: "
            f"store less (e.g. a hash or a URL of the data), or raise RecordLimits.{field} on "
            "every node of the swarm"
        )


def pack_key(key: Any, limits: RecordLimits) -> bytes:
    """msgpack bytes of a key (what is hashed into its DHTID).

    Raises:
        ValueNotSerializable, RecordTooLarge.
    """
    data = _pack(key, "key")
    _check_size(data, limits.max_key_bytes, "key", "max_key_bytes")
    return data


def pack_subkey(subkey: Any, limits: RecordLimits) -> bytes:
    """msgpack bytes of a subkey; it must decode back to something hashable (no maps)."""
    data = _pack(subkey, "subkey")
    _check_size(data, limits.max_subkey_bytes, "subkey", "max_subkey_bytes")
    unpack_subkey(data)
    return data


def pack_value(value: Any, limits: RecordLimits) -> bytes:
    """msgpack bytes of a value.

    Raises:
        ValueNotSerializable: not msgpack data.
        RecordTooLarge: larger than ``limits.max_value_bytes``.
    """
    data = _pack(value, "value")
    _check_size(data, limits.max_value_bytes, "value", "max_value_bytes")
    return data


def unpack(data: bytes, *, what: str = "value", use_list: bool = True) -> Any:
    """Decode one msgpack object, strictly: no extension types, no trailing bytes.

    Raises:
        ValueNotSerializable: ``data`` is not exactly one msgpack object.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=use_list,
            strict_map_key=False,
            ext_hook=_reject_extension,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueNotSerializable(f"DHT {what} bytes are not one msgpack object: {e}") from None


def unpack_subkey(data: bytes) -> Hashable:
    """Decode a subkey; arrays come back as tuples so that it can be a dict key."""
    subkey = unpack(data, what="subkey", use_list=False)
    try:
        hash(subkey)
    except TypeError:
        raise ValueNotSerializable(
            f"DHT subkey {subkey!r:.80} is not hashable - help: use str, bytes or int subkeys"
        ) from None
    return subkey  # type: ignore[no-any-return]


def check_expiration(expiration_time: object, now: float, limits: RecordLimits) -> float:
    """An expiration time as a float, or a typed error if it cannot be accepted.

    Expired times are *not* an error here: storage reports them as ``StoreStatus.EXPIRED``.

    Raises:
        InvalidRecord: not a finite number, or further ahead than ``limits.max_ttl``.
    """
    if isinstance(expiration_time, bool) or not isinstance(expiration_time, int | float):
        raise InvalidRecord(
            f"expiration_time must be a number, got {type(expiration_time).__name__} - help: "
            "pass an absolute time, e.g. kit.dht.get_dht_time() + 60"
        )
    expiration = float(expiration_time)
    if not math.isfinite(expiration):
        raise InvalidRecord(
            f"expiration_time must be finite, got {expiration} - help: pass an absolute time, "
            "e.g. kit.dht.get_dht_time() + 60, and re-store before it passes"
        )
    if expiration > now + limits.max_ttl:
        raise InvalidRecord(
            f"expiration_time is {expiration - now:.0f} s ahead, more than max_ttl="
            f"{limits.max_ttl:.0f} s - help: expiration times are absolute (get_dht_time() + "
            "seconds); re-store long-lived records periodically"
        )
    return expiration

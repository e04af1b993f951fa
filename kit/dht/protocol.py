"""The DHT's RPC messages (ping, store, find) as msgpack maps, with strict decoding; pure.

Three unary protocols run over ``kit.p2p``: :data:`PING`, :data:`STORE` and :data:`FIND` (find
covers Kademlia's FIND_NODE and FIND_VALUE, §2.3). Every request and response starts with the
sender's :class:`NodeInfo`, so each message refreshes the receiver's routing table (§2.3). The
caller's PeerID is not in the message: the peer layer authenticated it.

Decoding is strict: every field is type- and size-checked, and anything wrong raises
:class:`~kit.errors.MalformedDHTMessage` (the handler's caller then gets a ``RemoteError`` with
that name, and the node goes on serving). Unknown extra fields are ignored, so a newer peer may
add fields without breaking older ones.

What this module does not do: decide what to store or answer (``node``), check record contents
(``validation``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

import msgpack

from kit.dht.routing import DHTID, Contact
from kit.dht.storage import StoreStatus
from kit.dht.validation import DHTRecord
from kit.errors import MalformedDHTMessage
from kit.p2p.identity import PeerID

PING = "kit/dht/1/ping"
STORE = "kit/dht/1/store"
FIND = "kit/dht/1/find"

MAX_ADDRESSES = 8  # addresses per node; more are a misbehaving peer
MAX_ADDRESS_CHARS = 512
MAX_RECORDS_PER_STORE = 64
MAX_KEYS_PER_FIND = 32
MAX_CONTACTS = 64  # contacts per find result (>= bucket_size of any sane swarm)
MAX_SUBKEYS_PER_VALUE = 100_000
MAX_ERROR_CHARS = 300


def _malformed(where: str, problem: str) -> MalformedDHTMessage:
    return MalformedDHTMessage(f"malformed DHT message: {where}: {problem}")


def _reject_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code}")


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise _malformed(where, f"missing field {name!r}")
    value = obj[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:  # bool is an int in Python, not on the wire
        raise _malformed(where, f"{name!r} is a bool")
    if not isinstance(value, kind):
        raise _malformed(where, f"{name!r} is {type(value).__name__}")
    return value


def _list(obj: dict[str, Any], name: str, limit: int, where: str) -> list[Any]:
    value = _field(obj, name, list, where)
    if len(value) > limit:
        raise _malformed(where, f"{name!r} has {len(value)} items > {limit}")
    return value  # type: ignore[no-any-return]


_REAL_TYPES = (int, float)  # a tuple: ``int | float`` builds a new union at every call


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, _REAL_TYPES):
        raise _malformed(where, f"expected a number, got {type(value).__name__}")
    return float(value)


def _finite(value: Any, where: str) -> float:
    number = _number(value, where)
    if not math.isfinite(number):
        raise _malformed(where, f"{number} is not finite")
    return number


def _items(value: Any, size: int, where: str) -> list[Any]:
    if not isinstance(value, list) or len(value) != size:
        raise _malformed(where, f"expected a list of {size} items")
    return value


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """The sender of a message, as it describes itself."""

    addresses: tuple[str, ...]  # where others can dial it (empty for client-mode nodes)
    client_mode: bool  # client-mode nodes are never added to routing tables
    incarnation: int  # random per start: a new value means the node restarted (Kademlia §2.5)
    dht_time: float  # the sender's clock, to warn about skew

    def to_wire(self) -> dict[str, Any]:
        return {
            "addrs": list(self.addresses),
            "client": self.client_mode,
            "inc": self.incarnation,
            "time": self.dht_time,
        }

    @classmethod
    def from_wire(cls, obj: Any, where: str = "sender") -> NodeInfo:
        if not isinstance(obj, dict):
            raise _malformed(where, "expected a map")
        return cls(
            addresses=_addresses(_list(obj, "addrs", MAX_ADDRESSES, where), where),
            client_mode=_field(obj, "client", bool, where),
            incarnation=_field(obj, "inc", int, where),
            dht_time=_finite(_field(obj, "time", (int, float), where), where + ".time"),
        )


def _addresses(values: list[Any], where: str) -> tuple[str, ...]:
    for address in values:
        if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS_CHARS:
            raise _malformed(where, "an address is not a str of 1..512 chars")
    return tuple(values)


def _contact_to_wire(contact: Contact) -> list[Any]:
    return [contact.peer_id.to_bytes(), list(contact.addresses)]


def _contact_from_wire(value: Any, where: str) -> Contact:
    raw_id, addresses = _items(value, 2, where)
    if not isinstance(raw_id, bytes) or len(raw_id) != PeerID.SIZE:
        raise _malformed(where, "peer id is not 32 bytes")
    if not isinstance(addresses, list) or len(addresses) > MAX_ADDRESSES:
        raise _malformed(where, "addresses are not a short list")
    return Contact(PeerID(raw_id), _addresses(addresses, where))


def _record_to_wire(record: DHTRecord) -> list[Any]:
    return [record.key, record.subkey, record.value, record.expiration_time]


def _record_from_wire(value: Any, where: str) -> DHTRecord:
    key, subkey, data, expiration = _items(value, 4, where)
    if not isinstance(key, bytes) or not isinstance(data, bytes):
        raise _malformed(where, "key and value must be bytes")
    if subkey is not None and not isinstance(subkey, bytes):
        raise _malformed(where, "subkey must be bytes or nil")
    # a non-finite expiration is a bad record, not a bad message: the node rejects that record
    return DHTRecord(key, subkey, data, _number(expiration, where + ".expiration"))


@dataclasses.dataclass(frozen=True)
class PingRequest:
    sender: NodeInfo

    def to_wire(self) -> dict[str, Any]:
        return {"sender": self.sender.to_wire()}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> PingRequest:
        return cls(NodeInfo.from_wire(obj.get("sender")))


@dataclasses.dataclass(frozen=True)
class PingResponse:
    sender: NodeInfo

    def to_wire(self) -> dict[str, Any]:
        return {"sender": self.sender.to_wire()}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> PingResponse:
        return cls(NodeInfo.from_wire(obj.get("sender")))


@dataclasses.dataclass(frozen=True)
class StoreRequest:
    """Store records; ``in_cache`` asks to keep them in the cache, not as a replica (§2.3)."""

    sender: NodeInfo
    records: tuple[DHTRecord, ...]
    in_cache: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "sender": self.sender.to_wire(),
            "records": [_record_to_wire(record) for record in self.records],
            "cache": self.in_cache,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> StoreRequest:
        records = _list(obj, "records", MAX_RECORDS_PER_STORE, "store")
        return cls(
            sender=NodeInfo.from_wire(obj.get("sender")),
            records=tuple(
                _record_from_wire(r, f"store.records[{i}]") for i, r in enumerate(records)
            ),
            in_cache=_field(obj, "cache", bool, "store"),
        )


@dataclasses.dataclass(frozen=True)
class StoreResponse:
    """One status per stored record, and for rejected ones the error's name and message."""

    sender: NodeInfo
    results: tuple[StoreStatus, ...]
    errors: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "sender": self.sender.to_wire(),
            "results": [int(status) for status in self.results],
            "errors": [error[:MAX_ERROR_CHARS] for error in self.errors],
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> StoreResponse:
        results = _list(obj, "results", MAX_RECORDS_PER_STORE, "store response")
        errors = _list(obj, "errors", MAX_RECORDS_PER_STORE, "store response")
        statuses = []
        for code in results:
            if isinstance(code, bool) or not isinstance(code, int):
                raise _malformed("store response", "a status is not an int")
            try:
                statuses.append(StoreStatus(code))
            except ValueError:
                raise _malformed("store response", f"unknown status {code}") from None
        if len(errors) != len(results) or not all(isinstance(e, str) for e in errors):
            raise _malformed("store response", "errors do not match results")
        return cls(NodeInfo.from_wire(obj.get("sender")), tuple(statuses), tuple(errors))


@dataclasses.dataclass(frozen=True)
class FindRequest:
    """Nearest nodes to each key id, and the values held there if ``want_values`` (§2.3)."""

    sender: NodeInfo
    key_ids: tuple[DHTID, ...]
    want_values: bool

    def to_wire(self) -> dict[str, Any]:
        return {
            "sender": self.sender.to_wire(),
            "keys": [key_id.to_bytes() for key_id in self.key_ids],
            "values": self.want_values,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> FindRequest:
        key_ids = []
        for raw in _list(obj, "keys", MAX_KEYS_PER_FIND, "find"):
            if not isinstance(raw, bytes) or len(raw) != DHTID.SIZE:
                raise _malformed("find", "a key id is not 20 bytes")
            key_ids.append(DHTID.from_bytes(raw))
        return cls(
            sender=NodeInfo.from_wire(obj.get("sender")),
            key_ids=tuple(key_ids),
            want_values=_field(obj, "values", bool, "find"),
        )


@dataclasses.dataclass(frozen=True)
class FoundValue:
    """A value held by the responder: regular (``value``) or a dictionary (``subkeys``)."""

    expiration_time: float
    value: bytes | None = None
    subkeys: tuple[tuple[bytes, bytes, float], ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        if self.subkeys is not None:
            subkeys = [[sub, value, exp] for sub, value, exp in self.subkeys]
            return {"exp": self.expiration_time, "subkeys": subkeys}
        return {"exp": self.expiration_time, "value": self.value}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> FoundValue:
        if not isinstance(obj, dict):
            raise _malformed(where, "expected a map")
        expiration = _finite(obj.get("exp"), where + ".exp")
        if "subkeys" in obj:
            subkeys = []
            for item in _list(obj, "subkeys", MAX_SUBKEYS_PER_VALUE, where):
                subkey, value, sub_expiration = _items(item, 3, where)
                if not isinstance(subkey, bytes) or not isinstance(value, bytes):
                    raise _malformed(where, "subkey and value must be bytes")
                subkeys.append((subkey, value, _finite(sub_expiration, where)))
            return cls(expiration, subkeys=tuple(subkeys))
        return cls(expiration, value=_field(obj, "value", bytes, where))


@dataclasses.dataclass(frozen=True)
class FindResult:
    value: FoundValue | None
    nearest: tuple[Contact, ...]

    def to_wire(self) -> dict[str, Any]:
        found = None if self.value is None else self.value.to_wire()
        return {"found": found, "nearest": [_contact_to_wire(c) for c in self.nearest]}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> FindResult:
        if not isinstance(obj, dict):
            raise _malformed(where, "expected a map")
        found = obj.get("found")
        nearest = _list(obj, "nearest", MAX_CONTACTS, where)
        return cls(
            value=None if found is None else FoundValue.from_wire(found, where + ".found"),
            nearest=tuple(_contact_from_wire(c, where + ".nearest") for c in nearest),
        )


@dataclasses.dataclass(frozen=True)
class FindResponse:
    sender: NodeInfo
    results: tuple[FindResult, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"sender": self.sender.to_wire(), "results": [r.to_wire() for r in self.results]}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> FindResponse:
        results = _list(obj, "results", MAX_KEYS_PER_FIND, "find response")
        return cls(
            sender=NodeInfo.from_wire(obj.get("sender")),
            results=tuple(
                FindResult.from_wire(r, f"find.results[{i}]") for i, r in enumerate(results)
            ),
        )


Message = PingRequest | PingResponse | StoreRequest | StoreResponse | FindRequest | FindResponse
M = TypeVar("M", PingRequest, PingResponse, StoreRequest, StoreResponse, FindRequest, FindResponse)


def encode(message: Message) -> bytes:
    """The msgpack bytes of a message."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode(message_type: type[M], data: bytes) -> M:
    """Decode ``data`` as ``message_type`` (one of the message classes above), strictly.

    Raises:
        MalformedDHTMessage: not msgpack, not a map, or any field of the wrong type or size.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, ext_hook=_reject_extension)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise _malformed(message_type.__name__, f"not msgpack ({e})") from None
    if not isinstance(obj, dict):
        raise _malformed(message_type.__name__, "expected a map")
    return message_type.from_wire(obj)

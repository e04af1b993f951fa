"""DHT RPC messages: round trips, and strict decoding that turns bad input into one typed error."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kit.dht.protocol import (
    FindRequest,
    FindResponse,
    FindResult,
    FoundValue,
    NodeInfo,
    PingRequest,
    PingResponse,
    StoreRequest,
    StoreResponse,
    decode,
    encode,
)
from kit.dht.routing import DHTID, Contact
from kit.dht.storage import StoreStatus
from kit.dht.validation import DHTRecord
from kit.errors import MalformedDHTMessage
from kit.p2p.identity import PeerID

INFO = NodeInfo(("memory://abc", "/ip4/127.0.0.1/tcp/1/ws"), False, 12345, 1.7e9)
CONTACT = Contact(PeerID(hashlib.sha256(b"x").digest()), ("memory://x",))
MESSAGES = [
    PingRequest(INFO),
    PingResponse(NodeInfo((), True, 0, 1.0)),
    StoreRequest(
        INFO, (DHTRecord(b"\xa1k", None, b"\x01", 10.0), DHTRecord(b"k", b"s", b"v", 2)), True
    ),
    StoreResponse(INFO, (StoreStatus.STORED, StoreStatus.INVALID), ("", "ForgedRecord: no")),
    FindRequest(INFO, (DHTID.generate("a"), DHTID.generate("b")), True),
    FindResponse(
        INFO,
        (
            FindResult(FoundValue(5.0, value=b"\x01"), (CONTACT,)),
            FindResult(FoundValue(6.0, subkeys=((b"s", b"v", 6.0),)), ()),
            FindResult(None, (CONTACT, CONTACT)),
        ),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: Any) -> None:
    assert decode(type(message), encode(message)) == message


def wire(message: Any, **changes: Any) -> bytes:
    obj = message.to_wire()
    for path, value in changes.items():
        target = obj
        *parents, last = path.split("__")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return msgpack.packb(obj, use_bin_type=True)


STORE, FIND, FOUND = MESSAGES[2], MESSAGES[4], MESSAGES[5]
MALFORMED = [
    (PingRequest, b"garbage \xc1"),
    (PingRequest, msgpack.packb([1, 2])),
    (PingRequest, msgpack.packb({})),
    (PingRequest, wire(MESSAGES[0], sender__client=1)),
    (PingRequest, wire(MESSAGES[0], sender__inc=True)),
    (PingRequest, wire(MESSAGES[0], sender__time=float("nan"))),
    (PingRequest, wire(MESSAGES[0], sender__addrs=["a"] * 9)),
    (PingRequest, wire(MESSAGES[0], sender__addrs=[b"bytes"])),
    (PingRequest, wire(MESSAGES[0], sender__addrs=["x" * 513])),
    (StoreRequest, wire(STORE, records=[[b"k", None, b"v"]])),
    (StoreRequest, wire(STORE, records=[["k", None, b"v", 1.0]])),
    (StoreRequest, wire(STORE, records=[[b"k", 5, b"v", 1.0]])),
    (StoreRequest, wire(STORE, records=[[b"k", None, b"v", "soon"]])),
    (StoreRequest, wire(STORE, records=[[b"k", None, b"v", 1.0]] * 65)),
    (StoreRequest, wire(STORE, cache=KeyError)),
    (StoreResponse, wire(MESSAGES[3], results=[99, 1])),
    (StoreResponse, wire(MESSAGES[3], errors=[""])),
    (FindRequest, wire(FIND, keys=[b"short"])),
    (FindRequest, wire(FIND, keys=[b"x" * 20] * 33)),
    (FindRequest, wire(FIND, values="yes")),
    (FindResponse, wire(FOUND, results__0__nearest=[[b"short id", []]])),
    (FindResponse, wire(FOUND, results__0__nearest=[[b"x" * 32]])),
    (FindResponse, wire(FOUND, results__0__found={"exp": float("inf"), "value": b""})),
    (FindResponse, wire(FOUND, results__0__found={"exp": 1.0})),
    (FindResponse, wire(FOUND, results__1__found={"exp": 1.0, "subkeys": [[b"s", "v", 1.0]]})),
    (FindResponse, wire(FOUND, results__0__found=[1])),
    (FindResponse, msgpack.packb({"sender": INFO.to_wire(), "results": None})),
    (FindResponse, msgpack.packb(msgpack.ExtType(1, b""))),
]


@pytest.mark.parametrize("message_type,data", MALFORMED)
def test_malformed_messages_raise_one_typed_error(message_type: Any, data: bytes) -> None:
    with pytest.raises(MalformedDHTMessage):
        decode(message_type, data)


def test_non_finite_expirations_are_the_records_problem_not_the_messages() -> None:
    # a storing node rejects that one record (InvalidRecord) and stores the others
    data = wire(STORE, records=[[b"k", None, b"v", float("inf")]])
    assert decode(StoreRequest, data).records[0].expiration_time == float("inf")


def test_unknown_extra_fields_are_ignored_for_forward_compatibility() -> None:
    assert decode(PingRequest, wire(MESSAGES[0], future_field=[1, 2])) == MESSAGES[0]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    for message_type in (PingRequest, StoreRequest, StoreResponse, FindRequest, FindResponse):
        try:
            decode(message_type, data)
        except MalformedDHTMessage:
            pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from(["sender", "records", "keys", "results", "cache", "values",
                                        "errors"]), msgpack_values, max_size=7))  # fmt: skip
def test_well_formed_msgpack_of_the_wrong_shape_is_rejected_cleanly(obj: dict[str, Any]) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    for message_type in (PingRequest, StoreRequest, StoreResponse, FindRequest, FindResponse):
        try:
            decode(message_type, data)
        except MalformedDHTMessage:
            pass

"""Pure lookup bookkeeping (Kademlia §2.3) and merging of values returned by replicas."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import msgpack

from kit.dht.lookup import Lookup, ValueSearch, batches
from kit.dht.protocol import MAX_RECORDS_PER_STORE, FoundValue
from kit.dht.routing import DHTID, Contact
from kit.dht.storage import ValueWithExpiration
from kit.dht.validation import DHTRecord, Ed25519SignatureValidator, default_validator
from kit.dht.values import RecordLimits
from kit.p2p.identity import Identity, PeerID


def node(n: int) -> tuple[DHTID, Contact]:
    item = Contact(PeerID(hashlib.sha256(n.to_bytes(4, "big")).digest()))
    return item.node_id, item


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_lookup_queries_the_closest_first_and_finishes_when_the_beam_answered() -> None:
    target = DHTID.generate("target")
    nodes = [node(n) for n in range(30)]
    by_distance = sorted(nodes, key=lambda pair: pair[0] ^ target)
    lookup = Lookup(target, beam=3)
    lookup.add(nodes[:10])
    first = lookup.next_to_query(2)
    closest_known = sorted(nodes[:10], key=lambda pair: pair[0] ^ target)
    assert first == closest_known[:2]
    assert not lookup.finished
    lookup.responded(first[0][0], by_distance[:5])  # tells us about much closer nodes
    lookup.failed(first[1][0])
    rounds = 0
    while not lookup.finished:
        batch = lookup.next_to_query(3)
        assert batch, "unfinished lookup must have something to query"
        for node_id, _ in batch:
            lookup.responded(node_id)
        rounds += 1
    assert rounds <= 3
    alive = [n for n, _ in by_distance if n != first[1][0]]  # the failed one is not "nearest"
    assert [n for n, _ in lookup.nearest_responded(3)] == alive[:3]


def test_failed_nodes_leave_the_beam_and_excluded_ids_never_enter() -> None:
    target = DHTID(0)
    nodes = sorted((node(n) for n in range(6)), key=lambda pair: pair[0] ^ target)
    lookup = Lookup(target, beam=2, exclude={nodes[1][0]})
    lookup.add(nodes)
    batch = lookup.next_to_query(5)
    assert [n for n, _ in batch] == [nodes[0][0], nodes[2][0]]  # nodes[1] is excluded (us)
    lookup.failed(nodes[0][0])
    assert [n for n, _ in lookup.next_to_query(5)] == [nodes[3][0]]  # the beam moves on
    lookup.responded(nodes[2][0])
    lookup.responded(nodes[3][0])
    assert lookup.finished
    assert lookup.next_to_query(5) == []


def search(sufficient: float = math.inf, key: Any = "key") -> ValueSearch:
    return ValueSearch(
        pack(key),
        sufficient,
        default_validator(),
        RecordLimits(),
        max_subkeys=100,
        max_dictionary_bytes=10_000,
    )


def test_value_search_keeps_the_latest_value_and_merges_subkeys() -> None:
    now = 1000.0
    values = search()
    a, b = node(1)[0], node(2)[0]
    values.add_found(FoundValue(now + 10, value=pack("old")), a, now)
    values.add_found(FoundValue(now + 20, value=pack("new")), b, now)
    assert values.result(now) == ValueWithExpiration("new", now + 20)
    assert values.holders == {a, b}  # both held the freshest value at the time they answered
    assert not values.done(now)  # latest=True: never sufficient, ask everyone on the way

    merged = search(key="dict")
    merged.add_found(FoundValue(now + 5, subkeys=((pack("x"), pack(1), now + 5),)), a, now)
    merged.add_found(
        FoundValue(now + 9, subkeys=((pack("x"), pack(0), now + 1), (pack("y"), pack(2), now + 9))),
        b,
        now,
    )
    assert merged.result(now) == ValueWithExpiration(
        {"x": ValueWithExpiration(1, now + 5), "y": ValueWithExpiration(2, now + 9)}, now + 9
    )


def test_value_search_drops_invalid_records_and_is_done_when_fresh_enough() -> None:
    now = 1000.0
    owner = Ed25519SignatureValidator(Identity.generate())
    values = search(sufficient=now, key="progress")
    forged = FoundValue(now + 10, subkeys=((pack(owner.local_owner), pack("forged"), now + 10),))
    values.add_found(forged, node(1)[0], now)
    values.add_found(FoundValue(now + 10, value=b"\xc1 not msgpack"), node(2)[0], now)
    assert values.result(now) is None and not values.done(now) and not values.holders
    record = DHTRecord(pack("progress"), pack(owner.local_owner), pack("real"), now + 10)
    record = dataclasses.replace(record, value=owner.sign_value(record))
    honest = FoundValue(now + 10, subkeys=((record.subkey or b"", record.value, now + 10),))
    values.add_found(honest, node(3)[0], now)
    assert values.done(now)
    result = values.result(now)
    assert result is not None and result.value == {
        owner.local_owner: ValueWithExpiration("real", now + 10)
    }


def test_batches_bound_count_and_bytes() -> None:
    small = [DHTRecord(b"k", None, b"v", 1.0)] * (MAX_RECORDS_PER_STORE + 1)
    assert [len(b) for b in batches(small)] == [MAX_RECORDS_PER_STORE, 1]
    big = [DHTRecord(b"k", None, b"v" * 400_000, 1.0)] * 5
    assert [len(b) for b in batches(big)] == [2, 2, 1]

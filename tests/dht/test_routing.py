"""Pure routing: DHTID, XOR distance, k-bucket splits and replacement, staleness, the blacklist."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest

from kit.dht.routing import DHTID, Blacklist, Contact, RoutingTable
from kit.p2p.identity import PeerID


def peer(n: int) -> PeerID:
    return PeerID(hashlib.sha256(n.to_bytes(4, "big")).digest())


def contact(n: int) -> tuple[DHTID, Contact]:
    item = Contact(peer(n), (f"memory://{n}",))
    return item.node_id, item


def test_ids_are_sha1_of_msgpack_like_hivemind() -> None:
    expected = int.from_bytes(hashlib.sha1(msgpack.packb("key", use_bin_type=True)).digest(), "big")
    assert DHTID.generate("key") == expected
    assert DHTID.generate("key") != DHTID.generate("key2")
    assert DHTID.generate() != DHTID.generate()  # random ids
    node_id = DHTID.from_peer_id(peer(1))
    assert DHTID.from_bytes(node_id.to_bytes()) == node_id
    assert len(node_id.to_bytes()) == 20
    with pytest.raises(ValueError):
        DHTID(2**160)
    with pytest.raises(ValueError):
        DHTID.from_bytes(b"short")


def test_xor_distance_is_a_metric() -> None:
    rng = random.Random(0)
    ids = [DHTID(rng.randrange(DHTID.MAX)) for _ in range(20)]
    for a in ids:
        assert a.xor_distance(a) == 0
        for b in ids:
            assert a.xor_distance(b) == b.xor_distance(a)
            for c in ids[:5]:
                assert a.xor_distance(c) <= a.xor_distance(b) + b.xor_distance(c)


def test_nearest_is_sorted_by_xor_distance_and_excludes() -> None:
    table = RoutingTable(DHTID(0), bucket_size=20, depth_modulo=5, now=0.0)
    contacts = [contact(n) for n in range(200)]
    for node_id, item in contacts:
        table.add_or_update(node_id, item, now=1.0)
    target = DHTID.generate("some key")
    known = list(table.contacts())
    expected = sorted(known, key=lambda pair: pair[0] ^ target)[:7]
    assert table.nearest(target, 7) == expected
    excluded = {expected[0][0]}
    assert (
        table.nearest(target, 7, exclude=excluded)
        == sorted(
            [pair for pair in known if pair[0] not in excluded], key=lambda pair: pair[0] ^ target
        )[:7]
    )


def test_buckets_split_only_where_the_own_id_is_kademlia_2_4() -> None:
    own = DHTID(0)
    table = RoutingTable(own, bucket_size=2, depth_modulo=1, now=0.0)  # plain §2.4 rule
    far = [DHTID(2**159 + i) for i in range(3)]  # all in the half that excludes our id
    for node_id in far[:2]:
        assert table.add_or_update(node_id, Contact(peer(node_id % 1000)), now=1.0) is None
    # the third far node fills a bucket that does not cover our id: no split, ping the LRU
    least_recent = table.add_or_update(far[2], Contact(peer(3)), now=2.0)
    assert least_recent is not None and least_recent[0] == far[0]
    assert far[2] not in table
    assert all(bucket.depth <= 1 for bucket in table.buckets)
    # near nodes keep splitting the bucket that covers our id
    for i in range(1, 6):
        table.add_or_update(DHTID(2 ** (i + 10)), Contact(peer(100 + i)), now=3.0)
    assert max(bucket.depth for bucket in table.buckets) > 1
    assert sum(bucket.covers(own) for bucket in table.buckets) == 1
    lowers = [bucket.lower for bucket in table.buckets]
    assert lowers == sorted(lowers) and table.buckets[-1].upper == DHTID.MAX


def test_depth_modulo_also_splits_far_buckets_kademlia_4_2() -> None:
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=5, now=0.0)
    far = [DHTID(2**159 + (i << 156)) for i in range(6)]  # they differ at depths 2..4
    for i, node_id in enumerate(far):
        table.add_or_update(node_id, Contact(peer(i)), now=1.0)
    # depth 1 is not a multiple of 5, so the far half splits further and takes more nodes
    assert sum(node_id in table for node_id in far) > 2


def test_unresponsive_contact_is_replaced_by_the_newest_replacement() -> None:
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1, now=0.0)
    far = [DHTID(2**159 + i) for i in range(4)]
    for node_id in far:
        table.add_or_update(node_id, Contact(peer(node_id % 1000)), now=1.0)
    assert far[0] in table and far[1] in table
    table.remove(far[0])  # it did not answer the ping
    assert far[0] not in table and far[3] in table  # most recent replacement moves in
    assert table.get(far[3]) == Contact(peer(far[3] % 1000))


def test_seen_contact_moves_to_the_tail_and_updates_addresses() -> None:
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1, now=0.0)
    a, b, c = (DHTID(2**159 + i) for i in range(3))
    table.add_or_update(a, Contact(peer(1), ("old",)), now=1.0)
    table.add_or_update(b, Contact(peer(2)), now=1.0)
    table.add_or_update(a, Contact(peer(1), ("new",)), now=2.0)  # a is now most recent
    least_recent = table.add_or_update(c, Contact(peer(3)), now=3.0)
    assert least_recent is not None and least_recent[0] == b
    assert table.get(a) == Contact(peer(1), ("new",))


def test_stale_buckets_with_explicit_now() -> None:
    table = RoutingTable(DHTID(0), bucket_size=1, depth_modulo=1, now=0.0)
    for n in range(10):
        node_id, item = contact(n)
        table.add_or_update(node_id, item, now=100.0)
    assert table.stale_buckets(now=150.0, refresh_period=60.0) == []
    assert table.stale_buckets(now=160.0, refresh_period=60.0) == table.buckets
    target = table.buckets[0].random_id(random.Random(1))
    assert table.buckets[0].covers(target)
    table.mark_lookup(target, now=160.0)
    assert table.buckets[0] not in table.stale_buckets(now=161.0, refresh_period=60.0)


def test_blacklist_backs_off_exponentially_and_forgets_on_success() -> None:
    blacklist = Blacklist(base_time=5.0, backoff_rate=2.0)
    someone = peer(1)
    assert not blacklist.is_banned(someone, now=0.0)
    assert blacklist.register_failure(someone, now=0.0) == 5.0
    assert blacklist.is_banned(someone, now=4.9)
    assert not blacklist.is_banned(someone, now=5.0)
    assert blacklist.register_failure(someone, now=10.0) == 20.0  # second failure: 10 s
    assert blacklist.register_failure(someone, now=20.0) == 40.0  # third: 20 s
    blacklist.register_success(someone)
    assert not blacklist.is_banned(someone, now=21.0)
    assert blacklist.register_failure(someone, now=30.0) == 35.0
    small = Blacklist(1.0, 2.0, max_entries=3)
    for n in range(5):
        small.register_failure(peer(n), now=0.0)
    assert len(small) == 3 and not small.is_banned(peer(0), now=0.5)

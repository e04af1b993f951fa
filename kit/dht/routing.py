"""Kademlia's routing core, pure: node ids, XOR distance, k-buckets, the blacklist.

Everything here is synchronous and takes ``now`` as an argument; the async driver is
``kit.dht.node``. References are to Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information
System Based on the XOR Metric" (IPTPS 2002).

What this module does not do: no I/O, no clocks, no lookups (``lookup``), no messages
(``protocol``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import heapq
import os
import random
from collections.abc import Collection, Iterator
from typing import Any

import msgpack

from kit.p2p.identity import PeerID


class DHTID(int):
    """A 160-bit position on the Kademlia ring: SHA-1 of the msgpack bytes of a key or peer.

    Keys and nodes share one id space (Kademlia §2.1): a record is stored on the nodes whose ids
    are closest to the key's id in XOR distance.
    """

    HASH_BITS = 160
    MIN = 0
    MAX = 2**HASH_BITS
    SIZE = HASH_BITS // 8

    def __new__(cls, value: int) -> DHTID:
        if not cls.MIN <= value < cls.MAX:
            raise ValueError(f"a DHTID is in [0, 2**160), got {value}")
        return super().__new__(cls, value)

    @classmethod
    def from_key_bytes(cls, key_bytes: bytes) -> DHTID:
        """The id of a key already serialized with msgpack."""
        return cls(int.from_bytes(hashlib.sha1(key_bytes).digest(), "big"))

    @classmethod
    def generate(cls, source: Any = None) -> DHTID:
        """SHA-1 of ``msgpack(source)`` as hivemind does, or a random id if ``source`` is None."""
        if source is None:
            return cls(int.from_bytes(os.urandom(cls.SIZE), "big"))
        return cls.from_key_bytes(msgpack.packb(source, use_bin_type=True))

    @classmethod
    def from_peer_id(cls, peer_id: PeerID) -> DHTID:
        """A node's id derives from its PeerID, so no node can pick its place on the ring."""
        return cls.generate(peer_id.to_bytes())

    @classmethod
    def from_bytes(cls, raw: bytes) -> DHTID:  # type: ignore[override]
        if len(raw) != cls.SIZE:
            raise ValueError(f"a DHTID is {cls.SIZE} bytes, got {len(raw)}")
        return cls(int.from_bytes(raw, "big"))

    def to_bytes(self) -> bytes:  # type: ignore[override]
        return int(self).to_bytes(self.SIZE, "big")

    def xor_distance(self, other: int) -> int:
        """Kademlia's metric (§2.1): symmetric, unidirectional, obeys the triangle inequality."""
        return int(self) ^ int(other)

    def __repr__(self) -> str:
        return f"DHTID({int(self):040x})"


@dataclasses.dataclass(frozen=True)
class Contact:
    """How to reach one DHT node: its PeerID and the addresses it announced."""

    peer_id: PeerID
    addresses: tuple[str, ...] = ()

    @property
    def node_id(self) -> DHTID:
        return DHTID.from_peer_id(self.peer_id)


class KBucket:
    """Contacts whose ids fall in ``[lower, upper)``, least recently seen first (Kademlia §2.2).

    Full buckets keep newcomers in a replacement cache (Kademlia §4.1) and promote the most
    recent one when a contact is removed.
    """

    def __init__(self, lower: int, upper: int, size: int, depth: int, now: float) -> None:
        self.lower = lower
        self.upper = upper
        self.size = size
        self.depth = depth
        self.last_updated = now
        self.nodes: collections.OrderedDict[DHTID, Contact] = collections.OrderedDict()
        self.replacements: collections.OrderedDict[DHTID, Contact] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"KBucket(depth={self.depth}, nodes={len(self.nodes)}, lower={self.lower:x})"

    def covers(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    @property
    def is_full(self) -> bool:
        return len(self.nodes) >= self.size

    def least_recent(self) -> tuple[DHTID, Contact]:
        return next(iter(self.nodes.items()))

    def add_or_update(self, node_id: DHTID, contact: Contact, now: float) -> bool:
        """Add or refresh a contact; False if the bucket is full (it goes to the replacements)."""
        self.last_updated = now
        if node_id in self.nodes:
            self.nodes[node_id] = contact
            self.nodes.move_to_end(node_id)
            return True
        if not self.is_full:
            self.replacements.pop(node_id, None)
            self.nodes[node_id] = contact
            return True
        self.replacements[node_id] = contact
        self.replacements.move_to_end(node_id)
        while len(self.replacements) > self.size:
            self.replacements.popitem(last=False)
        return False

    def remove(self, node_id: DHTID) -> None:
        """Forget a contact; the most recently seen replacement takes its place."""
        self.replacements.pop(node_id, None)
        if self.nodes.pop(node_id, None) is not None and self.replacements:
            new_id, new_contact = self.replacements.popitem(last=True)
            self.nodes[new_id] = new_contact

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.lower + self.upper) // 2
        halves = (
            KBucket(self.lower, middle, self.size, self.depth + 1, self.last_updated),
            KBucket(middle, self.upper, self.size, self.depth + 1, self.last_updated),
        )
        for node_id, contact in self.nodes.items():
            halves[node_id >= middle].nodes[node_id] = contact
        for node_id, contact in self.replacements.items():
            halves[node_id >= middle].replacements[node_id] = contact
        return halves

    def random_id(self, rng: random.Random) -> DHTID:
        return DHTID(rng.randrange(self.lower, self.upper))


class RoutingTable:
    """This node's k-buckets, covering the whole id space (Kademlia §2.4).

    A full bucket is split when its range covers this node's own id (§2.4), or when its depth is
    not a multiple of ``depth_modulo`` (the relaxed rule of §4.2, which lets a node route by
    ``depth_modulo`` bits at a time, as hivemind does). Otherwise the newcomer waits in the
    replacement cache and the caller should ping the least recently seen contact (§2.2): if it
    does not answer, :meth:`remove` it and the newcomer moves in.

    Args:
        node_id: this node's id.
        bucket_size: k, contacts per bucket. Increase it if lookups fail under heavy churn.
        depth_modulo: b of §4.2; 1 disables the relaxation.
    """

    def __init__(self, node_id: DHTID, bucket_size: int, depth_modulo: int, now: float) -> None:
        self.node_id = node_id
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self.buckets = [KBucket(DHTID.MIN, DHTID.MAX, bucket_size, 0, now)]
        self._bucket_lowers = [DHTID.MIN]

    def __len__(self) -> int:
        return sum(len(bucket.nodes) for bucket in self.buckets)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, int) and node_id in self.bucket_for(node_id).nodes

    def bucket_for(self, node_id: int) -> KBucket:
        return self.buckets[bisect.bisect_right(self._bucket_lowers, node_id) - 1]

    def get(self, node_id: DHTID) -> Contact | None:
        return self.bucket_for(node_id).nodes.get(node_id)

    def contacts(self) -> Iterator[tuple[DHTID, Contact]]:
        for bucket in self.buckets:
            yield from bucket.nodes.items()

    def add_or_update(
        self, node_id: DHTID, contact: Contact, now: float
    ) -> tuple[DHTID, Contact] | None:
        """Add or refresh a contact that just talked to us.

        Returns:
            None, or the least recently seen contact of a full bucket, which the caller should
            ping: the newcomer replaces it only if it does not answer (Kademlia §2.2).
        """
        if node_id == self.node_id:
            return None
        while True:
            bucket = self.bucket_for(node_id)
            if bucket.add_or_update(node_id, contact, now):
                return None
            may_split = bucket.covers(self.node_id) or bucket.depth % self.depth_modulo != 0
            if not may_split or bucket.depth >= DHTID.HASH_BITS:
                return bucket.least_recent()
            bucket.replacements.pop(node_id, None)
            self._split(bucket)

    def remove(self, node_id: DHTID) -> None:
        self.bucket_for(node_id).remove(node_id)

    def _split(self, bucket: KBucket) -> None:
        index = self.buckets.index(bucket)
        left, right = bucket.split()
        self.buckets[index : index + 1] = [left, right]
        self._bucket_lowers[index : index + 1] = [left.lower, right.lower]

    def nearest(
        self, target: int, k: int, exclude: Collection[int] = ()
    ) -> list[tuple[DHTID, Contact]]:
        """The ``k`` known contacts closest to ``target`` by XOR distance, nearest first."""
        candidates = (item for item in self.contacts() if item[0] not in exclude)
        return heapq.nsmallest(k, candidates, key=lambda item: item[0] ^ target)

    def mark_lookup(self, target: int, now: float) -> None:
        """A lookup for ``target`` refreshes the bucket covering it (Kademlia §2.3)."""
        self.bucket_for(target).last_updated = now

    def stale_buckets(self, now: float, refresh_period: float) -> list[KBucket]:
        """Buckets with no lookup or new contact for ``refresh_period`` (Kademlia §2.3)."""
        return [b for b in self.buckets if now - b.last_updated >= refresh_period]


class Blacklist:
    """Peers that failed to answer, banned for a time that grows with each failure.

    A peer's n-th consecutive failure bans it for ``base_time * backoff_rate ** (n - 1)``
    seconds (hivemind's rule); one success forgets its failures.

    Args:
        base_time: ban after the first failure. Increase it if dead peers slow lookups down.
        backoff_rate: growth of the ban per further failure.
        max_entries: failures of more peers than this are forgotten, oldest first.
    """

    def __init__(self, base_time: float, backoff_rate: float, max_entries: int = 10_000) -> None:
        self.base_time = base_time
        self.backoff_rate = backoff_rate
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[PeerID, tuple[int, float]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def register_failure(self, peer_id: PeerID, now: float) -> float:
        """Record a failure; returns when the ban ends."""
        failures, _ = self._entries.pop(peer_id, (0, now))
        banned_until = now + self.base_time * self.backoff_rate**failures
        self._entries[peer_id] = (failures + 1, banned_until)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return banned_until

    def register_success(self, peer_id: PeerID) -> None:
        self._entries.pop(peer_id, None)

    def is_banned(self, peer_id: PeerID, now: float) -> bool:
        entry = self._entries.get(peer_id)
        return entry is not None and now < entry[1]

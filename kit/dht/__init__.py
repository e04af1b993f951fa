"""kit.dht: a Kademlia DHT with hivemind's store/get semantics, over kit.p2p (torch-free).

Read in this order: ``values`` (what may be stored) → ``storage`` (expiring records, pure) →
``routing`` (ids, k-buckets, pure) → ``validation`` (owner signatures, schemas, pure) →
``protocol`` (RPC messages, pure) → ``lookup`` (lookup bookkeeping, pure) → ``config`` (node
settings, the DHT clock) → ``network`` (requests, lookups, routing-table upkeep) and ``serving``
(answers) → ``bootstrap`` (joining) and ``publishing`` (own records) → ``node`` (the async node)
→ ``dht`` (the blocking facade for user code) → ``cli`` (``kit dht``).
"""

from kit.dht.config import DHTConfig, get_dht_time
from kit.dht.dht import DHT, PeerFactory, parse_maddr
from kit.dht.node import DHTNode
from kit.dht.routing import DHTID
from kit.dht.storage import DictionaryDHTValue, StoreStatus, ValueWithExpiration
from kit.dht.validation import (
    CompositeValidator,
    DHTRecord,
    Ed25519SignatureValidator,
    RecordValidator,
    SchemaValidator,
    owner_marker,
)
from kit.dht.values import RecordLimits

__all__ = [
    "DHT",
    "DHTID",
    "CompositeValidator",
    "DHTConfig",
    "DHTNode",
    "DHTRecord",
    "DictionaryDHTValue",
    "Ed25519SignatureValidator",
    "PeerFactory",
    "RecordLimits",
    "RecordValidator",
    "SchemaValidator",
    "StoreStatus",
    "ValueWithExpiration",
    "get_dht_time",
    "owner_marker",
    "parse_maddr",
]

"""Publishing a node's own records: storing them on the nodes nearest their keys, and again.

:class:`Publisher` keeps the records this node stored (its *own* records, the newest per key and
subkey) and stores a record on the ``num_replicas`` nodes nearest to its key (hivemind: 5, not
k), this node among them if it is one of the nearest and serves (client-mode nodes hold no
records for others). :meth:`Publisher.republish` stores every unexpired own record again on its
current nearest nodes (the node's republish loop calls it, Kademlia §2.5). The cache follows
each store (hivemind's ``_update_cache_on_store``).

What this module does not do: packing and checking a record (``node``, ``validation``),
lookups (``bootstrap``, ``network``), reading values (``node``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kit.dht.config import DHTConfig, get_dht_time
from kit.dht.lookup import Lookup, ValueSearch, store_record
from kit.dht.network import DHTNetwork
from kit.dht.routing import DHTID
from kit.dht.storage import DHTStorage, StoreStatus
from kit.dht.validation import DHTRecord

#: A lookup of a key id: (key id, beam, value search, deadline) -> its outcome.
LookupFunction = Callable[[DHTID, int, "ValueSearch | None", float], Awaitable[Lookup]]


class Publisher:
    """A node's own records and their stores. The node lends it its network, storage, cache,
    settings, lookup (seeded from the initial peers) and clock (monotonic seconds)."""

    def __init__(
        self,
        network: DHTNetwork,
        storage: DHTStorage,
        cache: DHTStorage,
        config: DHTConfig,
        *,
        lookup: LookupFunction,
        clock: Callable[[], float],
    ) -> None:
        self.network = network
        self.storage = storage
        self.cache = cache
        self.config = config
        self.lookup = lookup
        self.clock = clock
        self.node_id = network.node_id
        self.own_records: dict[tuple[bytes, bytes | None], DHTRecord] = {}

    async def store(self, record: DHTRecord) -> bool:
        """Keep ``record`` as our own (unless we hold a later one) and publish it."""
        held = self.own_records.get((record.key, record.subkey))
        if held is None or held.expiration_time <= record.expiration_time:
            self.own_records[(record.key, record.subkey)] = record
        return await self.publish(record)

    async def republish(self) -> int:
        """Re-store the unexpired own records; how many at least one node accepted."""
        now = get_dht_time()
        for identifier, record in list(self.own_records.items()):
            if record.expiration_time < now:
                del self.own_records[identifier]
        semaphore = asyncio.Semaphore(8)

        async def publish(record: DHTRecord) -> bool:
            async with semaphore:
                return await self.publish(record)

        outcomes = await asyncio.gather(*(publish(r) for r in list(self.own_records.values())))
        return sum(outcomes)

    async def publish(self, record: DHTRecord) -> bool:
        """Store ``record`` on the nearest nodes to its key; True if one of them accepted it."""
        key_id = DHTID.from_key_bytes(record.key)
        deadline = self.clock() + self.config.lookup_timeout
        lookup = await self.lookup(key_id, self.config.beam_size, None, deadline)
        replicas = self.config.num_replicas
        targets = lookup.nearest_responded(replicas)
        here = not self.network.client_mode and (
            len(targets) < replicas or self.node_id ^ key_id < targets[-1][0] ^ key_id
        )
        if here:
            targets = targets[: replicas - 1]
        outcomes = await asyncio.gather(
            *(self.network.store_at(contact, [record]) for _, contact in targets)
        )
        now = get_dht_time()
        stored = any(result is not None and result[0] is StoreStatus.STORED for result in outcomes)
        if here:
            stored |= store_record(self.storage, key_id, record, now) is StoreStatus.STORED
        if self.config.cache_on_store:
            self._cache_on_store(key_id, record, stored, now)
        return stored

    def _cache_on_store(self, key_id: DHTID, record: DHTRecord, stored: bool, now: float) -> None:
        """Keep the cache consistent with a store (hivemind's ``_update_cache_on_store``)."""
        if not stored:
            self.cache.remove(key_id)  # others hold something newer: our cached copy is stale
        elif record.subkey is None or key_id in self.cache:
            store_record(self.cache, key_id, record, now)
